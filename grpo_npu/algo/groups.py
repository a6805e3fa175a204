"""Prompt groups: arbitrary per-response keys -> a dense index, and vectorised per-group statistics.

``group_ids`` is any sequence of hashable keys with one entry per response (a list of uid strings,
a numpy array, a 1-D tensor). Responses with equal keys belong to the same prompt group.
Statistics are computed with ``index_add_`` / ``scatter_reduce`` over the dense index: no Python
loop over groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def group_index(group_ids, batch_size: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Dense int64 group index (B,) in [0, G) and the number of groups G."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids: expected a 1-D tensor, got shape {tuple(group_ids.shape)}")
        uniques, inverse = torch.unique(group_ids, return_inverse=True)
        num_groups = uniques.numel()
    elif isinstance(group_ids, np.ndarray) and group_ids.dtype != object:
        if group_ids.ndim != 1:
            raise ValueError(f"group_ids: expected a 1-D array, got shape {group_ids.shape}")
        uniques, inverse_np = np.unique(group_ids, return_inverse=True)
        inverse, num_groups = torch.from_numpy(inverse_np.reshape(-1).astype(np.int64)), len(uniques)
    elif isinstance(group_ids, (Sequence, np.ndarray)) and not isinstance(group_ids, (str, bytes)):
        # Arbitrary hashable keys (uid strings, tuples): number them by first appearance.
        dense: dict = {}
        try:
            codes = [dense.setdefault(key, len(dense)) for key in group_ids]
        except TypeError as exc:
            raise ValueError(f"group_ids: every key must be hashable ({exc})") from None
        inverse, num_groups = torch.tensor(codes, dtype=torch.int64), len(dense)
    else:
        raise ValueError(f"group_ids: expected a sequence of hashable keys, got {type(group_ids).__name__}")
    if inverse.numel() != batch_size:
        raise ValueError(f"group_ids: expected one key per response ({batch_size}), got {inverse.numel()}")
    return inverse.to(device=device, dtype=torch.int64), num_groups


@dataclass(frozen=True)
class GroupStats:
    """Per-group count, mean and unbiased std (G,); std is 0 for groups of one."""

    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def group_stats(x: torch.Tensor, index: torch.Tensor, num_groups: int) -> GroupStats:
    """Count, mean and unbiased (n-1) std of ``x`` (B,) per group.

    Each group is shifted by its first member before summing, so a group of equal values gets
    exactly its value as mean and exactly 0 as std (plain float sums would leave ~1e-8 residues,
    which GRPO's division by std + 1e-6 would blow up to visible advantages).
    """
    positions = torch.arange(x.shape[0], device=x.device)
    first = torch.full((num_groups,), x.shape[0], dtype=positions.dtype, device=x.device)
    first = first.scatter_reduce(0, index, positions, reduce="amin")  # (G,) first member of each group
    shift = x[first]  # (G,)
    offset = x - shift[index]  # (B,)
    count = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, index, torch.ones_like(x))
    mean_offset = torch.zeros_like(count).index_add_(0, index, offset) / count.clamp(min=1)
    sq_dev = torch.zeros_like(count).index_add_(0, index, (offset - mean_offset[index]).square())
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    return GroupStats(count=count, mean=shift + mean_offset, std=std)


def group_all_equal(x: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(G,) bool: every member of the group has the same value (exact, unlike a float std == 0)."""
    empty = torch.empty(num_groups, dtype=x.dtype, device=x.device)
    high = empty.scatter_reduce(0, index, x, reduce="amax", include_self=False)
    low = empty.scatter_reduce(0, index, x, reduce="amin", include_self=False)
    return high == low
