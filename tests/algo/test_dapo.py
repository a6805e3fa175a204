"""DAPO group filter and overlong penalty against Python references."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from grpo_npu.algo import dapo


def ref_filter(metric, keys):
    """Keep a response when its group has one member or more than one distinct metric value."""
    members = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    keep = [False] * len(keys)
    for rows in members.values():
        if len(rows) == 1 or len({metric[i] for i in rows}) > 1:
            for i in rows:
                keep[i] = True
    return keep


@pytest.mark.parametrize("batch", [1, 2, 9, 40])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["str", "numpy", "tensor", "tuple"])
def test_filter_groups_matches_reference(batch_kit, batch, seed, kind):
    _, random_groups = batch_kit
    gen = torch.Generator().manual_seed(seed)
    ids, keys = random_groups(batch, gen, kind)
    acc = (torch.rand(batch, generator=gen) < 0.6).float()  # 0/1 accuracy: many all-right / all-wrong groups
    scores = torch.randn(batch, generator=gen)
    keep = dapo.filter_groups(scores, ids, acc)
    assert keep.dtype == torch.bool and keep.shape == (batch,)
    assert keep.tolist() == ref_filter(acc.tolist(), keys)


def test_filter_groups_uses_scores_when_no_metric_is_given():
    token_scores = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 2.0], [5.0, 0.0]])
    keep = dapo.filter_groups(token_scores, ["a", "a", "b", "b", "c"])  # sums: a 1,1  b 0,2  c 5
    assert keep.tolist() == [False, False, True, True, True]


def test_filter_groups_zero_std_is_exact():
    # 0.1 + 0.1 + 0.1 is not 0.3 in floats: a float std would come out ~1e-17, not 0, and keep the group.
    keep = dapo.filter_groups(torch.zeros(3), ["g"] * 3, [0.1, 0.1, 0.1])
    assert keep.tolist() == [False, False, False]


def test_filter_groups_errors():
    with pytest.raises(ValueError, match=r"metric_values: expected shape \(3,\)"):
        dapo.filter_groups(torch.zeros(3), ["a", "b", "c"], [1.0, 2.0])
    with pytest.raises(ValueError, match="one key per response"):
        dapo.filter_groups(torch.zeros(3), ["a", "b"], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="finite"):
        dapo.filter_groups(torch.zeros(2), ["a", "a"], [float("nan"), 1.0])


def ref_overlong(length, max_response_length, buffer_len, penalty_factor):
    expected = max_response_length - buffer_len
    exceed = length - expected
    return min(-exceed / buffer_len * penalty_factor, 0.0)


@pytest.mark.parametrize("max_len,buffer_len,factor", [(20, 4, 1.0), (512, 128, 0.5), (16, 16, 2.0)])
def test_overlong_penalty_matches_reference(max_len, buffer_len, factor):
    lengths = list(range(0, max_len + 1))
    got = dapo.overlong_penalty(lengths, max_response_length=max_len, buffer_len=buffer_len, penalty_factor=factor)
    assert got.dtype == torch.float32 and got.shape == (len(lengths),)
    expected = torch.tensor([ref_overlong(n, max_len, buffer_len, factor) for n in lengths])
    torch.testing.assert_close(got, expected)
    assert float(got[-1]) == pytest.approx(-factor)  # a response that hits the limit gets the full penalty


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="overlong_buffer.len: expected > 0"):
        dapo.overlong_penalty([1], max_response_length=10, buffer_len=0, penalty_factor=1.0)
    with pytest.raises(ValueError, match="overlong_buffer.len: expected <= data.max_response_length"):
        dapo.overlong_penalty([1], max_response_length=10, buffer_len=11, penalty_factor=1.0)
    with pytest.raises(ValueError, match="penalty_factor"):
        dapo.overlong_penalty([1], max_response_length=10, buffer_len=2, penalty_factor=-1.0)
    with pytest.raises(ValueError, match=r"response_lengths: expected shape \(B,\)"):
        dapo.overlong_penalty([[1]], max_response_length=10, buffer_len=2, penalty_factor=1.0)
