"""Which rank generates which prompts: rollout groups of ``tensor_model_parallel_size`` ranks.

With tensor parallelism t > 1 every rank builds its own in-process vLLM engine with
``distributed_executor_backend="external_launcher"``, and vLLM forms tensor-parallel groups of t
consecutive ranks from RANK / WORLD_SIZE. The ranks of a group run each engine step together, so they
must be fed the same requests: the same prompts and the same sampling seed. They then return the same
samples, and the driver keeps the first rank's copy only, so each prompt's n samples arrive once.
With t = 1 every rank is its own group (data-parallel rollout). The grouping itself is
:class:`grpo_npu.rank_groups.RankGroups`'s. :func:`rollout_tp` says t for a rollout config
(the worker layout and the phase-limit floors both read it).

    layout = RolloutLayout(world_size=4, size=2)       # tp 2: groups {0, 1} and {2, 3}
    per_rank = layout.per_rank_inputs(ids, mask, sampling)   # ranks 0, 1 get half 0; ranks 2, 3 half 1
    outputs = layout.one_per_group(group.call_ranks("generate", per_rank))   # ranks 0 and 2
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from grpo_npu.errors import ConfigError
from grpo_npu.rank_groups import RankGroups

# Group g samples with seed + g * GROUP_SEED_STRIDE: groups never share a sample stream.
GROUP_SEED_STRIDE = 1_000_003
TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def rollout_tp(rollout: Any) -> int:
    """Ranks per generation engine for a rollout config: vLLM's tensor_model_parallel_size; 1 for the transformers
    rollout, which is data-parallel."""
    return rollout.tensor_model_parallel_size if rollout.name == "vllm" else 1


@dataclass(frozen=True)
class RolloutLayout(RankGroups):
    """``world_size`` ranks in groups of ``tp`` consecutive ranks (one engine per group)."""

    def __post_init__(self) -> None:
        if self.size < 1 or self.world_size % self.size:
            raise ConfigError(f"{TP_KEY}={self.size} must divide the {self.world_size} ranks "
                              "(trainer.nnodes x trainer.n_gpus_per_node)")

    @property
    def tp(self) -> int:
        return self.size

    def per_rank_inputs(self, prompt_ids, prompt_mask, sampling) -> list[tuple]:
        """(prompt_ids (B/groups, P), prompt_mask, sampling) per rank: group g's chunk and seed on each of its ranks."""
        ids, masks = prompt_ids.chunk(self.groups), prompt_mask.chunk(self.groups)
        if len(ids) != self.groups or len({len(x) for x in ids}) != 1:
            raise ValueError(f"{len(prompt_ids)} prompts cannot be split evenly over {self.groups} rollout groups "
                             f"({self.world_size} ranks / {TP_KEY}={self.tp})")
        per_group = []
        for g in range(self.groups):
            seed = None if sampling.seed is None else sampling.seed + g * GROUP_SEED_STRIDE
            per_group.append((ids[g], masks[g], dataclasses.replace(sampling, seed=seed)))
        return self.per_rank(per_group)
