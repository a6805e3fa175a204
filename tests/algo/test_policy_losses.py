"""Policy / value losses and entropy against per-token Python references (values and gradients)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import grpo_npu.algo
from grpo_npu.algo import cov_losses, losses

MODES = list(losses.AGG_MODES)
SHAPES = [(1, 1), (3, 1), (6, 8), (17, 12)]


# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------
def agg_weights(mask, mode, horizon=None):
    """W (B, T) float64 with agg_loss(L) == sum(W * L): the derivative of the aggregate per token."""
    batch, width = mask.shape
    lengths = [int(mask[i].sum()) for i in range(batch)]
    num_tokens, num_seqs = sum(lengths), sum(1 for n in lengths if n)
    horizon = width if horizon is None else horizon
    weights = torch.zeros(batch, width, dtype=torch.float64)
    for i in range(batch):
        for t in range(width):
            if not mask[i, t]:
                continue
            weights[i, t] = {
                "token-mean": 1.0 / num_tokens,
                "token-sum": 1.0,
                "seq-mean-token-sum": 1.0 / num_seqs,
                "seq-mean-token-mean": 1.0 / (lengths[i] * num_seqs),
                "seq-mean-token-sum-norm": 1.0 / (num_seqs * horizon),
            }[mode]
    return weights


def ref_ppo_token(lp, olp, a, clip_low, clip_high, clip_c):
    """(loss, d loss / d lp, clipped, dual-clipped) of one token."""
    log_ratio = min(max(lp - olp, -20.0), 20.0)
    r = math.exp(log_ratio)
    l1 = -a * r
    l2 = -a * min(max(r, 1 - clip_low), 1 + clip_high)
    lc = max(l1, l2)
    dual = a < 0 and -a * clip_c < lc
    loss = -a * clip_c if dual else lc
    saturated = abs(lp - olp) >= 20.0
    grad = -a * r if (l1 >= l2 and not dual and not saturated) else 0.0
    return loss, grad, l2 > l1, dual


def ref_gspo_row(lps, olps, advs, clip_low, clip_high):
    """Per valid token of one row: (loss, d loss / d lp, clipped), as verl 0.9.1's compute_policy_loss_gspo.

    The sequence log ratio is the plain mean of the token log ratios; it is capped at 10 (no floor)
    before exp, and a capped sequence passes no gradient.
    """
    seq_log_ratio = sum(lp - olp for lp, olp in zip(lps, olps)) / len(lps)
    capped = seq_log_ratio > 10.0
    s = math.exp(min(seq_log_ratio, 10.0))
    out = []
    for a in advs:
        l1 = -a * s
        l2 = -a * min(max(s, 1 - clip_low), 1 + clip_high)
        out.append((max(l1, l2), -a * s if l1 >= l2 and not capped else 0.0, l2 > l1))
    return out


def _policy_inputs(shape, seed, dtype):
    """logp / old_logp with small drifts, |log ratio| > 20 extremes, and large ratios on A < 0 (dual clip)."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=gen) * 3
    drift = torch.randn(shape, generator=gen) * 0.3
    pick = torch.rand(shape, generator=gen)
    drift = torch.where(pick < 0.1, torch.full(shape, 25.0), drift)
    drift = torch.where((pick >= 0.1) & (pick < 0.2), torch.full(shape, -30.0), drift)
    drift = torch.where((pick >= 0.2) & (pick < 0.35), torch.full(shape, -1.5), drift)  # ratio e^1.5 > 3
    old_logp = logp + drift
    advantages = torch.randn(shape, generator=gen)
    return logp.to(dtype), old_logp.to(dtype), advantages.to(dtype)


def _masked_mean_ref(values, mask):
    picked = [v for v, m in zip(values, mask) if m]
    return sum(picked) / len(picked) if picked else 0.0


