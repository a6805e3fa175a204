"""The trainer's view of :mod:`grpo_npu.perf`: each step's phases against their physical limits, and the verdict.

Built once per run from the configuration (the actor's and critic's model shapes from their config.json, the
compute and engine dtypes, the device's peak FLOP/s and bandwidth); :meth:`StepLimits.report` turns one step's
timer and rows into ``perf/mfu/*``, ``perf/floor_s/*``, ``perf/limit_frac/*`` and ``perf/share/*`` metrics, and
:meth:`StepLimits.verdict` names the phase furthest from its limit at the end of the run. A model type the FLOP
model does not cover (see ``perf.flops.SUPPORTED_MODEL_TYPES``) turns the report off with one log line.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

from transformers import AutoConfig

from grpo_npu.device import Device
from grpo_npu.perf.flops import ModelShape
from grpo_npu.perf.hardware import device_spec
from grpo_npu.perf.report import StepReport, StepWorkload, step_report, verdict
from grpo_npu.workers.response_model import compute_dtype_of

log = logging.getLogger(__name__)

# Timer sections that run inside the step and do not overlap (testing and checkpointing run after it).
STEP_PHASES = ("step", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
SYNC_METRIC = "rollout/weight_sync_s"  # the part of "gen" spent loading the actor's weights into the engine


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
        self.rollout_dtype = arr.rollout.dtype if dev.is_accelerator else "fp32"
        self.spec = device_spec(dev.kind, dev.device_name(), dtypes=(self.dtype, self.rollout_dtype))
        if self.spec is None:
            log.info("perf: %s is not in the device table: phase shares only, no floors or MFU", dev.device_name())
        self.cfg = cfg
        self.world_size = world_size
        self.reports: list[StepReport] = []

    def report(self, seconds: Mapping[str, float], metrics: Mapping[str, float], prompt_lengths: Sequence[int],
               response_lengths: Sequence[int], n: int) -> dict[str, float]:
        """This step's limit metrics; rows (prompt and response lengths) in generation order."""
        if not self.enabled:
            return {}
        arr, critic = self.cfg.actor_rollout_ref, self.cfg.critic
        phases = {k: float(v) for k, v in seconds.items() if k in STEP_PHASES}
        sync = min(float(metrics.get(SYNC_METRIC, 0.0)), phases.get("gen", 0.0))
        if "gen" in phases and arr.rollout.name == "vllm":  # the transformers rollout runs the actor itself: no copy
            phases["gen"] -= sync
            phases["sync"] = sync
        workload = StepWorkload(
            actor=self.actor, prompt_lengths=prompt_lengths, response_lengths=response_lengths, n=n,
            world_size=self.world_size, dtype=self.dtype, rollout_dtype=self.rollout_dtype,
            gradient_checkpointing=arr.model.enable_gradient_checkpointing, ppo_epochs=arr.actor.ppo_epochs,
            critic=self.critic, critic_gradient_checkpointing=critic.model.enable_gradient_checkpointing,
            critic_ppo_epochs=critic.ppo_epochs or arr.actor.ppo_epochs)
        result = step_report(phases, workload, self.spec)
        self.reports.append(result)
        return result.metrics()

    def verdict(self) -> str:
        """One line: the phase furthest from its limit over the run (see ``perf.report.verdict``)."""
        return verdict(self.reports) if self.enabled else "perf: no phase limits for this model"
