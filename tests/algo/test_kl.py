"""KL estimators, controllers and KL-in-reward against per-token Python references."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_npu.algo import kl


def ref_kl_token(logp: float, ref_logp: float, kind: str) -> float:
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    k = min(max(ref_logp - logp, -20.0), 20.0)
    return min(max(math.exp(k) - k - 1.0, -10.0), 10.0)


def _log_probs(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=gen) * 5
    ref = logp + torch.randn(shape, generator=gen) * 0.5
    flat = ref.view(-1)
    flat[::5] = logp.view(-1)[::5] + 30.0  # |d| > 20: the k3 clamps
    flat[1::7] = logp.view(-1)[1::7] - 25.0
    return logp.to(dtype), ref.to(dtype)


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
@pytest.mark.parametrize("shape", [(1, 1), (4, 9), (13, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_penalty_matches_reference(kind, shape, dtype):
    logp, ref = _log_probs(shape, sum(shape), dtype)
    got = kl.kl_penalty(logp, ref, kind)
    expected = torch.tensor(
        [[ref_kl_token(float(logp[i, t]), float(ref[i, t]), kind) for t in range(shape[1])] for i in range(shape[0])],
        dtype=torch.float64,
    )
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"])
def test_plus_estimators_keep_the_value_and_take_k2s_gradient(kind):
    """verl's straight-through "+" forms: the base estimator's value, and d(0.5 d^2)/d logp = d as the gradient."""
    logp, ref = _log_probs((6, 5), 3, torch.float32)
    logp.requires_grad_(True)
    got = kl.kl_penalty(logp, ref, kind)
    torch.testing.assert_close(got.detach(), kl.kl_penalty(logp.detach(), ref, kind[:-1]), rtol=0, atol=0)
    weights = torch.rand(6, 5, generator=torch.Generator().manual_seed(1))
    (got * weights).sum().backward()
    torch.testing.assert_close(logp.grad, weights * (logp - ref).detach(), rtol=1e-6, atol=1e-6)


def test_k3_gradient_is_finite_at_extremes():
    logp = torch.tensor([[0.0, -40.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-40.0, 0.0, -1.0]])
    kl.kl_penalty(logp, ref, "low_var_kl").sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_full_and_unknown_kinds_are_clear_errors():
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="'full' needs the full vocabulary"):
        kl.kl_penalty(x, x, "full")
    with pytest.raises(ValueError, match=r"unknown value 'k4'; known: abs, abs\+, k1, k1\+, k2, k2\+, k3, k3\+, kl, kl\+, low_var_kl, low_var_kl\+, mse, mse\+"):
        kl.kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="equal shapes"):
        kl.kl_penalty(x, torch.zeros(2, 3), "kl")


def test_fixed_controller_does_not_move():
    ctrl = kl.make_kl_controller("fixed", kl_coef=0.05)
    ctrl.update(current_kl=10.0, n_steps=64)
    assert ctrl.value == 0.05


def test_adaptive_controller_follows_the_proportional_rule():
    ctrl = kl.make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.02, horizon=1000)
    expected = 0.1
    for current_kl, n_steps in [(0.03, 64), (0.5, 64), (0.0, 128), (0.019, 32), (0.02, 8)]:
        ctrl.update(torch.tensor(current_kl, dtype=torch.float64), n_steps)
        error = current_kl / 0.02 - 1.0
        error = 0.2 if error > 0.2 else (-0.2 if error < -0.2 else error)
        expected = expected * (1.0 + error * n_steps / 1000)
        assert ctrl.value == pytest.approx(expected, rel=1e-12)
    restored = kl.AdaptiveKLController(0.1, 0.02, 1000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_controller_config_errors():
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type.*'pid'"):
        kl.make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.horizon"):
        kl.make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.target_kl"):
        kl.make_kl_controller("adaptive", kl_coef=0.1, target_kl=None, horizon=10)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
@pytest.mark.parametrize("seed", [0, 1])
def test_apply_kl_in_reward_matches_reference(batch_kit, kind, seed):
    random_mask, _ = batch_kit
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(9, 6, gen)
    scores = torch.randn(9, 6, generator=gen)
    logp, ref = _log_probs((9, 6), seed, torch.float32)
    ctrl = kl.FixedKLController(0.3)
    rewards, metrics = kl.apply_kl_in_reward(scores, logp, ref, mask, ctrl, kind)

    expected = scores.double().clone()
    row_means = []
    for i in range(9):
        row = [ref_kl_token(float(logp[i, t]), float(ref[i, t]), kind) for t in range(6) if mask[i, t]]
        for t in range(6):
            if mask[i, t]:
                expected[i, t] -= 0.3 * ref_kl_token(float(logp[i, t]), float(ref[i, t]), kind)
        if row:
            row_means.append(sum(row) / len(row))
    torch.testing.assert_close(rewards.double(), expected, rtol=1e-5, atol=1e-5)
    assert set(metrics) == {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"}
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad
    assert float(metrics["actor/reward_kl_penalty"]) == pytest.approx(sum(row_means) / len(row_means), rel=1e-5)
    assert float(metrics["actor/reward_kl_penalty_coeff"]) == pytest.approx(0.3)
