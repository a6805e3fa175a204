"""Micro-batch splitting: fixed groups, balanced token-budget packing, padding trim, row reassembly."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from grpo_npu.workers.micro_batch import (
    balanced_groups,
    fixed_groups,
    scatter_rows,
    token_budget_groups,
    trim_padding,
)

from .helpers import make_batch


def _is_partition(groups, n):
    flat = sorted(i for g in groups for i in g)
    return flat == list(range(n)) and all(groups)


def test_fixed_groups_cover_rows_in_order():
    assert fixed_groups(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_groups(4, 4) == [[0, 1, 2, 3]]
    assert fixed_groups(0, 2) == []
    with pytest.raises(ValueError, match="micro-batch size"):
        fixed_groups(4, 0)


@pytest.mark.parametrize("seed", range(5))
def test_balanced_groups_partition_and_balance(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(rng.randint(3, 12))]
    for k in range(1, len(lengths) + 1):
        groups = balanced_groups(lengths, k)
        assert len(groups) == k and _is_partition(groups, len(lengths))
        loads = [sum(lengths[i] for i in g) for g in groups]
        # Greedy LPT bound: the heaviest group exceeds the ideal by at most one row.
        assert max(loads) <= sum(lengths) / k + max(lengths)
    with pytest.raises(ValueError, match="non-empty"):
        balanced_groups(lengths, len(lengths) + 1)


def _fewest_groups_brute_force(lengths, budget):
    """The smallest k such that SOME partition into k groups fits the budget (exhaustive)."""
    n = len(lengths)
    for k in range(1, n + 1):
        for labels in itertools.product(range(k), repeat=n):
            if len(set(labels)) != k:
                continue
            loads = [0] * k
            for i, g in enumerate(labels):
                loads[g] += lengths[i]
            if max(loads) <= budget:
                return k
    return n


@pytest.mark.parametrize("seed", range(8))
def test_token_budget_groups_fit_and_are_near_minimal(seed):
    rng = random.Random(100 + seed)
    lengths = [rng.randint(1, 20) for _ in range(rng.randint(2, 7))]
    budget = rng.randint(max(lengths), 45)
    groups = token_budget_groups(lengths, budget)
    assert _is_partition(groups, len(lengths))
    assert all(sum(lengths[i] for i in g) <= budget for g in groups)
    best = _fewest_groups_brute_force(lengths, budget)
    assert best <= len(groups) <= best + 1  # greedy packing: optimal or one more


def test_token_budget_groups_min_groups_and_errors():
    lengths = [5, 5, 5, 5]
    assert len(token_budget_groups(lengths, 100)) == 1
    assert len(token_budget_groups(lengths, 100, min_groups=3)) == 3
    assert len(token_budget_groups(lengths, 100, min_groups=9)) == 4  # at most one row per group
    assert token_budget_groups([], 10) == []
    with pytest.raises(ValueError, match="row 1 has 11 tokens.*budget 10"):
        token_budget_groups([3, 11, 2], 10)


def test_trim_padding_drops_only_all_padding_columns():
    batch = make_batch(seed=1)
    batch = batch.replace(old_logp=torch.randn(batch.response_ids.shape),
                          reward_baselines=torch.arange(len(batch), dtype=torch.float32))  # (B,): kept whole
    trimmed = trim_padding(batch.select([0, 1]))
    assert trimmed.reward_baselines.tolist() == [0.0, 1.0]
    pm, rm = batch.prompt_mask[:2], batch.response_mask[:2]
    first = int(pm.bool().any(0).nonzero()[0])
    last = int(rm.bool().any(0).nonzero()[-1])
    assert torch.equal(trimmed.prompt_ids, batch.prompt_ids[:2, first:])
    assert torch.equal(trimmed.response_mask, rm[:, : last + 1])
    assert torch.equal(trimmed.old_logp, batch.old_logp[:2, : last + 1])
    assert torch.equal(trimmed.advantages, batch.advantages[:2, : last + 1])
    # the same real tokens, the same attention pattern
    assert torch.equal(trimmed.input_ids[trimmed.attention_mask.bool()], batch.select([0, 1]).input_ids[
        batch.select([0, 1]).attention_mask.bool()])


def test_trim_padding_keeps_one_response_column_when_all_empty():
    batch = make_batch(seed=2, empty_row=None)
    empty = batch.replace(response_mask=torch.zeros_like(batch.response_mask))
    assert trim_padding(empty).response_ids.shape[1] == 1


def test_scatter_rows_restores_order_and_pads():
    groups = [[2, 0], [1]]
    parts = [torch.tensor([[20.0, 21.0], [0.5, 1.5]]), torch.tensor([[10.0]])]
    out = scatter_rows(parts, groups, num_rows=3, width=3)
    assert torch.equal(out, torch.tensor([[0.5, 1.5, 0.0], [10.0, 0.0, 0.0], [20.0, 21.0, 0.0]]))
