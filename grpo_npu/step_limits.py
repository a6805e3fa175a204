"""The trainer's view of :mod:`grpo_npu.perf`: each step's phases against their physical limits, and the verdict.

Built once per run from the configuration (the actor's and critic's model shapes from their config.json, the
compute and engine dtypes, the device's peak FLOP/s and bandwidth); :meth:`StepLimits.report` turns one step's
timer and rows into ``perf/mfu/*``, ``perf/floor_s/*``, ``perf/limit_frac/*`` and ``perf/share/*`` metrics, and
:meth:`StepLimits.verdict` names the phase furthest from its limit at the end of the run.

On a CPU the bandwidth is measured, and a shared host's moves within seconds (26-65 GB/s on this project's, in
bursts of about 5 s; docs/performance.md): it is measured when the report is built (after the engine), and
:meth:`StepLimits.probe` measures it again at the start of a step, as a phase of its own, whenever the probes so
far and one more stay within :data:`BANDWIDTH_PROBE_SHARE` of the run's step time. Each step's floors use the
latest probe (``perf/bandwidth_gbps``). A model type the FLOP
model does not cover (see ``perf.flops.SUPPORTED_MODEL_TYPES``) turns the report off with one log line.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

from transformers import AutoConfig

from grpo_npu.config import Derived, derive
from grpo_npu.device import Device
from grpo_npu.perf.advice import Passes, passes_advice
from grpo_npu.perf.flops import ModelShape, dtype_name
from grpo_npu.perf.hardware import cpu_bandwidth_probe, cpu_device_spec, cpu_probe_seconds, device_spec
from grpo_npu.perf.memory import GIB, MemoryInputs, memory_table, over_capacity, plan_memory, plan_metrics
from grpo_npu.perf.report import StepReport, StepWorkload, ranked_phases, step_report, verdict
from grpo_npu.rollout.layout import rollout_tp
from grpo_npu.rollout.vllm_cpu_steps import DECODE_S, PREFILL_S, PREFILL_STEPS
from grpo_npu.rollout.vllm_settings import CPU_KV_CACHE_BYTES
from grpo_npu.run_control import Timer
from grpo_npu.workers.micro_batch import token_budget_groups
from grpo_npu.workers.response_model import (actor_fsdp_wrap_on, actor_reshard_after_forward, compute_dtype_of,
                                             engine_dtype_of)

log = logging.getLogger(__name__)

BANDWIDTH_PROBE = "bandwidth_probe"  # the timer section of a CPU bandwidth re-measurement (StepLimits.probe)
BANDWIDTH_PROBE_SHARE = 0.01  # the share of the run's step time the re-measurements may take
# Timer sections that run inside the step and do not overlap (testing and checkpointing run after it).
STEP_PHASES = ("step", BANDWIDTH_PROBE, "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
               "update_actor")
BANDWIDTH_METRIC = "perf/bandwidth_gbps"  # the memory bandwidth this step's floors use, GB/s
SYNC_METRIC = "rollout/weight_sync_s"  # the part of "gen" spent loading the actor's weights into the engine
# The part of "gen" the weight-sync canary took on the steps it ran (rollout.sync_check: by default the first two):
# a phase of its own, so that those steps' generation is held to its floor without it.
SYNC_CHECK_METRIC = "rollout/sync_check_s"
PEAK_METRIC = "perf/max_memory_allocated_gb"  # the step's peak device memory (averaged over ranks), GiB
BASIS_PREFIX = "perf: floors against "  # the start-of-run line naming the peaks and bandwidth the floors use


class StepLimits:
    """Per-step limit metrics for one run (``None``-safe: off when the model or device is not modelled)."""

    def __init__(self, cfg, dev: Device, *, world_size: int, use_critic: bool) -> None:
        arr = cfg.actor_rollout_ref
        self.enabled = True
        try:
            self.actor = ModelShape.from_hf_config(AutoConfig.from_pretrained(
                arr.model.path, trust_remote_code=arr.model.trust_remote_code))
            self.critic = ModelShape.from_hf_config(AutoConfig.from_pretrained(
                cfg.critic.model.path or arr.model.path, trust_remote_code=arr.model.trust_remote_code),
                value_head=True) if use_critic else None
        except ValueError as exc:  # a model type the FLOP model does not know
            log.info("perf: no phase limits for this model (%s)", str(exc).splitlines()[0])
            self.enabled = False
            return
        self.dtype = compute_dtype_of(arr.model, arr.actor.fsdp_config, dev)
        self.rollout_dtype = engine_dtype_of(arr, dev)
        self.measured = dev.kind == "cpu"  # the spec's bandwidth is a measurement, worth renewing (probe)
        self.device_kind, self.accelerator = dev.kind, dev.is_accelerator
        self.capacity = dev.total_memory()  # bytes of one device (CPU: the machine's RAM)
        self.peak_gb: float | None = None
        self.lengths: list[int] = []  # the last step's rows' tokens (prompt + response), generation order
        self.steps_s = self.probes_s = self.last_probe_s = 0.0
        if self.measured:  # the bandwidth measured now, after the engine's build; what a probe costs from then
            bandwidth = cpu_bandwidth_probe()  # on (the first one pays for paging its buffers in), which step 1 may
            self.last_probe_s = cpu_probe_seconds(bandwidth)  # not yet afford
            self.spec = cpu_device_spec((self.dtype, self.rollout_dtype), bandwidth=bandwidth)
        else:
            self.spec = device_spec(dev.kind, dev.device_name(), dtypes=(self.dtype, self.rollout_dtype))
        if self.spec is None:
            log.info("perf: %s is not in the device table: phase shares only, no floors or MFU", dev.device_name())
        else:
            log.info("%s%s", BASIS_PREFIX, self.spec.summary())
        self.cfg = cfg
        self.world_size = world_size
        self.derived = derive(cfg, world_size)
        self.reports: list[StepReport] = []
        self.memory = memory_plan_metrics(cfg, self.derived, dev, self.actor, self.dtype, self.rollout_dtype,
                                          self.capacity)

    def probe(self, timer: Timer) -> None:
        """Measure a CPU's bandwidth again, timed as this step's ``bandwidth_probe`` phase, when the probes so far
        plus one as long as the last stay within ``BANDWIDTH_PROBE_SHARE`` of the steps reported so far."""
        if not (self.enabled and self.measured):
            return
        if self.probes_s + self.last_probe_s > BANDWIDTH_PROBE_SHARE * self.steps_s:
            return
        with timer(BANDWIDTH_PROBE):
            bandwidth = cpu_bandwidth_probe()
        self.last_probe_s = timer.seconds[BANDWIDTH_PROBE]
        self.probes_s += self.last_probe_s
        self.spec = dataclasses.replace(self.spec, bandwidth=bandwidth)

    def report(self, seconds: Mapping[str, float], metrics: Mapping[str, float], prompt_lengths: Sequence[int],
               response_lengths: Sequence[int], n: int) -> dict[str, float]:
        """This step's limit metrics; rows (prompt and response lengths) in generation order."""
        if not self.enabled:
            return {}
        arr, critic = self.cfg.actor_rollout_ref, self.cfg.critic
        epochs, critic_epochs = arr.actor.ppo_epochs, self.derived.critic_ppo_epochs
        phases = {k: float(v) for k, v in seconds.items() if k in STEP_PHASES}
        sync = min(float(metrics.get(SYNC_METRIC, 0.0)), phases.get("gen", 0.0))
        if "gen" in phases and arr.rollout.name == "vllm":  # the transformers rollout runs the actor itself: no copy
            phases["gen"] -= sync
            phases["sync"] = sync
        check = min(float(metrics.get(SYNC_CHECK_METRIC, 0.0)), phases.get("gen", 0.0))
        if check > 0:
            phases["gen"] -= check
            phases["sync_check"] = check
        workload = StepWorkload(
            actor=self.actor, prompt_lengths=prompt_lengths, response_lengths=response_lengths, n=n,
            world_size=self.world_size, rollout_tp=rollout_tp(arr.rollout), dtype=self.dtype,
            rollout_dtype=self.rollout_dtype,
            gradient_checkpointing=arr.model.enable_gradient_checkpointing, ppo_epochs=epochs,
            critic=self.critic, critic_gradient_checkpointing=critic.model.enable_gradient_checkpointing,
            critic_ppo_epochs=critic_epochs,
            optimizer_steps=epochs * self.mini_batches(len(prompt_lengths), critic=False),
            critic_optimizer_steps=critic_epochs * self.mini_batches(len(prompt_lengths), critic=True))
        # The engine's prefill and decode steps, where it timed them and prefilled every prompt in one step (several
        # prefill steps would carry decode work with them: neither time is then the work its floor counts)
        one_prefill = metrics.get(PREFILL_STEPS) == 1
        result = step_report(phases, workload, self.spec, decode_s=metrics.get(DECODE_S) if one_prefill else None,
                             prefill_s=metrics.get(PREFILL_S) if one_prefill else None)
        self.reports.append(result)
        self.lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
        if PEAK_METRIC in metrics:
            self.peak_gb = max(self.peak_gb or 0.0, float(metrics[PEAK_METRIC]))
        self.steps_s += phases["step"]
        bandwidth = {BANDWIDTH_METRIC: self.spec.bandwidth / 1e9} if self.spec is not None else {}
        return {**result.metrics(), **bandwidth, **self.memory}

    def mini_batches(self, rows: int, *, critic: bool) -> int:
        """Optimizer steps per epoch of the actor's (critic's) update over ``rows`` responses on the device the
        floors describe: each rank's share in mini-batches of the derived per-rank size, as the update loop splits
        them; 0 when the optimizer is offloaded to the host of an accelerator (its step is then host work, outside
        the device's floor)."""
        fsdp = self.cfg.critic.model.fsdp_config if critic else self.cfg.actor_rollout_ref.actor.fsdp_config
        if fsdp.optimizer_offload and self.device_kind != "cpu":
            return 0
        d = self.derived
        size = d.critic_mini_batch_responses_per_rank if critic else d.mini_batch_responses_per_rank
        groups = self.world_size // (d.critic_sp if critic else d.sp)  # each data-parallel group's rows
        return -(-(rows // groups) // size)

    def verdict(self) -> str:
        """One line: the phase furthest from its limit over the run (see ``perf.report.verdict``)."""
        return verdict(self.reports) if self.enabled else "perf: no phase limits for this model"

    def advice(self) -> str:
        """One line of what to try for the verdict's phase, or '' (see :mod:`grpo_npu.perf.advice`)."""
        if not (self.enabled and self.reports):
            return ""
        return passes_advice(ranked_phases(self.reports), phase_passes(self.cfg, self.derived, self.lengths),
                             accelerator=self.accelerator, peak_gb=self.peak_gb, capacity_gb=self.capacity / GIB)


def phase_passes(cfg, d: Derived, lengths: Sequence[int]) -> dict[str, Passes]:
    """How each model-pass phase splits a rank's rows into passes (as the workers plan them: fixed row counts, or
    token budgets over the first rank's share of ``lengths``), with the key that sets a pass's size."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    def rank_rows(sp: int) -> int:  # a rank's rows: those of its data-parallel group (Ulysses ranks share them)
        return d.train_batch_responses // (d.world_size // sp)

    # phase: (rows per batch, fixed rows per pass and its key, dynamic?, token budget and its key, the switch to it)
    phases = {
        "update_actor": (d.mini_batch_responses_per_rank, d.micro_batch_per_rank,
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", arr.actor.use_dynamic_bsz,
                         d.max_token_len, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                         "actor_rollout_ref.actor.use_dynamic_bsz=True"),
        "old_log_prob": (rank_rows(d.sp), d.log_prob_micro_batch_per_rank,
                         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", d.log_prob_use_dynamic_bsz,
                         d.log_prob_max_token_len, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                         "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True"),
        "ref": (rank_rows(d.ref_sp), d.ref_log_prob_micro_batch_per_rank,
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", d.ref_log_prob_use_dynamic_bsz,
                d.ref_log_prob_max_token_len, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True"),
        "update_critic": (d.critic_mini_batch_responses_per_rank, d.critic_micro_batch_per_rank,
                          "critic.ppo_micro_batch_size_per_gpu", d.critic_use_dynamic_bsz,
                          d.critic_max_token_len, "critic.ppo_max_token_len_per_gpu",
                          "critic.use_dynamic_bsz=True"),
        "values": (rank_rows(d.critic_sp), d.values_micro_batch_per_rank, "critic.forward_micro_batch_size_per_gpu",
                   d.critic_use_dynamic_bsz, d.values_max_token_len, "critic.forward_max_token_len_per_gpu",
                   "critic.use_dynamic_bsz=True"),
    }
    out = {}
    for phase, (rows, micro, micro_key, dynamic, budget, budget_key, switch) in phases.items():
        if dynamic:
            batch = lengths[:rows]
            if not batch or max(batch) > budget:  # no step seen, or a row over the budget (the worker refuses it)
                continue
            out[phase] = Passes(rows, len(token_budget_groups(batch, budget)), budget_key, budget, packed=True)
        elif micro:
            out[phase] = Passes(rows, -(-rows // micro), micro_key, micro, alternative=switch)
    return out


def log_prob_rows(d: Derived, length: int) -> int:
    """Rows in one micro-batch of the larger log-prob pass (old policy or reference): its fixed size, or, packed to a
    token budget, the rows of ``length`` tokens a full budget holds, at most a rank's batch."""
    rows = d.train_batch_responses // (d.world_size // d.sp)

    def one(dynamic: bool, budget: int, fixed: int | None) -> int:
        return min(rows, max(1, budget // length)) if dynamic or fixed is None else fixed

    return max(one(d.log_prob_use_dynamic_bsz, d.log_prob_max_token_len, d.log_prob_micro_batch_per_rank),
               one(d.ref_log_prob_use_dynamic_bsz, d.ref_log_prob_max_token_len, d.ref_log_prob_micro_batch_per_rank))


def memory_plan_metrics(cfg, d: Derived, dev: Device, shape: ModelShape, dtype, rollout_dtype,
                        capacity: int) -> dict[str, float]:
    """Log the memory plan of this run as one table, warn for each phase that will not fit the device, and
    return its ``perf/mem_estimate_gb/*`` metrics (logged every step beside the measured peaks)."""
    arr, world_size = cfg.actor_rollout_ref, d.world_size
    actor, rollout = arr.actor, arr.rollout
    length = d.prompt_length + d.response_length
    tokens_micro = max(1, d.max_token_len // length)  # dynamic batch size: rows of a full budget
    kv = None
    if rollout.name == "vllm" and not dev.is_accelerator:
        kv = int((rollout.engine_kwargs.get("vllm", {}) or {}).get("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES))
    plan = plan_memory(MemoryInputs(
        shape=shape, world_size=world_size, master_dtype="fp32", compute_dtype=dtype_name(dtype),
        rollout_dtype=dtype_name(rollout_dtype), micro_batch=d.micro_batch_per_rank or tokens_micro,
        log_prob_micro_batch=log_prob_rows(d, length), prompt_length=d.prompt_length,
        response_length=d.response_length, rollout_rows=d.train_batch_responses // world_size,
        gradient_checkpointing=arr.model.enable_gradient_checkpointing, rollout=rollout.name,
        gpu_memory_utilization=rollout.gpu_memory_utilization, capacity=capacity,
        reshard_after_forward=actor_reshard_after_forward(arr, dev, world_size),
        fsdp_wrapped=actor_fsdp_wrap_on(arr, dev, world_size),
        optimizer_offload=actor.fsdp_config.optimizer_offload, param_offload=actor.fsdp_config.param_offload,
        kv_cache_bytes=kv, sequence_parallel=d.sp,
        activation_offload=arr.model.enable_activation_offload and dev.is_accelerator,
        mlp_tiles=arr.model.tiled_mlp.num_shards if arr.model.tiled_mlp.enabled else 1))
    log.info("%s", memory_table(plan, capacity))
    for message in over_capacity(plan, capacity):
        log.warning("%s", message)
    return plan_metrics(plan)
