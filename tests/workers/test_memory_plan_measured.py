"""The memory plan's update-phase estimate against the profiler's peak of tensor memory on CPU (within 30%).

Measured: one actor update on the tiny Qwen2 (one FSDP2 rank) under ``torch.profiler`` with memory profiling;
the peak is the tensors alive at the start (parameters and AdamW state, counted directly) plus the highest
running sum of the profiler's allocation and free events during the update. Not RSS: that includes the
allocator's retained memory and everything else in the process.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from grpo_npu.perf.flops import ModelShape
from grpo_npu.perf.memory import MemoryInputs, plan_memory

from .helpers import PROMPT_LEN, make_batch, make_cfg, make_worker

pytestmark = pytest.mark.usefixtures("process_group")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measured_update_peak(worker, batch) -> int:
    worker.update_actor(batch)  # AdamW's state exists from here on, as on every step but the first
    params = _bytes(getattr(p, "to_local", lambda p=p: p)() for p in worker.actor.module.parameters())
    state = _bytes(v for st in worker.actor.loop.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        worker.update_actor(batch)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return params + state + peak


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("rows, response_len", [(8, 9), (32, 64), (16, 40)])  # (16, 40): not used to fit the constants
def test_update_estimate_within_30_percent_of_the_profiler_peak(tiny_model_path, checkpointing, rows, response_len):
    cfg = make_cfg(tiny_model_path, f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}",
                   f"data.max_response_length={response_len}", "data.train_batch_size=16",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                   f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}")
    batch = make_batch(rows=32, response_len=response_len, empty_row=None)
    batch = batch.replace(old_logp=torch.zeros(batch.response_ids.shape))
    measured = measured_update_peak(make_worker(cfg), batch)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_model_path))
    plan = plan_memory(MemoryInputs(
        shape=shape, world_size=1, master_dtype="fp32", compute_dtype="fp32", rollout_dtype="fp32", micro_batch=rows,
        log_prob_micro_batch=rows, prompt_length=PROMPT_LEN, response_length=response_len, rollout_rows=32,
        gradient_checkpointing=checkpointing, rollout="hf", gpu_memory_utilization=0.5, capacity=64 * 1024**3))
    estimate = sum(plan["update_actor"].values())
    assert abs(estimate - measured) <= 0.3 * measured, (estimate, measured, plan["update_actor"])
