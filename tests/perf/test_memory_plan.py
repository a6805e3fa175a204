"""The memory plan: components by phase, the table, over-capacity warnings, and the run's log and metrics."""

from __future__ import annotations

import logging

import pytest

from grpo_npu.config import load_config
from grpo_npu.device import get_device
from grpo_npu.perf.flops import ModelShape
from grpo_npu.perf.memory import GIB, MemoryInputs, memory_table, over_capacity, param_count, plan_memory, plan_metrics
from grpo_npu.step_limits import StepLimits

# a Qwen2.5-0.5B shape (tied embeddings)
QWEN05 = ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936,
                    head_width=151936, tied_embeddings=True)


def inputs(**kw):
    base = dict(shape=QWEN05, world_size=8, master_dtype="fp32", compute_dtype="bf16", rollout_dtype="bf16",
                micro_batch=4, log_prob_micro_batch=8, prompt_length=512, response_length=1024, rollout_rows=64,
                gradient_checkpointing=True, rollout="vllm", gpu_memory_utilization=0.6, capacity=64 * GIB,
                reshard_after_forward=True)
    return MemoryInputs(**{**base, **kw})


def test_components_follow_the_parallel_layout_and_settings():
    assert param_count(QWEN05) == pytest.approx(494e6, rel=0.01)  # Qwen2.5-0.5B: 494M parameters
    plan = plan_memory(inputs())
    upd = plan["update_actor"]
    p = param_count(QWEN05)
    assert upd["weights"] == p * 4 // 8 and upd["grads"] == p * 4 // 8 and upd["optimizer"] == 2 * p * 4 // 8
    assert plan["rollout"]["kv_cache"] == int(0.6 * 64 * GIB) - p * 2  # utilization share minus the engine weights
    no_ckpt = plan_memory(inputs(gradient_checkpointing=False))["update_actor"]["activations"]
    assert no_ckpt > 5 * upd["activations"]  # checkpointing keeps one layer's activations, not 24
    offload = plan_memory(inputs(optimizer_offload=True, param_offload=True))["old_log_prob"]
    assert offload["weights"] == 0 and offload["optimizer"] == 0
    one_rank = plan_memory(inputs(world_size=1))["update_actor"]
    assert one_rank["optimizer"] == 8 * upd["optimizer"] and one_rank["gathered"] == upd["gathered"]  # whole copies
    hf = plan_memory(inputs(rollout="hf"))["rollout"]
    assert hf["kv_cache"] == 64 * (512 + 1024) * QWEN05.kv_bytes_per_token("bf16")
    # activation offload: what autograd saves waits on the host, one layer's tensors remain on the device
    offloaded = plan_memory(inputs(activation_offload=True))["update_actor"]["activations"]
    assert offloaded < upd["activations"]  # the checkpointed layers' inputs are gone
    offloaded = plan_memory(inputs(activation_offload=True, gradient_checkpointing=False))["update_actor"]["activations"]
    assert offloaded == plan_memory(inputs(activation_offload=True))["update_actor"]["activations"] < no_ckpt / 5
    # Ulysses: 2 ranks share each micro-batch's tokens; the activations halve but for the log-prob op's fixed-size
    # blocks, the states do not change
    split = plan_memory(inputs(sequence_parallel=2))
    for phase in ("old_log_prob", "update_actor"):
        whole = plan_memory(inputs())[phase]
        assert 0.5 * whole["activations"] <= split[phase]["activations"] < 0.55 * whole["activations"]
        assert {k: v for k, v in split[phase].items() if k != "activations"} == {
            k: v for k, v in whole.items() if k != "activations"}


# one Qwen2.5-0.5B decoder layer's matmul weights (q, o; k, v; gate, up, down) and the root unit's (the tied embedding)
QWEN05_LAYER = 2 * 896 * 14 * 64 + 2 * 896 * 2 * 64 + 3 * 896 * 4864
QWEN05_ROOT = 151936 * 896


