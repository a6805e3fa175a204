"""Advantage estimators against slow per-group / per-token Python references."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from grpo_npu.algo import advantages as adv

SHAPES = [(1, 1), (5, 1), (16, 7), (41, 13)]
DTYPES = [torch.float32, torch.bfloat16]
KINDS = ["str", "numpy", "tensor", "tuple"]
TOL = dict(rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# References: Python floats, loops over groups and tokens
# ------------------------------------------------------------------------------------------------
def _valid_tokens(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def _scores(rewards, mask):
    return [sum(float(rewards[i, t]) for t in _valid_tokens(mask, i)) for i in range(rewards.shape[0])]


def _groups(keys):
    members = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    return members


def _broadcast(per_seq, mask):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, value in enumerate(per_seq):
        for t in _valid_tokens(mask, i):
            out[i, t] = value
    return out


def _whiten(x, mask):
    xs = [float(x[i, t]) for i in range(mask.shape[0]) for t in _valid_tokens(mask, i)]
    n = len(xs)
    mean = sum(xs) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in xs) / (n - 1) if n > 1 else 0.0
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        for t in _valid_tokens(mask, i):
            out[i, t] = (float(x[i, t]) - mean) / math.sqrt(var + 1e-8)
    return out


def ref_grpo(rewards, mask, keys, eps=1e-6, norm_by_std=True):
    scores = _scores(rewards, mask)
    result = [0.0] * len(scores)
    for members in _groups(keys).values():
        vals = [scores[i] for i in members]
        n = len(vals)
        if n == 1:
            mu, sigma = 0.0, 1.0
        else:
            mu = sum(vals) / n
            sigma = math.sqrt(sum((v - mu) ** 2 for v in vals) / (n - 1))
        for i in members:
            result[i] = (scores[i] - mu) / (sigma + eps) if norm_by_std else scores[i] - mu
    return _broadcast(result, mask)


def ref_rloo(rewards, mask, keys):
    scores = _scores(rewards, mask)
    result = [0.0] * len(scores)
    for members in _groups(keys).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            result[i] = scores[i] - sum(others) / len(others) if others else 0.0
    return _broadcast(result, mask)


def ref_rpp_returns(rewards, mask, gamma):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        valid = _valid_tokens(mask, i)
        for j, t in enumerate(valid):
            out[i, t] = sum(gamma**k * float(rewards[i, s]) for k, s in enumerate(valid[j:]))
    return out


def ref_rpp_baseline(rewards, mask, keys):
    scores = _scores(rewards, mask)
    centred = [0.0] * len(scores)
    for members in _groups(keys).values():
        mu = sum(scores[i] for i in members) / len(members) if len(members) > 1 else 0.0
        for i in members:
            centred[i] = scores[i] - mu
    return _whiten(_broadcast(centred, mask), mask)


def ref_gae(rewards, values, mask, gamma, lam):
    advantages = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        next_value, next_adv = 0.0, 0.0
        for t in reversed(_valid_tokens(mask, i)):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            next_adv = delta + gamma * lam * next_adv
            next_value = float(values[i, t])
            advantages[i, t] = next_adv
    returns = advantages + values.double() * mask
    return _whiten(advantages, mask), returns


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------
def make_rewards(mask, gen, style, dtype):
    """dense: a reward on every token; outcome: 0/1 on the last valid token (many all-equal groups)."""
    if style == "dense":
        rewards = torch.randn(mask.shape, generator=gen)
    else:
        rewards = torch.zeros(mask.shape)
        lengths = mask.sum(-1)
        hits = torch.rand(mask.shape[0], generator=gen) < 0.5
        for i in range(mask.shape[0]):
            if lengths[i] > 0:
                rewards[i, int(lengths[i]) - 1] = float(hits[i])
    return rewards.to(dtype)


def _setup(batch_kit, shape, seed, dtype, style, kind, holes=False):
    random_mask, random_groups = batch_kit
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(*shape, gen, holes=holes)
    rewards = make_rewards(mask, gen, style, dtype)
    ids, keys = random_groups(shape[0], gen, kind)
    return rewards, mask, ids, keys


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["dense", "outcome"])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(batch_kit, shape, seed, dtype, style, norm_by_std):
    rewards, mask, ids, keys = _setup(batch_kit, shape, seed, dtype, style, KINDS[seed % 4])
    advantages, returns = adv.grpo_advantage(rewards, mask, ids, norm_by_std=norm_by_std)
    expected = ref_grpo(rewards, mask, keys, norm_by_std=norm_by_std)
    assert advantages.dtype == torch.float32 and advantages.shape == shape
    torch.testing.assert_close(advantages.double(), expected, **TOL)
    torch.testing.assert_close(returns, advantages)


def test_grpo_edge_cases():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.1, 0.0, 9.0], [0.1, 0, 0], [0.0, 0.0, 0.1], [0.5, 0, 0], [0, 0, 0], [0.7, 0, 0]])
    # group a: three equal scores 0.1 (the 9.0 is padding and ignored); b: a singleton; c: a fully masked row + one
    ids = ["a", "a", "a", "b", "c", "c"]
    advantages, _ = adv.grpo_advantage(rewards, mask, ids)
    assert torch.equal(advantages[:3], torch.zeros(3, 3)), "all-equal rewards must give exactly 0"
    torch.testing.assert_close(advantages[3], torch.tensor([0.5, 0.5, 0.5]) / (1 + 1e-6))
    assert torch.equal(advantages[4], torch.zeros(3)), "a fully masked row gets no advantage"
    # c: scores 0 and 0.7, mean 0.35, std 0.7/sqrt(2)
    torch.testing.assert_close(advantages[5, 0], torch.tensor(0.35 / (0.7 / math.sqrt(2) + 1e-6)))
    assert torch.equal(advantages[5, 1:], torch.zeros(2))


def ref_gpg(rewards, mask, keys):
    scores = _scores(rewards, mask)
    alpha = len(scores) / max(sum(1 for v in scores if v != 0), 1)
    result = [0.0] * len(scores)
    for members in _groups(keys).values():
        mu = sum(scores[i] for i in members) / len(members) if len(members) > 1 else 0.0
        for i in members:
            result[i] = alpha * (scores[i] - mu)
    return _broadcast(result, mask)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["dense", "outcome"])
@pytest.mark.parametrize("name, offset", [("rloo", 1), ("gpg", 2)])
def test_group_baseline_estimators_match_reference(batch_kit, shape, seed, dtype, style, name, offset):
    """rloo and gpg: a per-response value from the group's other scores, broadcast; returns = advantages."""
    rewards, mask, ids, keys = _setup(batch_kit, shape, seed, dtype, style, KINDS[(seed + offset) % 4])
    advantages, returns = adv.compute_advantage(name, token_level_rewards=rewards, response_mask=mask, group_ids=ids)
    torch.testing.assert_close(advantages.double(), {"rloo": ref_rloo, "gpg": ref_gpg}[name](rewards, mask, keys), **TOL)
    torch.testing.assert_close(returns, advantages)


