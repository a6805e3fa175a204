"""Random (B, T) batches for the algorithm tests, with the edge cases built in.

Masks are right-padded responses of random length where row 0 is fully masked and row 1 has a
single token (when the batch has room); ``holes=True`` also masks random interior tokens (tool
output inside a multi-turn response). Groups have random sizes from 1 to 5, interleaved.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

GROUP_ID_KINDS = ("str", "numpy", "tensor", "tuple")


def random_mask(batch: int, width: int, gen: torch.Generator, *, holes: bool = False) -> torch.Tensor:
    """(B, T) bool response mask."""
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    if batch >= 3:
        lengths[0] = 0
        lengths[1] = 1
    mask = torch.arange(width)[None, :] < lengths[:, None]
    if holes:
        interior = torch.rand(batch, width, generator=gen) < 0.25
        interior[:, 0] = False
        mask &= ~interior
    return mask


def random_groups(batch: int, gen: torch.Generator, kind: str):
    """(group_ids in the requested container kind, the same keys as a Python list)."""
    sizes = []
    while sum(sizes) < batch:
        sizes.append(min(int(torch.randint(1, 6, (1,), generator=gen)), batch - sum(sizes)))
    codes = [g for g, size in enumerate(sizes) for _ in range(size)]
    codes = [codes[i] for i in torch.randperm(batch, generator=gen).tolist()]
    keys = [1000 + 7 * c for c in codes]  # not dense, not sorted
    if kind == "str":
        ids = [f"uid-{k}" for k in keys]
    elif kind == "numpy":
        ids = np.asarray(keys, dtype=np.int64)
    elif kind == "tensor":
        ids = torch.tensor(keys)
    elif kind == "tuple":
        ids = [("prompt", k) for k in keys]
    else:
        raise ValueError(kind)
    return ids, list(ids) if kind != "tensor" else ids.tolist()


@pytest.fixture
def batch_kit():
    """The helpers above, for tests that need random batches."""
    return random_mask, random_groups
