"""Groups of consecutive ranks that are fed the same inputs and answer once: ``size`` ranks per group.

Two things in grpo_npu run a computation on several ranks at once and must hand each rank of a group the
same rows: a tensor-parallel vLLM engine (:class:`grpo_npu.rollout.layout.RolloutLayout`, groups of
``rollout.tensor_model_parallel_size``) and Ulysses sequence parallelism (groups of
``ulysses_sequence_parallel_size``, :mod:`grpo_npu.workers.ulysses`), where the ranks of a group split each
micro-batch's tokens between them. Group g is ranks ``g * size .. (g + 1) * size - 1``; the driver sends group
g the g-th equal chunk of the rows and keeps the first rank's answer, since every rank of a group returns the
same one. Torch-free.

    groups = RankGroups(world_size=4, size=2)        # {0, 1} and {2, 3}
    per_rank = groups.per_rank(["chunk 0", "chunk 1"])   # ['chunk 0', 'chunk 0', 'chunk 1', 'chunk 1']
    answers = groups.one_per_group(["a", "a", "b", "b"])   # ['a', 'b']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class RankGroups:
    """``world_size`` ranks in groups of ``size`` consecutive ranks."""

    world_size: int
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or self.world_size % self.size:
            raise ValueError(f"groups of {self.size} ranks cannot split {self.world_size} ranks")

    @property
    def groups(self) -> int:
        return self.world_size // self.size

    def group_of(self, rank: int) -> int:
        return rank // self.size

    def leaders(self) -> list[int]:
        """The first rank of each group: the one whose answer the driver keeps."""
        return [g * self.size for g in range(self.groups)]

    def per_rank(self, per_group: Sequence[Any]) -> list[Any]:
        """One item per group -> one per rank: every rank of group g gets item g."""
        if len(per_group) != self.groups:
            raise ValueError(f"expected one item per group ({self.groups}), got {len(per_group)}")
        return [per_group[self.group_of(r)] for r in range(self.world_size)]

    def one_per_group(self, outputs: Sequence[Any]) -> list[Any]:
        """The leaders' outputs, in group order (the other ranks of a group returned the same)."""
        if len(outputs) != self.world_size:
            raise ValueError(f"expected one output per rank ({self.world_size}), got {len(outputs)}")
        return [outputs[r] for r in self.leaders()]
