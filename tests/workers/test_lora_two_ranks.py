"""LoRA on two Ray ranks (gloo) == one in-process rank: log-probs, reference (adapters off), one update,
the synced (merged) weights and the PEFT adapter directory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from grpo_npu.workers import LocalGroup, RayGroup, lora
from grpo_npu.workers.hybrid import HybridWorker

from .helpers import make_batch, make_cfg

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

ATOL = 1e-5  # same-model fp32 passes whose reductions run in another order (sharded vs whole parameters)
OVERRIDES = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
             "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.use_kl_loss=True")


def test_lora_two_ranks_equal_one_rank(tiny_model_path, tmp_path):
    local = LocalGroup(HybridWorker, device_kind="cpu", args=(make_cfg(tiny_model_path, *OVERRIDES),))
    try:
        two = RayGroup(HybridWorker, world_size=2, device_kind="cpu", ray_num_cpus=2,
                       args=(make_cfg(tiny_model_path, *OVERRIDES, world_size=2),))
    except BaseException:
        local.close()
        raise
    try:
        local.call("init_model", 10)
        two.call("init_model", 10)
        batch = make_batch(seed=40)
        results = {}
        for name, group in (("one", local), ("two", two)):
            old = torch.cat([r[0] for r in group.chunk_and_call("compute_log_prob", batch)])
            ref = torch.cat(group.chunk_and_call("compute_ref_log_prob", batch))
            metrics = group.chunk_and_call("update_actor", batch.replace(old_logp=old, ref_logp=ref))[0]
            moved = torch.cat([r[0] for r in group.chunk_and_call("compute_log_prob", batch)])
            ref_after = torch.cat(group.chunk_and_call("compute_ref_log_prob", batch))
            group.call("save_checkpoint", str(tmp_path / name), 1)
            results[name] = (old, ref, metrics, moved, ref_after)
        (old1, ref1, m1, moved1, refa1), (old2, ref2, m2, moved2, refa2) = results["one"], results["two"]
        for a, b in ((old1, old2), (ref1, ref2), (moved1, moved2), (refa1, refa2)):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
        torch.testing.assert_close(refa1, ref1, atol=0, rtol=0)  # the reference (adapters off) did not move
        assert (moved1 - old1).abs().max() > 1e-4
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        adapters = [load_file(tmp_path / n / "actor" / lora.ADAPTER_DIR / lora.ADAPTER_FILE) for n in ("one", "two")]
        assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) > 0
        for key in adapters[0]:
            torch.testing.assert_close(adapters[1][key], adapters[0][key], atol=1e-7, rtol=0, msg=key)
    finally:
        two.close()
        local.close()
