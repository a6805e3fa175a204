"""The memory plan's update and old-log-prob estimates against the profiler's peak of tensor memory on CPU (within 30%).

Measured: one actor update (or old-log-prob pass) on a tiny Qwen2 (one FSDP2 rank) under ``torch.profiler`` with
memory profiling; the peak is the tensors alive at the start (parameters and AdamW state, counted directly) plus the
highest running sum of the profiler's allocation and free events during the phase. Not RSS: that includes the
allocator's retained memory and everything else in the process.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig

from grpo_npu.device import get_device
from grpo_npu.models.tiny import TinySpec, build_tiny_model
from grpo_npu.perf.flops import ModelShape
from grpo_npu.perf.memory import MemoryInputs, plan_memory
from grpo_npu.workers.fsdp import FSDPModule
from grpo_npu.workers.response_model import actor_fsdp_wrap_on, actor_reshard_after_forward

from .helpers import PROMPT_LEN, make_batch, make_cfg, make_worker

pytestmark = pytest.mark.usefixtures("process_group")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def resident_bytes(worker) -> int:
    """The actor's parameters (this rank's shards) and AdamW state."""
    params = _bytes(getattr(p, "to_local", lambda p=p: p)() for p in worker.actor.module.parameters())
    state = _bytes(v for st in worker.actor.loop.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    return params + state


def profiled_peak(run) -> int:
    """The highest running sum of the profiler's allocation and free events while ``run()`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak


def measured_update_peak(worker, batch) -> int:
    worker.update_actor(batch)  # AdamW's state exists from here on, as on every step but the first
    return resident_bytes(worker) + profiled_peak(lambda: worker.update_actor(batch))


def tiny_inputs(path: str, rows: int, response_len: int, checkpointing: bool, *, reshard_after_forward: bool,
                fsdp_wrapped: bool = True) -> MemoryInputs:
    """The plan's inputs for these tests' shapes: one rank, fp32, ``rows`` per micro-batch."""
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    return MemoryInputs(
        shape=shape, world_size=1, master_dtype="fp32", compute_dtype="fp32", rollout_dtype="fp32", micro_batch=rows,
        log_prob_micro_batch=rows, prompt_length=PROMPT_LEN, response_length=response_len, rollout_rows=32,
        gradient_checkpointing=checkpointing, rollout="hf", gpu_memory_utilization=0.5, capacity=64 * 1024**3,
        reshard_after_forward=reshard_after_forward, fsdp_wrapped=fsdp_wrapped)


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
    resharding = actor_reshard_after_forward(cfg.actor_rollout_ref, get_device("cpu"), world_size=1)  # auto: off
    wrapped = actor_fsdp_wrap_on(cfg.actor_rollout_ref, get_device("cpu"), world_size=1)  # auto on one CPU rank: no
    assert not wrapped and not any(isinstance(m, FSDPModule) for m in make_worker(cfg).actor.module.modules())
    plan = plan_memory(tiny_inputs(tiny_model_path, rows, response_len, checkpointing, reshard_after_forward=resharding,
                                   fsdp_wrapped=wrapped))
    estimate = sum(plan["update_actor"].values())
    assert abs(estimate - measured) <= 0.3 * measured, (estimate, measured, plan["update_actor"])


# -- reshard_after_forward: the gathered copies FSDP keeps -------------------------------------------------------
# A deeper tiny Qwen2 (12 layers): its weights are a visible share of a small batch's peak, and the decoder layers'
# gathered copies (all of them with resharding off, two in flight with it on) differ by far more than the
# profiler's noise. Few rows and short responses keep the activations small beside them. Measured (torch 2.13,
# CPU): off - on = 7.54 / 7.76 MiB for the update with / without checkpointing, 8.27 MiB for the old log-probs, against
# the plan's 10 layers x 0.75 MiB = 7.50 MiB; a plan that counts no gathered layer on one rank gives 0.
DEEP = TinySpec(name="tiny-qwen2-12-layers", num_hidden_layers=12)
RESHARD_ROWS, RESHARD_RESPONSE = 2, 4


@pytest.fixture(scope="module")
def deep_tiny_path(tiny_cache):
    return str(build_tiny_model(tiny_cache, DEEP))


