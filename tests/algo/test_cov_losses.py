"""Clip-Cov and KL-Cov (loss_mode=clip_cov / kl_cov) against per-token Python references written here: which tokens
each mode picks by the centred covariance (A - mean A)(logp - mean logp), the loss, its gradient and the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_npu.algo import losses

from .test_policy_losses import agg_weights


def _inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3 - 1e-3
    old_logp = (logp + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.4).clamp(max=-1e-4)
    advantages = torch.randn(shape[0], 1, generator=gen, dtype=torch.float64).expand(shape).contiguous() * 3
    lengths = torch.randint(1, shape[1] + 1, (shape[0],), generator=gen)
    mask = (torch.arange(shape[1])[None] < lengths[:, None]).to(torch.float64)
    return logp, old_logp, advantages, mask


def _covariances(logp, advantages, mask) -> dict[tuple[int, int], float]:
    tokens = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean_a = sum(float(advantages[i, t]) for i, t in tokens) / len(tokens)
    mean_lp = sum(float(logp[i, t]) for i, t in tokens) / len(tokens)
    return {(i, t): (float(advantages[i, t]) - mean_a) * (float(logp[i, t]) - mean_lp) for i, t in tokens}


def _run(name, logp, old_logp, advantages, mask, **settings):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = losses.get_policy_loss_fn(name)(logp, old_logp, advantages, mask, **settings)
    loss.backward()
    return loss.detach(), logp.grad, metrics


@pytest.mark.parametrize("shape", [(3, 4), (6, 8), (12, 10)])
@pytest.mark.parametrize("ratio,coef", [(0.0002, 0.1), (0.1, 1.0), (0.5, 0.3)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_cov_penalises_the_largest_covariances(shape, ratio, coef, mode):
    logp, old_logp, advantages, mask = _inputs(shape, seed=shape[0] + int(ratio * 1e4))
    loss, grad, metrics = _run("kl_cov", logp, old_logp, advantages, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef,
                               agg_mode=mode)
    cov = _covariances(logp, advantages, mask)
    chosen = set(sorted(cov, key=cov.get, reverse=True)[: max(1, int(len(cov) * ratio))])
    weights = agg_weights(mask, mode)
    want_loss, want_grad, abs_kl = 0.0, torch.zeros_like(grad), 0.0
    for (i, t) in cov:
        d = float(logp[i, t] - old_logp[i, t])
        a, r = float(advantages[i, t]), math.exp(d)
        value, slope = -a * r, -a * r
        if (i, t) in chosen:
            value, slope = value + coef * abs(d), slope + coef * math.copysign(1.0, d)
        want_loss += float(weights[i, t]) * value
        want_grad[i, t] = float(weights[i, t]) * slope
        abs_kl += abs(d)
    assert float(loss) == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert set(metrics) == {"ppo_kl"} and float(metrics["ppo_kl"]) == pytest.approx(abs_kl / len(cov))


@pytest.mark.parametrize("shape", [(6, 8), (12, 10)])
@pytest.mark.parametrize("bounds", [(0.1, 5.0), (-0.5, 0.5)])
def test_clip_cov_takes_the_candidate_tokens_out_of_the_clipped_loss(shape, bounds):
    """clip_cov_ratio=1: every candidate (covariance inside the bounds, not already bound by PPO's clip) leaves the
    loss; every other token keeps PPO's max(-A r, -A clip(r)) (no dual clip, the ratio unclamped)."""
    lb, ub = bounds
    logp, old_logp, advantages, mask = _inputs(shape, seed=7 + shape[0])
    loss, grad, metrics = _run("clip_cov", logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28,
                               clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
    cov = _covariances(logp, advantages, mask)
    weights = agg_weights(mask, "token-mean")
    want_loss, want_grad, dropped, kl = 0.0, torch.zeros_like(grad), 0, 0.0
    for (i, t), c in cov.items():
        d = float(logp[i, t] - old_logp[i, t])
        a, r = float(advantages[i, t]), math.exp(d)
        unclipped, clipped = -a * r, -a * min(max(r, 0.8), 1.28)
        kl -= d
        if lb < c < ub and not clipped > unclipped:
            dropped += 1
            continue
        want_loss += float(weights[i, t]) * max(unclipped, clipped)
        want_grad[i, t] = float(weights[i, t]) * (-a * r if unclipped >= clipped or 0.8 < r < 1.28 else 0.0)
    assert 0 < dropped < len(cov)  # the inputs have both kinds
    assert float(loss) == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(dropped / len(cov))
    assert float(metrics["ppo_kl"]) == pytest.approx(kl / len(cov))


def test_clip_cov_draws_its_share_of_the_candidates_the_same_way_each_time():
    logp, old_logp, advantages, mask = _inputs((16, 12), seed=3)
    settings = dict(clip_low=0.2, clip_high=0.28, clip_cov_ratio=0.05, clip_cov_lb=-1.0, clip_cov_ub=5.0)
    runs = [_run("clip_cov", logp, old_logp, advantages, mask, **settings) for _ in range(2)]
    n = int(mask.sum())
    assert float(runs[0][2]["pg_clipfrac"]) == pytest.approx(max(1, int(0.05 * n)) / n)  # exactly its share
    assert torch.equal(runs[0][1], runs[1][1])  # the same micro-batch takes the same tokens out
    everything, _, _ = _run("clip_cov", logp, old_logp, advantages, mask, **{**settings, "clip_cov_ratio": 1.0})
    assert float(runs[0][0]) != float(everything)


def test_bad_ratios_are_refused():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.actor\.policy_loss\.clip_cov_ratio=0\.0: expected > 0"):
        losses.get_policy_loss_fn("clip_cov")(x, x, x, x, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.actor\.policy_loss\.kl_cov_ratio=0\.0: expected > 0"):
        losses.get_policy_loss_fn("kl_cov")(x, x, x, x, kl_cov_ratio=0.0)
