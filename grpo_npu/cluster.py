"""The trainer's typed handle on its workers: split the batch over ranks, call, gather.

``Workers`` wraps a :class:`~grpo_npu.workers.WorkerGroup` of :class:`~grpo_npu.workers.hybrid.HybridWorker`
(in-process for one device with no Ray cluster given, Ray actors otherwise) and exposes the calls a
training step makes, each returning driver-side tensors in the batch's row order.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Iterator

import torch

from grpo_npu import compat
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import Config, derive
from grpo_npu.device import get_device
from grpo_npu.rank_groups import RankGroups
from grpo_npu.rollout.base import GenerationOutput, SamplingConfig
from grpo_npu.rollout.layout import RolloutLayout, rollout_tp
from grpo_npu.rollout.vllm_settings import default_sleep_level
from grpo_npu.workers import LocalGroup, RayGroup, WorkerGroup
from grpo_npu.workers.hybrid import HybridWorker

log = logging.getLogger(__name__)


def make_group(cfg: Config, worker_cls: type, args: tuple) -> WorkerGroup:
    """LocalGroup for a single device without RAY_ADDRESS, else one Ray actor per device (n_gpus_per_node per node)."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    timeout = cfg.actor_rollout_ref.nccl_timeout
    # one rank in-process without Ray, unless a Ray timeline is asked for (ray_init.timeline_json_file)
    if world == 1 and not os.environ.get("RAY_ADDRESS") and not cfg.ray_init.timeline_json_file:
        return LocalGroup(worker_cls, device_kind=cfg.trainer.device, args=args, pg_timeout_s=timeout)
    return RayGroup(worker_cls, world_size=world, nnodes=cfg.trainer.nnodes, device_kind=cfg.trainer.device, args=args,
                    pg_timeout_s=timeout, ray_num_cpus=cfg.ray_init.num_cpus, ray_runtime_env=dict(cfg.ray_init.runtime_env),
                    timeline_json_file=cfg.ray_init.timeline_json_file, start_timeout_s=cfg.trainer.ray_wait_register_center_timeout)


def check_stack(cfg: Config, *, with_rollout: bool) -> None:
    """Refuse an installation older than the oldest supported stack; log, once, what this one cannot do."""
    rollout = cfg.actor_rollout_ref.rollout
    vllm = with_rollout and rollout.name == "vllm"
    stack = compat.current()
    stack.require_supported(vllm=vllm)
    kind = get_device(cfg.trainer.device).kind
    sleep_mode = vllm and rollout.enable_sleep_mode and rollout.free_cache_engine
    engine = rollout.name if with_rollout else None
    for line in stack.off(kind, rollout=engine, sleep_mode=sleep_mode,
                          sleep_level=default_sleep_level(kind, rollout.sleep_level)):
        log.info("stack: %s", line)


