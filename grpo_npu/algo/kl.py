"""Token-level KL estimators, KL controllers and the KL-in-reward penalty.

Shapes: ``logp`` / ``ref_logp`` / ``mask`` are (B, T); d = logp - ref_logp. Estimator names are
those of verl's ``actor.kl_loss_type`` and ``algorithm.kl_penalty``; controllers follow
``algorithm.kl_ctrl.{type, kl_coef, target_kl, horizon}``. Formulas: docs/algorithms.md ("KL").
Results are float32 (float64 input stays float64).
"""

from __future__ import annotations

from typing import Callable

import torch

from grpo_npu.algo.masked import acc_dtype, masked_mean
from grpo_npu.algo.names import KL_CTRL_TYPES, KL_TYPES
from grpo_npu.algo.registry import Registry

# low_var_kl (k3): the log ratio is clamped before exp() so the estimate stays finite, and the estimate
# itself is clamped, as in verl, so one wildly off-policy token cannot dominate the KL term.
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0

# Adaptive controller: the proportional error is clipped to +-0.2 (Ziegler et al. 2019, verl).
ADAPTIVE_ERROR_CLIP = 0.2

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("algorithm.kl_penalty / actor.kl_loss_type", KL_TYPES)


@KL_ESTIMATORS.register("kl", "k1")
def _kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """d: unbiased, high variance."""
    return logp - ref_logp


@KL_ESTIMATORS.register("abs")
def _kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|d|."""
    return (logp - ref_logp).abs()


@KL_ESTIMATORS.register("mse", "k2")
def _kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """0.5 * d^2."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def _kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(k) - k - 1 with k = ref_logp - logp (Schulman's k3), clamped."""
    k = (ref_logp - logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(k) - k - 1).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def _k2_gradient(forward: KLEstimator) -> KLEstimator:
    """verl's "+" estimators: the value of ``forward``, the gradient of k2 (0.5 d^2, whose gradient is the KL's in
    expectation where k1's and k3's are not), by the straight-through trick."""

    def estimator(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        k2 = _kl_k2(logp, ref_logp)
        return k2 - k2.detach() + forward(logp, ref_logp).detach()

    return estimator


KL_ESTIMATORS.register("kl+", "k1+")(_k2_gradient(_kl_k1))
KL_ESTIMATORS.register("abs+")(_k2_gradient(_kl_abs))
KL_ESTIMATORS.register("low_var_kl+", "k3+")(_k2_gradient(_kl_k3))
KL_ESTIMATORS.register("mse+", "k2+")(_kl_k2)  # k2 already has k2's gradient


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (B, T) of estimator ``kind`` (kl|k1|abs|mse|k2|low_var_kl|k3, each also with "+")."""
    if kind == "full":
        raise ValueError(
            "kl_penalty='full' needs the full vocabulary distributions, not token log-probs; "
            f"use one of: {', '.join(KL_ESTIMATORS.names())}"
        )
    estimator = KL_ESTIMATORS.get(kind)
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp and ref_logp: expected equal shapes, got {tuple(logp.shape)} and {tuple(ref_logp.shape)}")
    dtype = acc_dtype(logp)
    return estimator(logp.to(dtype), ref_logp.to(dtype))


# ------------------------------------------------------------------------------------------------
# Controllers: the KL-in-reward coefficient beta (algorithm.kl_ctrl)
# ------------------------------------------------------------------------------------------------
class FixedKLController:
    """beta = algorithm.kl_ctrl.kl_coef, constant."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient does not move."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """beta *= 1 + clip(kl / target_kl - 1, +-0.2) * n_steps / horizon after each batch (Ziegler et al.)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl is None or target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl: expected > 0 for the adaptive controller, got {target_kl}")
        if horizon is None or horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon: expected > 0 for the adaptive controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards the target KL; ``current_kl`` is the batch-mean KL, ``n_steps`` the batch size."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    kind: str, *, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> KLController:
    """The controller of ``algorithm.kl_ctrl.type`` (fixed | adaptive)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"algorithm.kl_ctrl.type: unknown value {kind!r}; known: {', '.join(sorted(KL_CTRL_TYPES))}")


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_ctrl: KLController,
    kind: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """r_t = score_t - beta * kl_t on valid tokens (algorithm.use_kl_in_reward).

    Returns the (B, T) rewards and detached 0-d metrics: ``actor/reward_kl_penalty`` (the mean over
    responses of each response's token-mean KL; fully masked rows are left out) and
    ``actor/reward_kl_penalty_coeff`` (beta). The caller updates the controller once per batch:
    ``kl_ctrl.update(float(metrics["actor/reward_kl_penalty"]), n_steps=B)``.
    """
    if token_level_scores.shape != mask.shape:
        raise ValueError(
            f"token_level_scores and mask: expected equal shapes, got {tuple(token_level_scores.shape)} and {tuple(mask.shape)}"
        )
    valid = mask.bool()
    kld = kl_penalty(logp, ref_logp, kind)  # (B, T)
    kld = torch.where(valid, kld, torch.zeros((), dtype=kld.dtype, device=kld.device))
    beta = kl_ctrl.value
    rewards = token_level_scores.to(kld.dtype) - beta * kld
    row_has_tokens = valid.any(-1)  # (B,)
    per_row_kl = masked_mean(kld, valid, dim=-1)  # (B,)
    batch_kl = masked_mean(per_row_kl, row_has_tokens)
    metrics = {
        "actor/reward_kl_penalty": batch_kl.detach(),
        "actor/reward_kl_penalty_coeff": torch.tensor(beta, dtype=kld.dtype, device=kld.device),
    }
    return rewards, metrics