@pytest.mark.parametrize("world_size", [1, 8])
def test_gathered_copies_follow_reshard_after_forward(world_size):
    """FSDP's unsharded copies in the compute dtype (bf16): the root unit always (it never reshards after forward),
    plus two decoder layers in flight when resharding, or all 24 kept from forward to backward (update) or to the
    pass's reshard_all (old log-probs) when not. The transformers rollout holds all of them either way; vLLM's
    rollout starts after a reshard_all. Nothing else changes."""
    on = plan_memory(inputs(world_size=world_size, rollout="hf", reshard_after_forward=True))
    off = plan_memory(inputs(world_size=world_size, rollout="hf", reshard_after_forward=False))
    for phase in ("old_log_prob", "update_actor"):
        assert on[phase]["gathered"] == (2 * QWEN05_LAYER + QWEN05_ROOT) * 2
        assert off[phase]["gathered"] == (24 * QWEN05_LAYER + QWEN05_ROOT) * 2
        assert {**off[phase], "gathered": 0} == {**on[phase], "gathered": 0}
    assert on["rollout"] == off["rollout"] and on["rollout"]["gathered"] == (24 * QWEN05_LAYER + QWEN05_ROOT) * 2
    assert "gathered" not in plan_memory(inputs(world_size=world_size, reshard_after_forward=False))["rollout"]


def test_table_warnings_and_metrics():
    plan = plan_memory(inputs(world_size=1, gradient_checkpointing=False, micro_batch=16))
    table = memory_table(plan, 64 * GIB)
    assert table.splitlines()[1].split()[:2] == ["phase", "weights"] and len(table.splitlines()) == 5
    warnings = over_capacity(plan, 64 * GIB)
    assert len(warnings) == 1 and warnings[0].startswith("memory plan: update_actor needs") \
        and "largest part: activations" in warnings[0]
    assert over_capacity(plan_memory(inputs()), 64 * GIB) == []
    metrics = plan_metrics(plan)
    assert metrics["perf/mem_estimate_gb/peak"] == max(metrics[f"perf/mem_estimate_gb/{p}"] for p in plan)


def test_the_run_logs_the_table_and_reports_the_estimate(tiny_model_path, caplog, monkeypatch):
    keys = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=1",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.name=hf",
            f"actor_rollout_ref.model.path={tiny_model_path}"]
    cfg = load_config(keys)
    dev = get_device("cpu")
    with caplog.at_level(logging.INFO, logger="grpo_npu.step_limits"):
        limits = StepLimits(cfg, dev, world_size=1, use_critic=False)
    assert any("memory plan per rank" in r.getMessage() for r in caplog.records)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    metrics = limits.report({"step": 1.0, "update_actor": 0.5}, {}, [5, 5], [3, 4], n=2)
    assert 0 < metrics["perf/mem_estimate_gb/update_actor"] < 1  # the tiny model: megabytes
    # one CPU rank, fp32, defaults: no FSDP, nothing gathered; wrapped, resharding keeps two layers and the root
    # gathered, and not resharding every layer and the root
    def estimate(setting: str) -> dict:
        cfg = load_config([*keys, f"actor_rollout_ref.actor.fsdp_config.reshard_after_forward={setting}"])
        return StepLimits(cfg, dev, world_size=1, use_critic=False).report({"step": 1.0}, {}, [5, 5], [3, 4], n=2)

    resharded, kept = estimate("true"), estimate("false")
    shape = limits.actor
    root = (shape.params - shape.layers * shape.layer_weights) * 4
    for phase in ("old_log_prob", "update_actor"):
        grown = kept[f"perf/mem_estimate_gb/{phase}"] - resharded[f"perf/mem_estimate_gb/{phase}"]
        assert grown * GIB == pytest.approx((shape.layers - 2) * shape.layer_weights * 4)
        unwrapped = resharded[f"perf/mem_estimate_gb/{phase}"] - metrics[f"perf/mem_estimate_gb/{phase}"]
        assert unwrapped * GIB == pytest.approx(2 * shape.layer_weights * 4 + root)
    monkeypatch.setattr(type(dev), "total_memory", lambda self, index=None: 1024)  # a 1 KiB device
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_npu.step_limits"):
        StepLimits(cfg, dev, world_size=1, use_critic=False)
    assert sum("memory plan:" in r.getMessage() for r in caplog.records) == 3  # every phase is over