# ------------------------------------------------------------------------------------------------
# vanilla PPO
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_ppo_clip_loss_matches_reference(batch_kit, shape, seed, dtype, mode):
    random_mask, _ = batch_kit
    mask = random_mask(*shape, torch.Generator().manual_seed(seed))
    logp, old_logp, advantages = _policy_inputs(shape, seed, dtype)
    logp.requires_grad_(True)
    clip_low, clip_high, clip_c = 0.2, 0.28, 3.0
    loss, metrics = losses.ppo_clip_loss(
        logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, agg_mode=mode
    )
    loss.backward()

    weights = agg_weights(mask, mode)
    tokens = [
        [ref_ppo_token(float(logp.detach()[i, t]), float(old_logp[i, t]), float(advantages[i, t]), clip_low, clip_high, clip_c)
         for t in range(shape[1])]
        for i in range(shape[0])
    ]
    per_loss = torch.tensor([[tok[0] for tok in row] for row in tokens], dtype=torch.float64)
    per_grad = torch.tensor([[tok[1] for tok in row] for row in tokens], dtype=torch.float64)
    flat_mask = mask.reshape(-1).tolist()
    flat = [tok for row in tokens for tok in row]
    log_ratio = (old_logp.double() - logp.detach().double()).clamp(-20, 20).reshape(-1).tolist()

    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert float(loss.detach()) == pytest.approx(float((weights * per_loss).sum()), rel=1e-5, abs=1e-6)
    grad_tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(logp.grad.double(), weights * per_grad, **grad_tol)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(_masked_mean_ref([float(t[2]) for t in flat], flat_mask), abs=1e-6)
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(_masked_mean_ref([float(t[3]) for t in flat], flat_mask), abs=1e-6)
    assert float(metrics["ppo_kl"]) == pytest.approx(_masked_mean_ref(log_ratio, flat_mask), rel=1e-5, abs=1e-6)


def test_dual_clip_caps_negative_advantages():
    # ratio e^2 ~ 7.4 with A = -1: PPO loss 7.4, dual clip caps it at -A * 3 = 3 and stops the gradient.
    logp = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    old_logp = torch.tensor([[-2.0, -2.0, 0.0]])
    advantages = torch.tensor([[-1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = losses.ppo_clip_loss(logp, old_logp, advantages, mask, agg_mode="token-sum")
    loss.backward()
    # token 0: dual 3.0; token 1: A > 0, clipped at 1.2 -> -1.2; token 2: ratio 1 -> 1.0
    assert float(loss.detach()) == pytest.approx(3.0 - 1.2 + 1.0)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1.0]]))
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(1 / 3)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(1 / 3)  # token 1 (token 0's clipped branch ties)


def test_extreme_log_ratios_stay_finite():
    logp = torch.tensor([[0.0, -60.0, 0.0, -1e4]], requires_grad=True)
    old_logp = torch.tensor([[-60.0, 0.0, float("-inf"), 0.0]])
    advantages = torch.tensor([[1.0, -1.0, -2.0, 3.0]])
    loss, metrics = losses.ppo_clip_loss(logp, old_logp, advantages, torch.ones(1, 4))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


