"""Bypass-mode rollout correction on two Ray ranks (gloo) == one in-process rank.

verl normalises the IS weights of each update micro-batch over the ranks (distributed_masked_mean in its
workers): with one micro-batch per rank, two ranks of 4 rows divide by the mean of the same 8 rows one rank of 8
does, so the update (loss, gradient norm, weights after it) must agree. A rank whose rows all leave the loss
(mask_truncated_completions) still takes part in that all-reduce, with nothing: without it the other rank would
wait forever.
"""

from __future__ import annotations

import pytest
import torch

from grpo_npu.workers import LocalGroup, RayGroup
from grpo_npu.workers.hybrid import HybridWorker

from .helpers import make_batch, make_cfg

pytestmark = pytest.mark.slow

ATOL = 1e-5
KEYS = ("actor_rollout_ref.rollout.calculate_log_probs=True", "algorithm.rollout_correction.bypass_mode=True",
        "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=3.0",
        "algorithm.rollout_correction.rollout_is_batch_normalize=True", "algorithm.rollout_correction.loss_type=reinforce",
        "actor_rollout_ref.actor.mask_truncated_completions=True")


@pytest.mark.parametrize("truncated", [False, True], ids=["every_rank_has_tokens", "rank_1_has_none"])
def test_two_ranks_normalise_like_one(tiny_model_path, truncated):
    batch = make_batch(seed=43, empty_row=None)
    noise = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(5))
    batch = batch.replace(old_logp=(-1.0 + 0.3 * noise) * batch.response_mask,  # the engine's log-probs, far off
                          stop_reason=["stop"] * 4 + ["length" if truncated else "stop"] * 4)
    local = LocalGroup(HybridWorker, device_kind="cpu", args=(make_cfg(
        tiny_model_path, *KEYS, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"),))
    try:
        two = RayGroup(HybridWorker, world_size=2, device_kind="cpu", ray_num_cpus=2, args=(make_cfg(
            tiny_model_path, *KEYS, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", world_size=2),))
    except BaseException:
        local.close()
        raise
    try:
        local.call("init_model", 10)
        two.call("init_model", 10)
        one_metrics = local.chunk_and_call("update_actor", batch)[0]
        two_metrics = two.chunk_and_call("update_actor", batch)[0]
        for key in ("actor/pg_loss", "actor/grad_norm", "rollout_corr/rollout_is_batch_norm_factor"):
            assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-4, abs=ATOL), key
        assert one_metrics["rollout_corr/rollout_is_batch_norm_factor"] != pytest.approx(1.0, abs=1e-3)
        after_one = torch.cat([r[0] for r in local.chunk_and_call("compute_log_prob", batch)])
        after_two = torch.cat([r[0] for r in two.chunk_and_call("compute_log_prob", batch)])
        torch.testing.assert_close(after_two, after_one, atol=ATOL, rtol=0)
    finally:
        two.close()
        local.close()