def measured_log_prob_peak(worker, batch) -> int:
    """The old-log-prob pass's peak: resident parameters and AdamW state plus the pass's highest running sum."""
    worker.update_actor(batch)  # AdamW's state exists, as before every step's old-log-prob pass but the first
    return resident_bytes(worker) + profiled_peak(lambda: worker.compute_log_prob(batch))


def measure_both_settings(path, measure, checkpointing: bool) -> dict[bool, tuple[int, dict[str, dict[str, int]]]]:
    """{reshard_after_forward: (measured peak, memory plan)} for one update/log-prob shape on one rank."""
    out = {}
    for reshard in (True, False):
        cfg = make_cfg(path, f"actor_rollout_ref.actor.fsdp_config.reshard_after_forward={str(reshard).lower()}",
                       f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}",
                       f"data.max_response_length={RESHARD_RESPONSE}", "data.train_batch_size=16",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                       f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={RESHARD_ROWS}",
                       f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={RESHARD_ROWS}")
        batch = make_batch(rows=32, response_len=RESHARD_RESPONSE, empty_row=None)
        batch = batch.replace(old_logp=torch.zeros(batch.response_ids.shape))
        measured = measure(make_worker(cfg), batch)
        out[reshard] = measured, plan_memory(tiny_inputs(path, RESHARD_ROWS, RESHARD_RESPONSE, checkpointing,
                                                         reshard_after_forward=reshard))
    return out


@pytest.mark.parametrize("phase, measure, checkpointing", [
    ("update_actor", measured_update_peak, True), ("update_actor", measured_update_peak, False),
    ("old_log_prob", measured_log_prob_peak, False)])
def test_kept_gathered_layers_are_counted_as_measured(deep_tiny_path, phase, measure, checkpointing):
    """Resharding off keeps every decoder layer's gathered copy from forward until backward (update) or the pass's
    reshard_all (old log-probs): the estimate's growth from on to off matches the measured growth within 30%, and
    each estimate stays within 30% of its measurement."""
    runs = measure_both_settings(deep_tiny_path, measure, checkpointing)
    (on, plan_on), (off, plan_off) = runs[True], runs[False]
    est_on, est_off = sum(plan_on[phase].values()), sum(plan_off[phase].values())
    assert off - on > 0.15 * on  # the shape discriminates: the kept layers are a visible share of the peak
    assert abs((est_off - est_on) - (off - on)) <= 0.3 * (off - on), (est_off - est_on, off - on)
    for est, measured, plan in ((est_on, on, plan_on), (est_off, off, plan_off)):
        assert abs(est - measured) <= 0.3 * measured, (est, measured, plan[phase])


# -- model.tiled_mlp: the MLP's intermediates one tile at a time -------------------------------------------------
# Measured (torch 2.13, CPU, tiny Qwen2, 16 rows x 71 positions, 4 tiles): 33.9 -> 27.3 MiB with checkpointing,
# 69.7 -> 43.2 MiB without; the plan says 33.2 -> 29.5 and 68.3 -> 49.6.
@pytest.mark.parametrize("checkpointing", [True, False])
def test_tiled_mlp_lowers_the_update_peak_as_planned(tiny_model_path, checkpointing):
    rows, response_len, tiles = 16, 64, 4
    peaks, estimates = {}, {}
    for n in (1, tiles):
        cfg = make_cfg(tiny_model_path, f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}",
                       f"data.max_response_length={response_len}", "data.train_batch_size=16",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                       f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
                       *(["actor_rollout_ref.model.tiled_mlp.enabled=True", f"actor_rollout_ref.model.tiled_mlp.num_shards={n}"]
                         if n > 1 else []))
        batch = make_batch(rows=32, response_len=response_len, empty_row=None)
        peaks[n] = measured_update_peak(make_worker(cfg), batch.replace(old_logp=torch.zeros(batch.response_ids.shape)))
        inputs = tiny_inputs(tiny_model_path, rows, response_len, checkpointing, reshard_after_forward=False,
                             fsdp_wrapped=False)
        estimates[n] = sum(plan_memory(dataclasses.replace(inputs, mlp_tiles=n))["update_actor"].values())
    saved, planned = peaks[1] - peaks[tiles], estimates[1] - estimates[tiles]
    assert saved > 0.15 * peaks[1]  # a visible share of the peak
    assert saved >= 0.5 * planned, (saved, planned)
    assert abs(estimates[tiles] - peaks[tiles]) <= 0.3 * peaks[tiles], (estimates[tiles], peaks[tiles])