# ------------------------------------------------------------------------------------------------
# GSPO
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gspo_loss_matches_reference(batch_kit, shape, seed, dtype, mode):
    random_mask, _ = batch_kit
    mask = random_mask(*shape, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 50)
    logp = (-torch.rand(shape, generator=gen) * 3).to(dtype).requires_grad_(True)
    old_logp = (logp.detach().float() + torch.randn(shape, generator=gen) * 2e-3).to(dtype)
    advantages = torch.randn(shape, generator=gen).to(dtype)
    clip_low, clip_high = 3e-4, 4e-4
    loss, metrics = losses.gspo_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, agg_mode=mode)
    loss.backward()

    per_loss = torch.zeros(shape, dtype=torch.float64)
    per_grad = torch.zeros(shape, dtype=torch.float64)
    clipped = torch.zeros(shape, dtype=torch.float64)
    for i in range(shape[0]):
        cols = [t for t in range(shape[1]) if mask[i, t]]
        if not cols:
            continue
        row = ref_gspo_row(
            [float(logp.detach()[i, t]) for t in cols], [float(old_logp[i, t]) for t in cols],
            [float(advantages[i, t]) for t in cols], clip_low, clip_high,
        )
        for t, (value, grad, was_clipped) in zip(cols, row):
            per_loss[i, t], per_grad[i, t], clipped[i, t] = value, grad, float(was_clipped)
    weights = agg_weights(mask, mode)
    assert float(loss.detach()) == pytest.approx(float((weights * per_loss).sum()), rel=1e-5, abs=1e-6)
    grad_tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(logp.grad.double(), weights * per_grad, **grad_tol)
    num_tokens = max(int(mask.sum()), 1)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(float(clipped.sum()) / num_tokens, abs=1e-6)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_gradient_equals_the_sequence_level_objective(batch_kit, seed):
    """Token-level GSPO with seq-mean-token-mean == the published sequence objective, differentiated through s_i."""
    random_mask, _ = batch_kit
    gen = torch.Generator().manual_seed(seed)
    batch, width = 10, 7
    mask = random_mask(batch, width, gen)
    logp = (-torch.rand(batch, width, generator=gen) * 3).double().requires_grad_(True)
    old_logp = logp.detach() + torch.randn(batch, width, generator=gen).double() * 0.05
    seq_adv = torch.randn(batch, generator=gen).double()
    advantages = seq_adv[:, None].expand(batch, width)
    clip_low, clip_high = 0.02, 0.03

    loss, _ = losses.gspo_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, agg_mode="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logp)

    terms = []
    for i in range(batch):
        cols = [t for t in range(width) if mask[i, t]]
        if not cols:
            continue
        s = torch.exp(sum(logp[i, t] - old_logp[i, t] for t in cols) / len(cols))
        a = seq_adv[i]
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high)))
    reference = sum(terms) / len(terms)
    (ref_grad,) = torch.autograd.grad(reference, logp)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grad, ref_grad)


def test_gspo_matches_verl_on_large_policy_moves():
    """Rows whose sequence log ratio passes 10, where a +-20 token clamp and an uncapped ratio would differ.

    Written from verl 0.9.1's compute_policy_loss_gspo: row 0 moves by 12 per token (capped at 10:
    ratio e^10, not e^12); row 1 has token moves 26 and -4 (raw mean 11, capped at 10; a token clamp
    at 20 would give mean 8); ppo_kl averages the raw old_logp - logp (-46.01 / 7, not -40.01 / 7).
    """
    clip_low, clip_high = 3e-4, 4e-4
    inf = float("inf")  # a padding position of old_logp: never read
    logp = torch.tensor(
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, -2.0, -0.5], [0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True
    )
    old_logp = torch.tensor(
        [[-12.0, -12.0, 0.0], [-26.0, 4.0, 0.0], [-1.1, -1.9, -inf], [-0.01, 0.0, 0.0]], dtype=torch.float64
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0]])
    advantages = torch.tensor([[-1.0] * 3, [-0.5] * 3, [2.0] * 3, [1.0] * 3], dtype=torch.float64)
    loss, metrics = losses.gspo_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    loss.backward()

    # Per-sequence token-mean losses, then the mean over the 4 sequences (verl's default seq-mean-token-mean).
    row_losses = [math.exp(10.0), 0.5 * math.exp(10.0), -2.0 * math.exp(0.0), -1.0 * (1 + clip_high)]
    assert float(loss.detach()) == pytest.approx(sum(row_losses) / 4, rel=1e-12)
    # Capped rows and the clipped row pass no gradient; row 2 (ratio 1): -A * s / (len 2 * 4 sequences).
    expected_grad = torch.zeros(4, 3, dtype=torch.float64)
    expected_grad[2, :2] = -2.0 / (2 * 4)
    torch.testing.assert_close(logp.grad, expected_grad)
    raw_old_minus_new = [-12.0, -12.0, -26.0, 4.0, -0.1, 0.1, -0.01]  # the 7 valid tokens, unclamped
    assert float(metrics["ppo_kl"]) == pytest.approx(sum(raw_old_minus_new) / 7, rel=1e-9)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(1 / 7)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0


