"""The covariance-targeted policy losses Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", arXiv:2505.22617), as verl 0.9.1's
``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``.

Both pick, in each micro-batch, the few tokens whose centred covariance cov_t = (A_t - mean A) (logp_t - mean logp)
(means over the valid tokens) is large: those tokens drive the entropy collapse. Clip-Cov takes their gradient
away; KL-Cov adds a |log ratio| penalty on them. Shapes (B, T); signatures as :func:`grpo_npu.algo.losses.ppo_clip_loss`.
"""

from __future__ import annotations

import torch

from grpo_npu.algo.loss_base import agg_loss, check_policy_inputs, is_weighted, register_policy_loss
from grpo_npu.algo.masked import acc_dtype, masked_mean

# Clip-Cov seeds its draw among the candidate tokens with the micro-batch's content, taken modulo this (a valid seed).
_SEED_MODULUS = 2**31 - 1


def _centred_covariance(advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) (A - mean A) (logp - mean logp), the means over the valid tokens; detached."""
    adv, lp = advantages.detach(), logp.detach()
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


def _draw(count: int, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A permutation of ``count`` candidates from a generator seeded by the micro-batch itself (its token count and
    advantages): the same micro-batch picks the same tokens, in a run and in its resumption (verl draws from the
    global RNG)."""
    content = int(mask.bool().sum()) * 1_000_003 + int(advantages.detach().abs().sum().double() * 1e6)
    generator = torch.Generator().manual_seed(content % _SEED_MODULUS)
    return torch.randperm(count, generator=generator)


@register_policy_loss("clip_cov")
def clip_cov_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
                  clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                  agg_mode: str = "token-mean", rollout_is_weights=None,
                  **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO's clipped loss, except that max(1, clip_cov_ratio x valid tokens) tokens drawn at random among
    those PPO's clip did not already bind and whose cov_t lies in (clip_cov_lb, clip_cov_ub) get no loss and no
    gradient. The log ratio is not clamped (verl's). Metrics: pg_clipfrac (the tokens taken out), ppo_kl."""
    check_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high)
    if not clip_cov_ratio > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.clip_cov_ratio={clip_cov_ratio}: expected > 0")
    dtype = acc_dtype(logp)
    adv, valid = advantages.to(dtype), mask.bool()
    log_ratio = logp.to(dtype) - old_logp.to(dtype)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    cov = _centred_covariance(adv, logp.to(dtype), mask)
    bound_by_clip = (loss_clipped > loss_unclipped) & valid
    candidates = torch.nonzero((cov > clip_cov_lb) & (cov < clip_cov_ub) & valid & ~bound_by_clip)  # (K, 2)
    keep = torch.ones_like(adv)
    if len(candidates):
        share = max(int(clip_cov_ratio * int(valid.sum())), 1)
        chosen = candidates[_draw(len(candidates), adv, mask).to(candidates.device)[:share]]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    per_token = torch.maximum(loss_unclipped, loss_clipped) * keep
    loss = agg_loss(is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean((keep == 0).to(dtype), mask), "ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


@register_policy_loss("kl_cov")
def kl_cov_loss(logp, old_logp, advantages, mask, *, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 0.1,
                agg_mode: str = "token-mean", rollout_is_weights=None,
                **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped policy-gradient loss -A rho, plus ppo_kl_coef |log rho| on the max(1, kl_cov_ratio x
    valid tokens) tokens of largest cov_t (no clipping anywhere, verl's). Metric: ppo_kl = mean |log rho|."""
    check_policy_inputs(logp, old_logp, advantages, mask, 0.0, 0.0)
    if not kl_cov_ratio > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio={kl_cov_ratio}: expected > 0")
    dtype = acc_dtype(logp)
    adv, valid = advantages.to(dtype), mask.bool()
    log_ratio = logp.to(dtype) - old_logp.to(dtype)
    per_token = -adv * torch.exp(log_ratio)
    if valid.any():
        cov = _centred_covariance(adv, logp.to(dtype), mask)[valid]  # (N,) in row-major order, as verl's
        top = torch.topk(cov, max(1, int(cov.numel() * kl_cov_ratio))).indices
        penalised = torch.zeros(cov.numel(), dtype=dtype, device=cov.device).index_fill_(0, top, 1.0)
        flag = torch.zeros_like(adv).masked_scatter(valid, penalised)  # (B, T) 1 on the chosen tokens
        per_token = per_token + ppo_kl_coef * log_ratio.abs() * flag
    loss = agg_loss(is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(log_ratio.abs(), mask)}
    return loss, metrics