def ref_remax(rewards, mask, baselines):
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    advantages = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        valid = _valid_tokens(mask, i)
        for t in valid:
            returns[i, t] = sum(float(rewards[i, u]) for u in valid if u >= t)
            advantages[i, t] = returns[i, t] - float(baselines[i])
    return advantages, returns


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("style", ["dense", "outcome"])
def test_remax_matches_reference(batch_kit, shape, seed, style):
    rewards, mask, _, _ = _setup(batch_kit, shape, seed, torch.float32, style, "str")
    baselines = torch.randn(shape[0], generator=torch.Generator().manual_seed(seed))
    advantages, returns = adv.compute_advantage("remax", token_level_rewards=rewards, response_mask=mask,
                                                reward_baselines=baselines)
    want_adv, want_ret = ref_remax(rewards, mask, baselines)
    torch.testing.assert_close(advantages.double(), want_adv, **TOL)
    torch.testing.assert_close(returns.double(), want_ret, **TOL)


def test_remax_needs_one_baseline_per_row():
    rewards, mask = torch.ones(3, 2), torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator=remax needs reward_baselines, got None"):
        adv.compute_advantage("remax", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match=r"reward_baselines: expected \(3,\), got \(2,\)"):
        adv.remax_advantage(rewards, mask, torch.zeros(2))


def test_gpg_scales_by_the_inverse_fraction_of_nonzero_scores():
    """Two groups of two: scores (1, 0) and (0, 0): alpha = 4 / 1, means 0.5 and 0."""
    rewards = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
    advantages, _ = adv.gpg_advantage(rewards, torch.ones(4, 1), ["a", "a", "b", "b"])
    assert advantages[:, 0].tolist() == [2.0, -2.0, 0.0, 0.0]


