"""verl's other policy-loss modes (gpg, cispo, sapo, dro, dppo_tv, dppo_kl, geo_mean) against per-token Python
references written here from the formulas in docs/algorithms.md: loss values, gradients and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_npu.algo import losses
from grpo_npu.algo.names import POLICY_LOSS_PARAMS, POLICY_LOSS_READS

from .test_policy_losses import agg_weights

SHAPES = [(1, 1), (3, 2), (6, 8), (17, 12)]
CLIPS = [(0.2, 0.28, 3.0), (10.0, 0.2, 10.0)]  # the second: verl's CISPO example (no lower clip), a DPPO-style c


def _inputs(shape, seed):
    """logp < 0 (probabilities), old_logp near it with a few far drifts, advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3 - 1e-3
    drift = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.4
    far = torch.rand(shape, generator=gen) < 0.15
    old_logp = (logp + torch.where(far, drift * 6, drift)).clamp(max=-1e-4)
    advantages = torch.randn(shape, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, shape[1] + 1, (shape[0],), generator=gen)
    mask = (torch.arange(shape[1])[None] < lengths[:, None]).to(torch.float64)
    return logp, old_logp, advantages, mask


def _run(name, logp, old_logp, advantages, mask, **settings):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = losses.get_policy_loss_fn(name)(logp, old_logp, advantages, mask, **settings)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def _clamped_ratio(lp, olp):
    return math.exp(min(max(lp - olp, -20.0), 20.0))


def _tokens(logp, old_logp, advantages, mask):
    batch, width = mask.shape
    for i in range(batch):
        for t in range(width):
            if mask[i, t]:
                yield i, t, float(logp[i, t]), float(old_logp[i, t]), float(advantages[i, t])


# (per-token loss, d loss / d logp, {metric: per-token value}) of each token-local mode
def ref_gpg(lp, olp, a, **_):
    return -a * lp, -a, {}


def ref_cispo(lp, olp, a, clip_low, clip_high, **_):
    r = _clamped_ratio(lp, olp)
    w = min(max(r, 1 - clip_low), 1 + clip_high)
    return -w * a * lp, -w * a, {"pg_clipfrac": float(w != r), "pg_clipfrac_lower": 0.0,
                                 "ppo_kl": -max(min(lp - olp, 20.0), -20.0)}


def ref_dro(lp, olp, a, dro_beta, **_):
    d = lp - olp
    return -(a * lp - 0.5 * dro_beta * d * d), -(a - dro_beta * d), {"ppo_kl": -d}


def _ref_dppo(inside):
    def ref(lp, olp, a, clip_low, clip_high, clip_c, **_):
        r = _clamped_ratio(lp, olp)
        keep = float(inside(math.exp(lp), math.exp(olp), a > 0, clip_low, clip_high))
        t = min(r, clip_c)
        return -a * t * lp * keep, -a * t * keep, {"pg_clipfrac": 1 - keep, "pg_clipfrac_lower": float(r > clip_c) * keep,
                                                   "ppo_kl": -max(min(lp - olp, 20.0), -20.0)}
    return ref


def _tv_inside(p, po, positive, low, high):
    return p - po <= high if positive else p - po >= -low


def _kl_inside(p, po, positive, low, high):
    d = po * (math.log(po) - math.log(p)) + (1 - po) * math.log((1 - po + 1e-8) / (1 - p + 1e-8))
    return (d <= high or p <= po) if positive else (d <= low or p >= po)


TOKEN_REFS = {"gpg": ref_gpg, "cispo": ref_cispo, "dro": ref_dro, "dppo_tv": _ref_dppo(_tv_inside),
              "dppo_kl": _ref_dppo(_kl_inside)}


def _settings(name, clip_low, clip_high, clip_c):
    given = {"clip_low": clip_low, "clip_high": clip_high, "clip_c": clip_c, "tau_pos": 1.0, "tau_neg": 1.05,
             "dro_beta": 0.3}
    return {POLICY_LOSS_PARAMS[k]: given[POLICY_LOSS_PARAMS[k]] for k in POLICY_LOSS_READS[name]}


@pytest.mark.parametrize("name", sorted(TOKEN_REFS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clips", CLIPS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_local_modes_match_the_reference(name, shape, clips, mode):
    logp, old_logp, advantages, mask = _inputs(shape, seed=hash((name, shape, clips)) % 1000)
    settings = _settings(name, *clips)
    loss, grad, metrics = _run(name, logp, old_logp, advantages, mask, agg_mode=mode, **settings)
    weights = agg_weights(mask, mode)
    want_loss, want_grad, sums = 0.0, torch.zeros_like(grad), {}
    for i, t, lp, olp, a in _tokens(logp, old_logp, advantages, mask):
        value, slope, token_metrics = TOKEN_REFS[name](lp, olp, a, **settings)
        want_loss += float(weights[i, t]) * value
        want_grad[i, t] = float(weights[i, t]) * slope
        for key, v in token_metrics.items():
            sums[key] = sums.get(key, 0.0) + v
    assert float(loss) == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert set(metrics) == set(TOKEN_REFS[name](-1.0, -1.0, 1.0, **settings)[2])
    n = max(int(mask.sum()), 1)
    for key, value in metrics.items():
        assert float(value) == pytest.approx(sums.get(key, 0.0) / n, abs=1e-12), key


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])  # sapo always uses seq-mean-token-mean
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_is_a_gated_policy_gradient_averaged_per_response(shape, mode, taus):
    logp, old_logp, advantages, mask = _inputs(shape, seed=sum(shape))
    tau_pos, tau_neg = taus
    loss, grad, metrics = _run("sapo", logp, old_logp, advantages, mask, agg_mode=mode, tau_pos=tau_pos, tau_neg=tau_neg)
    weights = agg_weights(mask, "seq-mean-token-mean")
    want_loss, want_grad, kl = 0.0, torch.zeros_like(grad), 0.0
    for i, t, lp, olp, a in _tokens(logp, old_logp, advantages, mask):
        tau, r = (tau_pos if a > 0 else tau_neg), _clamped_ratio(lp, olp)
        s = _sigmoid(tau * (r - 1))
        want_loss += float(weights[i, t]) * -a * s * 4 / tau
        want_grad[i, t] = float(weights[i, t]) * -a * 4 * s * (1 - s) * r  # d/dlp of sigmoid(tau (r - 1)) 4 / tau
        kl += olp - lp
    assert float(loss) == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert float(metrics["ppo_kl"]) == pytest.approx(kl / max(int(mask.sum()), 1), abs=1e-12)
    assert float(metrics["pg_clipfrac"]) == float(metrics["pg_clipfrac_lower"]) == 0.0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clips", [(0.2, 0.28), (0.4, 0.4)])
