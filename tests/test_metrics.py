"""grpo_npu.metrics against values computed by hand (and by plain-Python loops for random batches)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from grpo_npu.batch import RolloutBatch
from grpo_npu.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    reduce_metrics,
    variance_proxy_metrics,
)


def _hand_batch(with_values: bool = True) -> RolloutBatch:
    # 3 responses, prompt width 4, response width 4.
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    scores = torch.tensor([[0.0, 1.0, 0, 0], [0, 0, 0, 0.5], [2.0, 0, 0, 0]])
    rewards = scores - 0.25 * response_mask  # a KL-in-reward style shift on every valid token
    advantages = torch.tensor([[1.0, 3.0, 99, 99], [-1.0, 0.0, 2.0, 4.0], [-6.0, 99, 99, 99]])
    returns = advantages + 10
    values = torch.tensor([[11.0, 13.0, 0, 0], [9.0, 10.0, 12.0, 14.0], [0.0, 0, 0, 0]])
    return RolloutBatch(
        prompt_ids=torch.zeros(3, 4, dtype=torch.long),
        prompt_mask=prompt_mask,
        response_ids=torch.zeros(3, 4, dtype=torch.long),
        response_mask=response_mask,
        token_level_scores=scores,
        token_level_rewards=rewards,
        advantages=advantages,
        returns=returns,
        values=values if with_values else None,
    )


def test_data_metrics_hand_computed():
    m = compute_data_metrics(_hand_batch(), use_critic=True, max_response_length=4, max_prompt_length=4)
    # scores per sequence: 1.0, 0.5, 2.0
    assert m["critic/score/mean"] == pytest.approx(3.5 / 3)
    assert m["critic/score/max"] == 2.0 and m["critic/score/min"] == 0.5
    # rewards: 1 - 0.5, 0.5 - 1.0, 2 - 0.25
    assert m["critic/rewards/mean"] == pytest.approx((0.5 - 0.5 + 1.75) / 3)
    assert m["critic/rewards/max"] == 1.75 and m["critic/rewards/min"] == -0.5
    # valid advantages: 1, 3, -1, 0, 2, 4, -6 (the 99s are padding)
    assert m["critic/advantages/mean"] == pytest.approx(3 / 7)
    assert m["critic/advantages/max"] == 4.0 and m["critic/advantages/min"] == -6.0
    assert m["critic/returns/mean"] == pytest.approx(10 + 3 / 7)
    assert m["critic/returns/max"] == 14.0 and m["critic/returns/min"] == 4.0
    # valid values: 11, 13, 9, 10, 12, 14, 0
    assert m["critic/values/mean"] == pytest.approx(69 / 7)
    assert m["critic/values/max"] == 14.0 and m["critic/values/min"] == 0.0
    # lengths: responses 2, 4, 1 (one of 3 hits the limit 4); prompts 3, 4, 2 (one of 3 at 4)
    assert m["response_length/mean"] == pytest.approx(7 / 3)
    assert m["response_length/max"] == 4 and m["response_length/min"] == 1
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["prompt_length/mean"] == pytest.approx(3.0)
    assert m["prompt_length/max"] == 4 and m["prompt_length/min"] == 2
    assert m["prompt_length/clip_ratio"] == pytest.approx(1 / 3)


def test_explained_variance_by_hand():
    m = compute_data_metrics(_hand_batch(), use_critic=True, max_response_length=4)
    rets = [11.0, 13.0, 9.0, 10.0, 12.0, 14.0, 4.0]
    vals = [11.0, 13.0, 9.0, 10.0, 12.0, 14.0, 0.0]

    def pvar(xs):
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / len(xs)

    expected = 1 - pvar([r - v for r, v in zip(rets, vals)]) / (pvar(rets) + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(expected)


def test_no_critic_metrics_without_critic_and_limits_change_clip_ratio():
    m = compute_data_metrics(_hand_batch(with_values=False), use_critic=False, max_response_length=8,
                             max_prompt_length=8)
    assert not any(k.startswith("critic/values") or k == "critic/vf_explained_var" for k in m)
    assert m["response_length/clip_ratio"] == 0.0 and m["prompt_length/clip_ratio"] == 0.0
    # prompt limit defaults to the prompt width (prompts are left-padded to it)
    m = compute_data_metrics(_hand_batch(with_values=False), use_critic=False, max_response_length=2)
    assert m["prompt_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)  # only the length-2 response


def test_missing_fields_are_named():
    batch = _hand_batch(with_values=False)
    with pytest.raises(ValueError, match="RolloutBatch.values"):
        compute_data_metrics(batch, use_critic=True, max_response_length=4)
    with pytest.raises(ValueError, match="RolloutBatch.advantages"):
        compute_data_metrics(batch.replace(advantages=None), use_critic=False, max_response_length=4)
    with pytest.raises(ValueError, match="max_response_length"):
        compute_data_metrics(batch, use_critic=False, max_response_length=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_data_metrics_match_python_loops(seed):
    gen = torch.Generator().manual_seed(seed)
    b, p, t = 7, 5, 6
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    response_mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    plen = torch.randint(1, p + 1, (b,), generator=gen)
    prompt_mask = (torch.arange(p)[None, :] >= (p - plen)[:, None]).long()
    rnd = lambda: torch.randn(b, t, generator=gen)  # noqa: E731
    batch = RolloutBatch(
        prompt_ids=torch.zeros(b, p, dtype=torch.long), prompt_mask=prompt_mask,
        response_ids=torch.zeros(b, t, dtype=torch.long), response_mask=response_mask,
        token_level_scores=rnd(), token_level_rewards=rnd(), advantages=rnd(), returns=rnd(), values=rnd(),
    )
    m = compute_data_metrics(batch, use_critic=True, max_response_length=t, max_prompt_length=p)
    rows = range(b)
    valid = lambda x: [x[i][j].item() for i in rows for j in range(t) if response_mask[i][j]]  # noqa: E731
    seq = lambda x: [sum(x[i][j].item() for j in range(t)) for i in rows]  # noqa: E731
    expected = {
        "critic/score": seq(batch.token_level_scores), "critic/rewards": seq(batch.token_level_rewards),
        "critic/advantages": valid(batch.advantages), "critic/returns": valid(batch.returns),
        "critic/values": valid(batch.values),
    }
    for name, xs in expected.items():
        assert m[f"{name}/mean"] == pytest.approx(sum(xs) / len(xs), abs=1e-6)
        assert m[f"{name}/max"] == pytest.approx(max(xs)) and m[f"{name}/min"] == pytest.approx(min(xs))
    lens = [int(x) for x in lengths]
    assert m["response_length/mean"] == pytest.approx(sum(lens) / b)
    assert m["response_length/clip_ratio"] == pytest.approx(sum(x == t for x in lens) / b)
    assert m["prompt_length/clip_ratio"] == pytest.approx(sum(int(x) == p for x in plen) / b)


def test_timing_metrics():
    m = compute_timing_metrics({"gen": 2.0, "update_actor": 0.5, "step": 3.0}, num_tokens=1000,
                               num_response_tokens=400)
    assert m == {
        "timing_s/gen": 2.0, "timing_per_token_ms/gen": 2.0 * 1000 / 400,
        "timing_s/update_actor": 0.5, "timing_per_token_ms/update_actor": 0.5,
        "timing_s/step": 3.0, "timing_per_token_ms/step": 3.0,
    }
    # without a response-token count, gen divides by all tokens too
    assert compute_timing_metrics({"gen": 2.0}, 1000)["timing_per_token_ms/gen"] == 2.0
    with pytest.raises(ValueError, match="num_tokens"):
        compute_timing_metrics({"gen": 1.0}, 0)
    with pytest.raises(ValueError, match="'gen'"):
        compute_timing_metrics({"gen": -1.0}, 10)


def test_throughput_metrics():
    m = compute_throughput_metrics(num_tokens=12000, step_seconds=4.0, n_devices=8)
    assert m == {"perf/total_num_tokens": 12000.0, "perf/time_per_step": 4.0, "perf/throughput": 375.0}
    with pytest.raises(ValueError, match="step_seconds"):
        compute_throughput_metrics(10, 0.0, 1)
    with pytest.raises(ValueError, match="n_devices"):
        compute_throughput_metrics(10, 1.0, 0)


def test_reduce_metrics():
    out = reduce_metrics([{"a": 1.0, "b": torch.tensor(4.0)}, {"a": 3, "c": 5.0}, {"a": torch.tensor([2.0])}])
    assert out == {"a": 2.0, "b": 4.0, "c": 5.0}
    assert reduce_metrics([]) == {}
    random.seed(0)
    xs = [random.random() for _ in range(10)]
    assert math.isclose(reduce_metrics([{"x": x} for x in xs])["x"], sum(xs) / 10)
    with pytest.raises(ValueError, match="'v'"):
        reduce_metrics([{"v": torch.ones(2)}])
    with pytest.raises(TypeError, match="'s'"):
        reduce_metrics([{"s": "text"}])


@pytest.mark.parametrize("with_is", [False, True])
def test_variance_proxy_metrics_by_hand(with_is):
    """verl's variance_proxy/*: per row the mean advantage a and W = sum_t (1 - 2 pi_t + sum pi^2)(rho_t^2) over its
    valid tokens; proxy2 = mean a^2 max(W, 0) (with IS weights: mean rho_row^2 a^2 max(W without them, 0));
    proxy1 = grad_norm^2, proxy3 = max(0, (proxy2 - proxy1) / (B - 1))."""
    b = _hand_batch()
    mask = b.response_mask
    gen = torch.Generator().manual_seed(3)
    old_logp = -torch.rand(mask.shape, generator=gen)
    sum_sq = 0.1 + 0.8 * torch.rand(mask.shape, generator=gen)
    rho = 0.5 + torch.rand(mask.shape, generator=gen) if with_is else None
    batch = b.replace(old_logp=old_logp, sum_pi_squared=sum_sq, rollout_is_weights=rho)
    got = variance_proxy_metrics(batch, grad_norm=0.5)
    a, w, w_raw, rho_row = [], [], [], []
    for i in range(3):
        valid = [t for t in range(4) if mask[i, t]]
        a.append(sum(float(b.advantages[i, t]) for t in valid) / len(valid))
        terms = [1 - 2 * math.exp(float(old_logp[i, t])) + float(sum_sq[i, t]) for t in valid]
        w_raw.append(sum(terms))
        w.append(sum(x * (float(rho[i, t]) ** 2 if with_is else 1.0) for x, t in zip(terms, valid)))
        rho_row.append(sum(float(rho[i, t]) for t in valid) / len(valid) if with_is else 1.0)
    if with_is:
        proxy2 = sum(r * r * x * x * max(v, 0.0) for r, x, v in zip(rho_row, a, w_raw)) / 3
    else:
        proxy2 = sum(x * x * max(v, 0.0) for x, v in zip(a, w)) / 3
    want = {"variance_proxy/proxy1_signal_strength": 0.25, "variance_proxy/proxy2_total_power": proxy2,
            "variance_proxy/proxy3_pure_noise": max(0.0, (proxy2 - 0.25) / 2),
            "variance_proxy/expected_a_squared": sum(x * x for x in a) / 3, "variance_proxy/expected_w": sum(w) / 3}
    assert got == pytest.approx(want, rel=1e-6)
    assert variance_proxy_metrics(batch, grad_norm=None)["variance_proxy/proxy3_pure_noise"] == 0.0