def ref_gdpo(components, mask, keys, weights, norm_by_std):
    """Each component as a one-token outcome reward through the GRPO reference, weighted, summed, whitened."""
    total = torch.zeros(mask.shape, dtype=torch.float64)
    for weight, component in zip(weights, components):
        outcome = torch.zeros(mask.shape, dtype=torch.float64)
        for i in range(mask.shape[0]):
            valid = _valid_tokens(mask, i)
            if valid:
                outcome[i, valid[-1]] = float(component[i])
        total += weight * ref_grpo(outcome, mask, keys, norm_by_std=norm_by_std)
    return _whiten(total, mask)


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_gdpo_matches_reference(batch_kit, shape, seed, norm_by_std):
    _, mask, ids, keys = _setup(batch_kit, shape, seed, torch.float32, "outcome", KINDS[seed % 4])
    gen = torch.Generator().manual_seed(seed + 7)
    components = torch.randint(0, 3, (1 + seed, shape[0]), generator=gen).float()  # 1-3 components of 0/1/2
    weights = [0.5, 2.0, 1.0][: 1 + seed] if seed else None
    advantages, returns = adv.compute_advantage("gdpo", token_level_rewards=torch.zeros(shape), response_mask=mask,
                                                group_ids=ids, reward_components=components, component_weights=weights,
                                                norm_by_std=norm_by_std)
    expected = ref_gdpo(components, mask, keys, weights or [1.0] * len(components), norm_by_std)
    torch.testing.assert_close(advantages.double(), expected, **TOL)
    torch.testing.assert_close(returns, advantages)


def test_gdpo_normalises_each_component_before_the_sum():
    """One group of two, component a = (1, 0) with weight 2, component b = (0, 100) with weight 1: GRPO on the
    weighted sum (2, 100) lets b's scale decide (row 1 ahead); GDPO normalises each first, and a's weight wins."""
    mask = torch.ones(2, 1)
    components = torch.tensor([[1.0, 0.0], [0.0, 100.0]])
    advantages, _ = adv.compute_advantage("gdpo", token_level_rewards=torch.zeros(2, 1), response_mask=mask,
                                          group_ids=["g", "g"], reward_components=components, component_weights=(2.0, 1.0))
    assert advantages[0, 0] > 0 > advantages[1, 0]
    summed, _ = adv.grpo_advantage((2 * components[0] + components[1])[:, None], mask, ["g", "g"])
    assert summed[1, 0] > 0 > summed[0, 0]
    with pytest.raises(ValueError, match=r"gdpo_reward_keys: row 1's reward result has no fmt \(it has: acc, score\)"):
        adv.gdpo_components([{"fmt": 1.0}, {"score": 1.0, "acc": 1.0}], ["fmt"])
    assert adv.gdpo_components([{"fmt": 1, "acc": 0.5}], ["acc", "fmt"]).tolist() == [[0.5], [1.0]]


def ref_otb(rewards, mask, keys, logp, sum_sq, is_weights=None):
    """Optimal token baseline, token by token: G_t reward-to-go, W_t = sum_{j<=t} (1 - 2 pi_j + sum pi^2)(rho_j^2),
    B_t = sum_i G_it W_it / (sum_i W_it + 1e-8) over the group's valid tokens at t; groups of one B = 0; a group's
    single longest response has B = 0 past the second longest length."""
    rows, width = mask.shape
    G = torch.zeros(rows, width, dtype=torch.float64)
    W = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        acc = 0.0
        for t in reversed(range(width)):
            acc += float(rewards[i, t]) if mask[i, t] else 0.0
            G[i, t] = acc
        acc = 0.0
        for t in range(width):
            if mask[i, t]:
                w = 1 - 2 * math.exp(float(logp[i, t])) + float(sum_sq[i, t])
                acc += w * (float(is_weights[i, t]) ** 2 if is_weights is not None else 1.0)
            W[i, t] = acc
    out = torch.zeros(rows, width, dtype=torch.float64)
    for members in _groups(keys).values():
        lengths = {i: len(_valid_tokens(mask, i)) for i in members}
        ranked = sorted(lengths.values(), reverse=True)
        for i in members:
            for t in _valid_tokens(mask, i):
                base = 0.0
                if len(members) > 1:
                    num = sum(G[j, t] * W[j, t] for j in members if mask[j, t])
                    den = sum(W[j, t] for j in members if mask[j, t]) + 1e-8
                    base = num / den
                    if lengths[i] == ranked[0] and ranked[0] > ranked[1] and t >= ranked[1]:
                        base = 0.0
                out[i, t] = G[i, t] - base
    return out, G


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("holes", [False, True])
def test_optimal_token_baseline_matches_reference(batch_kit, shape, seed, holes):
    random_mask, random_groups = batch_kit
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(*shape, gen, holes=holes)
    ids, keys = random_groups(shape[0], gen, KINDS[seed % 4])
    rewards = torch.randn(shape, generator=gen)
    logp = -3 * torch.rand(shape, generator=gen)
    sum_sq = 0.01 + 0.5 * torch.rand(shape, generator=gen)
    is_weights = 2 * torch.rand(shape, generator=gen) if seed % 2 else None
    advantages, returns = adv.compute_advantage("optimal_token_baseline", token_level_rewards=rewards,
                                                response_mask=mask, group_ids=ids, old_logp=logp,
                                                sum_pi_squared=sum_sq, rollout_is_weights=is_weights)
    expected, expected_returns = ref_otb(rewards, mask, keys, logp, sum_sq, is_weights)
    torch.testing.assert_close(advantages.double(), expected, **TOL)
    torch.testing.assert_close(returns.double() * mask, expected_returns * mask, **TOL)