def test_geo_mean_is_the_per_response_geometric_mean_ratio(shape, clips):
    logp, old_logp, advantages, mask = _inputs(shape, seed=7 + sum(shape))
    low, high = clips
    loss, grad, metrics = _run("geo_mean", logp, old_logp, advantages, mask, clip_low=low, clip_high=high)
    batch, width = mask.shape
    want_loss, want_grad = 0.0, torch.zeros_like(grad)
    upper = lower = kl = 0.0
    for i in range(batch):
        rows = [(t, lp, olp, a) for j, t, lp, olp, a in _tokens(logp, old_logp, advantages, mask) if j == i]
        length = len(rows) + 1e-8
        picked = []
        for t, lp, olp, a in rows:
            d = lp - olp
            c = min(max(d, -low), high)
            sign = (a > 0) - (a < 0)
            picked.append((t, d if sign * d <= sign * c else c, sign * d <= sign * c and sign != 0))
            upper += float(d != c and a > 0)
            lower += float(d != c and a < 0)
            kl -= d
        ratio = math.exp(sum(p for _, p, _ in picked) / length)
        mean_adv = sum(a for *_, a in rows) / length
        want_loss += -mean_adv * ratio / batch
        for t, _, moves in picked:
            want_grad[i, t] = -mean_adv * ratio / length / batch if moves else 0.0
    assert float(loss) == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    n = max(int(mask.sum()), 1)
    assert (float(metrics["pg_clipfrac"]), float(metrics["pg_clipfrac_lower"]), float(metrics["ppo_kl"])) == \
        pytest.approx((upper / n, lower / n, kl / n), abs=1e-12)


@pytest.mark.parametrize("name", ["sapo", "dro", "cispo", "dppo_tv", "dppo_kl", "gpg"])
def test_on_policy_the_gradient_is_the_policy_gradients(name):
    """At pi = pi_old every one of these modes steps as the plain policy gradient -A d logp (token-mean; sapo
    always averages per response)."""
    logp, _, advantages, mask = _inputs((5, 6), seed=3)
    _, grad, _ = _run(name, logp, logp, advantages, mask, **_settings(name, 0.2, 0.28, 3.0))
    weights = agg_weights(mask, "seq-mean-token-mean" if name == "sapo" else "token-mean")
    torch.testing.assert_close(grad, -advantages * weights, rtol=1e-12, atol=1e-12)


def test_is_weights_scale_each_token_and_enter_geo_mean_as_a_geometric_mean():
    logp, old_logp, advantages, mask = _inputs((4, 5), seed=11)
    weights = torch.rand(4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    plain, _, _ = _run("gpg", logp, old_logp, advantages * weights, mask)
    weighted, _, _ = _run("gpg", logp, old_logp, advantages, mask, rollout_is_weights=weights)
    assert float(weighted) == pytest.approx(float(plain), rel=1e-12)
    one = torch.ones(4, 5, dtype=torch.float64)
    geo, _, _ = _run("geo_mean", logp, old_logp, advantages, mask, rollout_is_weights=one * 2)
    base, _, _ = _run("geo_mean", logp, old_logp, advantages, mask)
    assert float(geo) == pytest.approx(2 * float(base), rel=1e-8)  # geometric mean of 2s is 2 (+ verl's 1e-10)


def test_dppo_kl_keeps_a_token_whose_old_probability_underflows():
    """p_old = exp(-120) is 0 in float32: the binary KL takes its log term from the log-probs (as verl), not
    log(0), so the token stays in the trust region (p > p_old, A > 0 and d small) instead of becoming NaN."""
    logp = torch.tensor([[-50.0, -0.5]], requires_grad=True)
    old_logp = torch.tensor([[-120.0, -0.5]])
    _, metrics = losses.dppo_kl_loss(logp, old_logp, torch.ones(1, 2), torch.ones(1, 2), clip_c=3.0)
    assert float(metrics["pg_clipfrac"]) == 0.0


def test_bad_settings_are_refused():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.actor\.policy_loss\.dro_beta=None: loss_mode=dro needs"):
        losses.dro_loss(x, x, x, x)
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.actor\.tau_pos / tau_neg: expected > 0, got 0.0 / 1.05"):
        losses.sapo_loss(x, x, x, x, tau_pos=0.0)
    with pytest.raises(ValueError, match=r"actor.clip_ratio_c: expected > 1, got 1.0"):
        losses.dppo_tv_loss(x, x, x, x, clip_c=1.0)