class Workers:
    """Typed calls over a worker group; every call is collective across ranks."""

    def __init__(self, group: WorkerGroup, rollout_tp: int = 1, sequence_parallel: dict[str, int] | None = None,
                 profiled_steps: Iterable[int] = ()) -> None:
        """``rollout_tp``: ranks per rollout engine (vLLM tensor parallelism; 1 for data-parallel rollout).
        ``sequence_parallel``: Ulysses ranks per group of each model role ('actor', 'ref', 'critic'; 1 if absent),
        whose ranks all get the same rows. ``profiled_steps``: the steps global_profiler traces."""
        self.group = group
        self.profiled_steps = frozenset(profiled_steps)
        self.world_size = group.world_size
        self.layout = RolloutLayout(group.world_size, rollout_tp)
        sizes = sequence_parallel or {}
        self.row_groups = {role: RankGroups(group.world_size, sizes.get(role, 1)) for role in ("actor", "ref", "critic")}

    @classmethod
    def build(cls, cfg: Config, *, total_training_steps: int, worker_cls: type = HybridWorker,
              with_rollout: bool = True) -> "Workers":
        rollout = cfg.actor_rollout_ref.rollout
        tp = rollout_tp(rollout) if with_rollout else 1
        layout = RolloutLayout(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node, tp)  # refuses a tp before any start
        d = derive(cfg)
        check_stack(cfg, with_rollout=with_rollout)
        group = make_group(cfg, worker_cls, (cfg, with_rollout))
        try:
            built = group.call("init_model", total_training_steps)[0]
        except BaseException:
            group.close()
            raise
        log.info("workers: %d rank(s), roles %s", group.world_size, {k: v for k, v in built.items() if v})
        profiler = cfg.global_profiler
        return cls(group, layout.tp, {"actor": d.sp, "ref": d.ref_sp, "critic": d.critic_sp},
                   profiled_steps=(profiler.steps or ()) if profiler.tool is not None else ())

    # -- rollout --------------------------------------------------------------------------------
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig, step: int = 0,
                 baseline: SamplingConfig | None = None) -> list[GenerationOutput]:
        """Rollout group g generates for the g-th equal chunk of prompts; one output per group, in group order.

        Every rank of a group gets the same prompts and seed (see :mod:`grpo_npu.rollout.layout`). ``step``: the
        training step the synced weights serve (the weight-sync canary's schedule). ``baseline``: also one
        response per prompt with that sampling, in each output's ``baseline`` (ReMax).
        """
        per_rank = self.layout.per_rank_inputs(prompt_ids, prompt_mask, sampling)
        return self.layout.one_per_group(self.group.call_ranks("generate", per_rank, step=step, baseline=baseline))

    @contextlib.contextmanager
    def profiling(self, step: int) -> Iterator[None]:
        """Each rank's traces of ``step`` open for the block, when global_profiler lists it (else no call at all)."""
        if step not in self.profiled_steps:
            yield
            return
        self.group.call("profile_begin", step)
        try:
            yield
        finally:
            self.group.call("profile_end")

    # -- scoring --------------------------------------------------------------------------------
    def rows_call(self, method: str, batch: RolloutBatch, role: str) -> list:
        """Data-parallel group g of ``role`` gets the g-th equal chunk of ``batch`` on each of its ranks; one answer
        per group, in row order."""
        groups = self.row_groups[role]
        per_rank = groups.per_rank([(chunk,) for chunk in batch.chunk(groups.groups)])
        return groups.one_per_group(self.group.call_ranks(method, per_rank))

    def compute_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor | None]:
        """Old-policy log-probs (B, T), the actor/entropy metric (already reduced over ranks) and sum_v pi_v^2 (B, T)
        (None unless actor.calculate_sum_pi_squared)."""
        outs = self.rows_call("compute_log_prob", batch, "actor")
        sum_sq = torch.cat([o[2] for o in outs]) if outs[0][2] is not None else None
        return torch.cat([o[0] for o in outs]), outs[0][1], sum_sq

    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        return torch.cat(self.rows_call("compute_ref_log_prob", batch, "ref"))

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        return torch.cat(self.rows_call("compute_values", batch, "critic"))

    # -- updates (metrics are reduced over ranks inside the workers: rank 0's copy is the answer) --
    def update_actor(self, batch: RolloutBatch) -> dict[str, float]:
        return self.rows_call("update_actor", batch, "actor")[0]

    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        return self.rows_call("update_critic", batch, "critic")[0]

    def sft_update(self, batch: RolloutBatch) -> dict[str, float]:
        return self.rows_call("sft_update", batch, "actor")[0]

    # -- state ----------------------------------------------------------------------------------
    def save_checkpoint(self, out_dir: str, step: int) -> None:
        self.group.call("save_checkpoint", out_dir, step)

    def load_checkpoint(self, in_dir: str) -> int:
        return self.group.call("load_checkpoint", in_dir)[0]

    def export_hf(self, out_dir: str) -> None:
        self.group.call("export_hf", out_dir)

    def memory_metrics(self) -> list[dict[str, float]]:
        return self.group.call("memory_stats")

    def close(self) -> None:
        self.group.close()
