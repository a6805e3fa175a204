"""Ulysses sequence parallelism: two gloo ranks of one sequence-parallel group == one rank without it.

Both ranks get the same 8 rows, as the driver's RankGroups gives them; each runs half of every packed
micro-batch's tokens (the odd token counts take the padding segment). Old-policy (with sum pi^2), reference and value passes, an
actor update (PPO clip + low_var_kl KL loss + entropy bonus) and a critic update must give what one rank gives on
the whole batch: the same log-probs, values, loss metrics, gradient norms and, after the updates, the same
weights. The actor update is run once with fixed micro-batches and once packed to a token budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ..spawn import run_ranks
from .helpers import full_weights, make_batch, make_cfg, make_worker, max_abs_diff, start_process_group

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
TIMEOUT_S = 300
ATOL = 2e-5  # fp32: the same sums split over two ranks and re-added in another order
KEYS = ("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=True",
        "critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=True")
SP = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2")
PACKED = ("actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24")


def _run(worker, dynamic: bool) -> dict:
    """Every pass and both updates on the whole test batch; what the comparison reads."""
    batch = make_batch(seed=41)
    mask = batch.response_mask
    old, entropy, sum_sq = worker.compute_log_prob(batch)
    ref = worker.compute_ref_log_prob(batch)
    values = worker.compute_values(batch)
    returns = (torch.linspace(-1, 1, mask.shape[1]) * mask).contiguous()
    train = batch.replace(old_logp=old, ref_logp=ref - 0.05 * mask, values=values, returns=returns)
    actor = worker.update_actor(train)
    critic = worker.update_critic(train)
    after, _, _ = worker.compute_log_prob(batch)
    return {"old": old, "entropy": entropy, "sum_sq": sum_sq, "ref": ref, "values": values, "actor": actor, "critic": critic,
            "after": after, "values_after": worker.compute_values(batch), "dynamic": dynamic,
            "actor_weights": full_weights(worker.actor.module), "critic_weights": full_weights(worker.critic.module)}


def _rank_main(rank: int, model_path: str, port: int, out_dir: str, dynamic: bool) -> None:
    from grpo_npu.device import get_device
    from grpo_npu.workers import fsdp

    torch.set_num_threads(1)
    fsdp.init_distributed(get_device("cpu"), rank=rank, world_size=WORLD_SIZE, master_addr="127.0.0.1",
                          master_port=port)
    try:
        cfg = make_cfg(model_path, *KEYS, *SP, *(PACKED if dynamic else ()), world_size=WORLD_SIZE)
        result = _run(make_worker(cfg), dynamic)
    finally:
        fsdp.destroy_distributed()
    torch.save(result, Path(out_dir, f"rank{rank}.pt"))


def _two_ranks(model_path: str, out_dir: Path, dynamic: bool) -> list[dict]:
    from grpo_npu.workers.fsdp import free_port

    run_ranks(_rank_main, (model_path, free_port(), str(out_dir), dynamic), WORLD_SIZE, TIMEOUT_S,
              f"the {WORLD_SIZE}-rank sequence-parallel run")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed_micro_batches", "token_budget"])
def test_two_sequence_parallel_ranks_equal_one_rank(tiny_model_path, tmp_path, dynamic):
    two = _two_ranks(tiny_model_path, tmp_path, dynamic)
    start_process_group()
    one = _run(make_worker(make_cfg(tiny_model_path, *KEYS, *(PACKED if dynamic else ()))), dynamic)
    for got in two:  # every rank of the group holds the whole answer
        for key in ("old", "sum_sq", "ref", "values", "after", "values_after"):
            torch.testing.assert_close(got[key], one[key], atol=ATOL, rtol=0, msg=key)
        assert got["entropy"]["actor/entropy"] == pytest.approx(one["entropy"]["actor/entropy"], abs=ATOL)
        for role in ("actor", "critic"):
            assert got[role].keys() == one[role].keys()
            for key, value in one[role].items():
                assert got[role][key] == pytest.approx(value, rel=1e-4, abs=ATOL), (role, key)
        assert max_abs_diff(got["actor_weights"], one["actor_weights"]) < ATOL
        assert max_abs_diff(got["critic_weights"], one["critic_weights"]) < ATOL
    assert (one["after"] - one["old"]).abs().max() > 1e-3  # the update moved the policy: the comparison can fail
