"""Splitting a rank's batch into micro-batches: a fixed row count, or packing by a token budget.

Every function returns row-index groups into the batch, so results computed per micro-batch can be
put back in the original row order. Dynamic batch size (``use_dynamic_bsz``) packs rows so that the
sum of each micro-batch's token lengths (prompt + response, attention mask) stays within
``max_tokens``, balancing the loads (longest-processing-time greedy). Under FSDP every rank must run
the same number of forward passes, so :func:`token_budget_groups` accepts a ``min_groups`` that the
caller sets to the maximum over ranks: :func:`plan_micro_batches` agrees on it collectively.
:func:`forward_in_micro_batches` runs a forward-only pass (log-probs, values) over the groups.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable, Sequence

import torch

from grpo_npu.batch import RolloutBatch
from grpo_npu.device import Device
from grpo_npu.workers import fsdp

# RolloutBatch tensors that are (B, P) prompt-side; every other tensor field is (B, T) response-side.
PROMPT_FIELDS = ("prompt_ids", "prompt_mask")


def fixed_groups(num_rows: int, size: int) -> list[list[int]]:
    """Consecutive groups of ``size`` rows (the last may be smaller)."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    return [list(range(s, min(s + size, num_rows))) for s in range(0, num_rows, size)]


def balanced_groups(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Split rows into ``k`` non-empty groups with balanced length sums (greedy, longest row first).

    Needs 1 <= k <= len(lengths). Indices inside a group are ascending; groups are ordered by their
    smallest index, so the split is deterministic.
    """
    n = len(lengths)
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} rows into {k} non-empty micro-batches")
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    heap = [(0, g) for g in range(k)]  # (load, group id): the k longest rows open the k groups
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), g))
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def token_budget_groups(lengths: Sequence[int], max_tokens: int, min_groups: int = 1) -> list[list[int]]:
    """The fewest (at least ``min_groups``) balanced groups whose length sums are <= ``max_tokens``.

    ``min_groups`` larger than the row count gives one row per group (the caller pads with empty
    micro-batches if it needs more).
    """
    n = len(lengths)
    if n == 0:
        return []
    longest = max(int(x) for x in lengths)
    if longest > max_tokens:
        row = max(range(n), key=lambda i: int(lengths[i]))
        raise ValueError(
            f"row {row} has {longest} tokens, more than the micro-batch token budget {max_tokens} "
            "(ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu): raise it to at least "
            "max_prompt_length + max_response_length"
        )
    k = min(n, max(min_groups, math.ceil(sum(int(x) for x in lengths) / max_tokens), 1))
    while True:
        groups = balanced_groups(lengths, k)
        if k == n or max(sum(int(lengths[i]) for i in g) for g in groups) <= max_tokens:
            return groups
        k += 1


def trim_padding(batch: RolloutBatch) -> RolloutBatch:
    """Drop prompt columns that are padding in every row (left) and response columns likewise (right)."""
    prompt_cols = batch.prompt_mask.bool().any(0).nonzero()
    first = int(prompt_cols[0]) if prompt_cols.numel() else batch.prompt_mask.shape[1] - 1
    resp_cols = batch.response_mask.bool().any(0).nonzero()
    width = int(resp_cols[-1]) + 1 if resp_cols.numel() else 1
    changes = {}
    for f in dataclasses.fields(batch):
        t = getattr(batch, f.name)
        if not isinstance(t, torch.Tensor) or t.dim() < 2:  # (B,) per-row values have no columns
            continue
        changes[f.name] = t[:, first:] if f.name in PROMPT_FIELDS else t[:, :width]
    return batch.replace(**changes)


def scatter_rows(parts: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], num_rows: int, width: int) -> torch.Tensor:
    """Reassemble per-group (b_i, t_i) results into (num_rows, width) in original row order (zero right-pad)."""
    if not parts:
        raise ValueError("scatter_rows: no micro-batch results")
    out = parts[0].new_zeros((num_rows, width))
    for part, rows in zip(parts, groups):
        out[torch.as_tensor(list(rows), dtype=torch.long), : part.shape[1]] = part.to(out.dtype)
    return out


def plan_micro_batches(batch: RolloutBatch, *, size: int | None, max_tokens: int | None, dev: Device) -> list[list[int]]:
    """Row groups for one pass: fixed ``size`` rows, or (``max_tokens`` set) balanced token-budget packing.

    Token-budget packing is collective: every rank gets the same number of groups (the maximum over
    ranks), because each FSDP forward gathers parameters with all ranks. Ranks hold equal row counts.
    """
    n = len(batch)
    if max_tokens is None:
        if size is None:
            raise ValueError("a micro-batch size or a token budget (use_dynamic_bsz) is required")
        return fixed_groups(n, size)
    lengths = batch.attention_mask.sum(1).tolist()
    count = len(token_budget_groups(lengths, max_tokens))
    while True:  # rarely more than one round: a larger count can need one more group somewhere
        agreed = int(fsdp.all_reduce(torch.tensor([count], device=dev.torch_device()), "max").item())
        if agreed > n:
            raise RuntimeError(f"ranks hold different row counts: {agreed} micro-batches for {n} rows on this rank")
        groups = token_budget_groups(lengths, max_tokens, min_groups=agreed)
        count = len(groups)
        done = fsdp.all_reduce(torch.tensor([int(count == agreed)], device=dev.torch_device()), "min")
        if int(done.item()) == 1:
            return groups


@torch.no_grad()
def forward_in_micro_batches(fn: Callable[[RolloutBatch], torch.Tensor | tuple], batch: RolloutBatch, *,
                             size: int | None, max_tokens: int | None, dev: Device) -> list[torch.Tensor]:
    """Run ``fn`` on each trimmed micro-batch (planned as :func:`plan_micro_batches`; collective).

    Returns one (B, T) float32 host tensor per output of ``fn``, rows in the batch's order.
    """
    if len(batch) == 0:
        raise ValueError("an empty batch: every rank needs at least one row")
    groups = plan_micro_batches(batch, size=size, max_tokens=max_tokens, dev=dev)
    parts: list[list[torch.Tensor]] = []
    for rows in groups:
        out = fn(trim_padding(batch.select(rows)))
        out = out if isinstance(out, tuple) else (out,)
        parts.append([o.float().cpu() for o in out])
    width = batch.response_ids.shape[1]
    return [scatter_rows([p[k] for p in parts], groups, len(batch), width) for k in range(len(parts[0]))]