# ------------------------------------------------------------------------------------------------
# value loss
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_value_loss_matches_reference(batch_kit, shape, dtype, mode):
    random_mask, _ = batch_kit
    gen = torch.Generator().manual_seed(shape[0])
    mask = random_mask(*shape, gen)
    old_values = torch.randn(shape, generator=gen)
    values = (old_values + torch.randn(shape, generator=gen)).to(dtype).requires_grad_(True)
    old_values = old_values.to(dtype)
    returns = torch.randn(shape, generator=gen).to(dtype)
    clip_range = 0.5
    loss, metrics = losses.value_loss(values, old_values, returns, mask, clip_range=clip_range, agg_mode=mode)
    loss.backward()

    per_loss = torch.zeros(shape, dtype=torch.float64)
    per_grad = torch.zeros(shape, dtype=torch.float64)
    clipped, vpreds = [], []
    for i in range(shape[0]):
        for t in range(shape[1]):
            v, ov, r = float(values.detach()[i, t]), float(old_values[i, t]), float(returns[i, t])
            vc = ov + min(max(v - ov, -clip_range), clip_range)
            l1, l2 = (v - r) ** 2, (vc - r) ** 2
            per_loss[i, t] = max(l1, l2)
            per_grad[i, t] = 2 * (v - r) if l1 >= l2 else 0.0
            if mask[i, t]:
                clipped.append(float(l2 > l1))
                vpreds.append(v)
    weights = 0.5 * agg_weights(mask, mode)
    assert float(loss.detach()) == pytest.approx(float((weights * per_loss).sum()), rel=1e-5, abs=1e-6)
    grad_tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(values.grad.double(), weights * per_grad, **grad_tol)
    assert float(metrics["vf_clipfrac"]) == pytest.approx(sum(clipped) / max(len(clipped), 1), abs=1e-6)
    assert float(metrics["vpred_mean"]) == pytest.approx(sum(vpreds) / max(len(vpreds), 1), rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------------------------------------
# registry, metrics, errors
# ------------------------------------------------------------------------------------------------
def test_policy_loss_registry():
    assert losses.get_policy_loss_fn("vanilla") is losses.ppo_clip_loss
    assert losses.get_policy_loss_fn("gspo") is losses.gspo_loss
    assert losses.get_policy_loss_fn("clip_cov") is cov_losses.clip_cov_loss  # registered by its own module
    with pytest.raises(ValueError, match="actor.policy_loss.loss_mode: unknown value 'clip_kov'; known: cispo, clip_cov, "
                                         "dppo_kl, dppo_tv, dro, geo_mean, gpg, gspo, kl_cov, sapo, vanilla"):
        losses.get_policy_loss_fn("clip_kov")


@pytest.mark.parametrize("name, names", [("vanilla", "all"), ("gspo", "all"), ("cispo", "all"), ("sapo", "all"),
                                         ("dppo_tv", "all"), ("dppo_kl", "all"), ("geo_mean", "all"),
                                         ("dro", "ppo_kl"), ("gpg", "none")])
def test_policy_metrics_are_detached_scalars(name, names):
    """Each mode gives the metrics verl 0.9.1's function gives: all three, ppo_kl only (dro), none (gpg)."""
    logp = torch.randn(4, 5, requires_grad=True)
    extra = {"dro_beta": 0.1} if name == "dro" else {}
    loss, metrics = losses.get_policy_loss_fn(name)(logp, logp.detach() + 0.1, torch.randn(4, 5), torch.ones(4, 5),
                                                    **extra)
    assert loss.requires_grad
    assert set(metrics) == {"all": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}, "ppo_kl": {"ppo_kl"}, "none": set()}[names]
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad
    _, value_metrics = losses.value_loss(logp, logp.detach(), torch.zeros(4, 5), torch.ones(4, 5))
    assert all(v.dim() == 0 and not v.requires_grad for v in value_metrics.values())


def test_no_item_calls_in_algorithms():
    package = Path(grpo_npu.algo.__file__).parent
    offenders = [p.name for p in package.glob("*.py") if ".item()" in p.read_text()]
    assert offenders == []


def test_policy_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="actor.clip_ratio_c: expected > 1"):
        losses.ppo_clip_loss(x, x, x, x, clip_c=1.0)
    with pytest.raises(ValueError, match=r"equal \(B, T\) shapes"):
        losses.ppo_clip_loss(x, torch.zeros(2, 4), x, x)
    with pytest.raises(ValueError, match="clip_ratio_low/high"):
        losses.gspo_loss(x, x, x, x, clip_low=-0.1)