def _to_front(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's values at its valid positions, moved to the front in order (zeros after)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        vals = x[i][mask[i].bool()]
        out[i, : len(vals)] = vals
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tir_optimal_token_baseline_is_the_otb_of_each_rows_valid_tokens(batch_kit, seed):
    """verl's multi-turn variant: the reference OTB over every row's valid tokens moved to the front, put back in
    place; on masks without holes the same as optimal_token_baseline."""
    random_mask, random_groups = batch_kit
    gen = torch.Generator().manual_seed(seed)
    shape = (16, 7)
    for holes in (True, False):
        mask = random_mask(*shape, gen, holes=holes)
        ids, keys = random_groups(shape[0], gen, KINDS[seed % 4])
        rewards, logp = torch.randn(shape, generator=gen), -3 * torch.rand(shape, generator=gen)
        sum_sq = 0.01 + 0.5 * torch.rand(shape, generator=gen)
        is_weights = 2 * torch.rand(shape, generator=gen) if seed % 2 else None
        inputs = dict(token_level_rewards=rewards, response_mask=mask, group_ids=ids, old_logp=logp,
                      sum_pi_squared=sum_sq, rollout_is_weights=is_weights)
        advantages, _ = adv.compute_advantage("tir_optimal_token_baseline", **inputs)
        front = [None if t is None else _to_front(t, mask) for t in (rewards * mask, logp, sum_sq, is_weights)]
        packed, _ = ref_otb(front[0], _to_front(mask, mask), keys, front[1], front[2], front[3])
        expected = torch.zeros_like(packed)
        for i in range(shape[0]):
            expected[i, mask[i].bool()] = packed[i, : int(mask[i].sum())]
        torch.testing.assert_close(advantages.double(), expected, **TOL)
        if not holes:
            otb, _ = adv.compute_advantage("optimal_token_baseline", **inputs)
            torch.testing.assert_close(advantages, otb, rtol=0, atol=0)


def test_optimal_token_baseline_weighs_by_the_path_variance_and_zeroes_the_longest_tail():
    """Two responses, reward 1 and 0 on their last token. With equal w the baseline at t is the mean return over the
    valid rows; the longer response's positions past the shorter's end get baseline 0 (its advantage is its return)."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    logp = torch.full((2, 4), math.log(0.5))
    sum_sq = torch.full((2, 4), 0.5)  # w = 1 - 2 x 0.5 + 0.5 = 0.5: W_t = 0.5 (t + 1) for both
    advantages, _ = adv.compute_advantage("optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                                          group_ids=["g", "g"], old_logp=logp, sum_pi_squared=sum_sq)
    # t = 0, 1: both valid, equal W: B = (1 + 0) / 2; t = 2, 3: row 0 alone and past row 1's length: B = 0
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 1.0, 1.0], [-0.5, -0.5, 0.0, 0.0]]))
    heavier = sum_sq.clone()
    heavier[0] = 2.5  # row 0's tokens carry more path variance (w = 2.5 against 0.5): the baseline leans to its return
    advantages, _ = adv.compute_advantage("optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                                          group_ids=["g", "g"], old_logp=logp, sum_pi_squared=heavier)
    torch.testing.assert_close(advantages[:, 0], torch.tensor([1 - 5 / 6, -5 / 6]))
    with pytest.raises(ValueError, match="optimal_token_baseline needs sum_pi_squared, got None"):
        adv.compute_advantage("optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                              group_ids=["g", "g"], old_logp=logp)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(batch_kit, shape, seed, dtype, gamma):
    rewards, mask, _, _ = _setup(batch_kit, shape, seed, dtype, "dense", "str", holes=True)
    advantages, returns = adv.reinforce_plus_plus_advantage(rewards, mask, gamma=gamma)
    expected_returns = ref_rpp_returns(rewards, mask, gamma)
    torch.testing.assert_close(returns.double(), expected_returns, **TOL)
    torch.testing.assert_close(advantages.double(), _whiten(expected_returns, mask), **TOL)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["dense", "outcome"])
def test_reinforce_plus_plus_baseline_matches_reference(batch_kit, shape, seed, dtype, style):
    rewards, mask, ids, keys = _setup(batch_kit, shape, seed, dtype, style, KINDS[(seed + 2) % 4])
    advantages, returns = adv.reinforce_plus_plus_baseline_advantage(rewards, mask, ids)
    torch.testing.assert_close(advantages.double(), ref_rpp_baseline(rewards, mask, keys), **TOL)
    torch.testing.assert_close(returns, advantages)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_reference(batch_kit, shape, seed, dtype, gamma, lam):
    rewards, mask, _, _ = _setup(batch_kit, shape, seed, dtype, "dense", "str", holes=True)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 100)).to(dtype)
    advantages, returns = adv.gae_advantage(rewards, values, mask, gamma=gamma, lam=lam)
    expected_adv, expected_returns = ref_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages.double(), expected_adv, **TOL)
    torch.testing.assert_close(returns.double(), expected_returns, **TOL)


def test_whitening_of_a_constant_batch_is_exactly_zero():
    mask = torch.ones(4, 3, dtype=torch.bool)
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = 0.1
    advantages, _ = adv.reinforce_plus_plus_advantage(rewards, mask)
    assert torch.equal(advantages[:, -1], torch.zeros(4))


def test_group_id_containers_agree(batch_kit):
    random_mask, random_groups = batch_kit
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(24, 5, gen)
    rewards = torch.randn(24, 5, generator=gen)
    ids, keys = random_groups(24, gen, "numpy")
    expected, _ = adv.grpo_advantage(rewards, mask, ids)
    for container in (keys, [str(k) for k in keys], torch.tensor(keys), np.asarray(keys, dtype=object), [(k,) for k in keys]):
        got, _ = adv.grpo_advantage(rewards, mask, container)
        torch.testing.assert_close(got, expected)


def test_dr_grpo_is_grpo_without_std():
    rewards = torch.tensor([[1.0], [3.0], [0.0], [4.0]])
    mask = torch.ones(4, 1)
    advantages, _ = adv.compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=mask, group_ids=[0, 0, 1, 1], norm_by_std=False
    )
    torch.testing.assert_close(advantages, torch.tensor([[-1.0], [1.0], [-2.0], [2.0]]))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"])
def test_compute_advantage_calls_every_estimator_uniformly(batch_kit, name):
    rewards, mask, ids, _ = _setup(batch_kit, (12, 6), 0, torch.float32, "dense", "str")
    values = torch.randn(12, 6, generator=torch.Generator().manual_seed(5))
    common = dict(token_level_rewards=rewards, response_mask=mask, group_ids=ids, values=values, gamma=0.9, lam=0.8)
    got = adv.compute_advantage(name, **common, norm_by_std=True, eps=1e-6)
    fn = adv.get_advantage_fn(name)
    direct = {
        "grpo": lambda: fn(rewards, mask, ids, eps=1e-6, norm_by_std=True),
        "rloo": lambda: fn(rewards, mask, ids),
        "reinforce_plus_plus": lambda: fn(rewards, mask, gamma=0.9),
        "reinforce_plus_plus_baseline": lambda: fn(rewards, mask, ids),
        "gae": lambda: fn(rewards, values, mask, gamma=0.9, lam=0.8),
    }[name]()
    for g, d in zip(got, direct):
        torch.testing.assert_close(g, d)


def test_missing_inputs_and_unknown_names_are_clear_errors():
    rewards, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="grpo needs group_ids"):
        adv.compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="gae needs values"):
        adv.compute_advantage("gae", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="algorithm.adv_estimator.*'grpo_typo'.*known: gae, gdpo, gpg, grpo, grpo_passk, grpo_vectorized, opo, optimal_token_baseline"):
        adv.get_advantage_fn("grpo_typo")
    with pytest.raises(ValueError, match="one key per response"):
        adv.grpo_advantage(rewards, mask, ["a"])
    with pytest.raises(ValueError, match="hashable"):
        adv.grpo_advantage(rewards, mask, [["a"], ["b"]])
    with pytest.raises(ValueError, match=r"equal \(B, T\) shapes"):
        adv.grpo_advantage(rewards, torch.ones(2, 4), ["a", "b"])
    with pytest.raises(ValueError, match="values: expected shape"):
        adv.gae_advantage(rewards, torch.zeros(2, 2), mask)
