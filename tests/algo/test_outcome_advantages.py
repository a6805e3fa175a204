"""opo, grpo_passk and verl's vectorized grpo / rloo names, each against a loop written here."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_npu.algo import advantages as adv


def _batch(seed: int, groups: int = 4, per: int = 4, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    rows = groups * per
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0] = 0 if seed % 2 else lengths[0]  # an empty response in some batches
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    scores = torch.randint(0, 3, (rows,), generator=g).double() if seed % 3 else torch.randn(rows, generator=g).double()
    rewards = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        if lengths[i]:
            rewards[i, lengths[i] - 1] = scores[i]
    keys = [f"p{i // per}" for i in range(rows)]
    return rewards, mask, keys, [float(rewards[i].sum()) for i in range(rows)], lengths.tolist()


def _members(keys):
    out = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return out.values()


@pytest.mark.parametrize("seed", range(6))
def test_opo_subtracts_the_length_weighted_group_mean(seed):
    rewards, mask, keys, s, lengths = _batch(seed)
    want = [0.0] * len(s)
    for members in _members(keys):
        total = sum(lengths[i] for i in members)
        base = sum(lengths[i] * s[i] for i in members) / total if len(members) > 1 and total else 0.0
        for i in members:
            want[i] = s[i] - base
    got, returns = adv.compute_advantage("opo", token_level_rewards=rewards, response_mask=mask, group_ids=keys)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64)[:, None] * mask, rtol=1e-12, atol=1e-12)
    assert torch.equal(returns, got)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_rewards_only_each_groups_best_against_its_second_best(seed, norm):
    rewards, mask, keys, s, _ = _batch(seed)
    want = [0.0] * len(s)
    for members in _members(keys):
        ranked = sorted(members, key=lambda i: s[i], reverse=True)
        gap = s[ranked[0]] - s[ranked[1]]
        mean = sum(s[i] for i in members) / len(members)
        std = math.sqrt(sum((s[i] - mean) ** 2 for i in members) / (len(members) - 1))
        best = [i for i in members if s[i] == s[ranked[0]]]
        if len(best) == 1:  # a tie at the top has gap 0: every member 0 whichever one topk names
            want[best[0]] = gap / (std + adv.GRPO_EPS) if norm else gap
    got, _ = adv.compute_advantage("grpo_passk", token_level_rewards=rewards, response_mask=mask, group_ids=keys,
                                   norm_by_std=norm)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64)[:, None] * mask, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="grpo_passk needs at least 2 responses per group"):
        adv.compute_advantage("grpo_passk", token_level_rewards=rewards, response_mask=mask,
                              group_ids=[f"own{i}" for i in range(len(keys))])


@pytest.mark.parametrize("vectorized, base", [("grpo_vectorized", "grpo"), ("rloo_vectorized", "rloo")])
def test_verls_vectorized_names_compute_the_same_estimator(vectorized, base):
    rewards, mask, keys, _, _ = _batch(7)
    keys[-1] = "alone"  # a group of one
    assert adv.get_advantage_fn(vectorized) is adv.get_advantage_fn(base)
    assert adv.estimator_inputs(vectorized) == adv.estimator_inputs(base)
    a, _ = adv.compute_advantage(vectorized, token_level_rewards=rewards, response_mask=mask, group_ids=keys)
    b, _ = adv.compute_advantage(base, token_level_rewards=rewards, response_mask=mask, group_ids=keys)
    assert torch.equal(a, b)
