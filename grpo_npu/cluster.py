"""The trainer's typed handle on its workers: split the batch over ranks, call, gather.

``Workers`` wraps a :class:`~grpo_npu.workers.WorkerGroup` of :class:`~grpo_npu.workers.hybrid.HybridWorker`
(in-process for one device with no Ray cluster given, Ray actors otherwise) and exposes the calls a
training step makes, each returning driver-side tensors in the batch's row order.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from grpo_npu.batch import RolloutBatch
from grpo_npu.config import Config
from grpo_npu.rollout.base import GenerationOutput, SamplingConfig
from grpo_npu.workers import LocalGroup, RayGroup, WorkerGroup
from grpo_npu.workers.hybrid import HybridWorker

log = logging.getLogger(__name__)

# Rank r samples with seed + r * RANK_SEED_STRIDE: ranks never share a sample stream.
RANK_SEED_STRIDE = 1_000_003


def make_group(cfg: Config, worker_cls: type, args: tuple) -> WorkerGroup:
    """LocalGroup for a single device without RAY_ADDRESS, else one Ray actor per device (n_gpus_per_node per node)."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if world == 1 and not os.environ.get("RAY_ADDRESS"):
        return LocalGroup(worker_cls, device_kind=cfg.trainer.device, args=args)
    return RayGroup(worker_cls, world_size=world, nnodes=cfg.trainer.nnodes, device_kind=cfg.trainer.device, args=args,
                    ray_num_cpus=cfg.ray_init.num_cpus, start_timeout_s=cfg.trainer.ray_wait_register_center_timeout)


class Workers:
    """Typed calls over a worker group; every call is collective across ranks."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.world_size = group.world_size

    @classmethod
    def build(cls, cfg: Config, *, total_training_steps: int, worker_cls: type = HybridWorker,
              with_rollout: bool = True) -> "Workers":
        group = make_group(cfg, worker_cls, (cfg, with_rollout))
        try:
            built = group.call("init_model", total_training_steps)[0]
        except BaseException:
            group.close()
            raise
        log.info("workers: %d rank(s), roles %s", group.world_size, {k: v for k, v in built.items() if v})
        return cls(group)

    # -- rollout --------------------------------------------------------------------------------
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig
                 ) -> list[GenerationOutput]:
        """Rank r generates for the r-th equal chunk of prompts; outputs in rank order."""
        ids, masks = prompt_ids.chunk(self.world_size), prompt_mask.chunk(self.world_size)
        if len(ids) != self.world_size or len({len(x) for x in ids}) != 1:
            raise ValueError(f"{len(prompt_ids)} prompts cannot be split evenly over {self.world_size} ranks")
        per_rank = []
        for r in range(self.world_size):
            seed = None if sampling.seed is None else sampling.seed + r * RANK_SEED_STRIDE
            per_rank.append((ids[r], masks[r], dataclasses.replace(sampling, seed=seed)))
        return self.group.call_ranks("generate", per_rank)

    # -- scoring --------------------------------------------------------------------------------
    def compute_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Old-policy log-probs (B, T) and the actor/entropy metric (already reduced over ranks)."""
        outs = self.group.chunk_and_call("compute_log_prob", batch)
        return torch.cat([o[0] for o in outs]), outs[0][1]

    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        return torch.cat(self.group.chunk_and_call("compute_ref_log_prob", batch))

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        return torch.cat(self.group.chunk_and_call("compute_values", batch))

    # -- updates (metrics are reduced over ranks inside the workers: rank 0's copy is the answer) --
    def update_actor(self, batch: RolloutBatch) -> dict[str, float]:
        return self.group.chunk_and_call("update_actor", batch)[0]

    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        return self.group.chunk_and_call("update_critic", batch)[0]

    def sft_update(self, batch: RolloutBatch) -> dict[str, float]:
        return self.group.chunk_and_call("sft_update", batch)[0]

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
