"""Policy and value losses, and the policy-loss lookup (``get_policy_loss_fn``) over every registered mode.

Shapes: ``logp``, ``old_logp``, ``advantages``, ``values``, ``returns`` and ``mask`` are (B, T).
Losses return ``(loss, metrics)``: a 0-d float32 loss (float64 stays float64) and a dict of detached
0-d tensors, each a mean over this call's valid tokens (the caller averages them across
micro-batches). Nothing here reads a tensor back to Python (no ``item()``).
Formulas: docs/algorithms.md ("Policy losses", "Loss aggregation", "Value loss"). The aggregation
(``agg_loss``, ``agg_counts``, ``AGG_MODES``) lives in :mod:`grpo_npu.algo.loss_base`; callers take it from here.
"""

from __future__ import annotations

import torch

from grpo_npu.algo import cov_losses  # noqa: F401 (registers clip_cov and kl_cov)
from grpo_npu.algo.loss_base import (AGG_MODES, POLICY_LOSSES, PolicyLoss, agg_counts, agg_loss, check_policy_inputs,
                                     clamped_log_ratio, is_weighted, positive_count, register_policy_loss, zero)
from grpo_npu.algo.masked import acc_dtype, masked_mean, masked_values

# GSPO: the log of the sequence ratio is capped at 10 (ratio e^10 ~ 2.2e4) before exp(), with no floor,
# as verl 0.9.1's compute_policy_loss_gspo does; the cap also stops the gradient of a capped sequence.
GSPO_LOG_RATIO_MAX = 10.0


def get_policy_loss_fn(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (names.POLICY_LOSS_MODES)."""
    return POLICY_LOSSES.get(name)


@register_policy_loss("vanilla")
def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                  clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0, agg_mode: str = "token-mean",
                  rollout_is_weights: torch.Tensor | None = None,
                  **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and dual-clip for A < 0.

    ``rollout_is_weights`` (B, T), from :mod:`grpo_npu.algo.rollout_corr`, multiply the per-token losses
    before aggregation (verl's rollout correction). Metrics: pg_clipfrac (the clipped branch taken),
    pg_clipfrac_lower (the dual-clip branch taken), ppo_kl (mean of old_logp - logp, log ratio clamped).
    """
    check_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high, clip_c)
    dtype = acc_dtype(logp)
    adv = advantages.to(dtype)
    log_ratio = clamped_log_ratio(logp.to(dtype), old_logp)  # (B, T)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = -adv * clip_c  # caps the loss of A < 0 tokens whose ratio has grown very large
    negative = adv < 0
    per_token = torch.where(negative, torch.minimum(loss_ppo, loss_dual), loss_ppo)
    loss = agg_loss(is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(dtype), mask),
            "pg_clipfrac_lower": masked_mean((negative & (loss_dual < loss_ppo)).to(dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
    return loss, metrics


@register_policy_loss("gspo")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_low: float = 0.2, clip_high: float = 0.2, agg_mode: str = "seq-mean-token-mean",
              rollout_is_weights: torch.Tensor | None = None,
              **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the sequence ratio s_i = exp(token-mean log ratio), per token sg(s_i) * pi / sg(pi), clipped.

    As verl's compute_policy_loss_gspo: the token log ratios enter the sequence mean unclamped, the
    per-token log ratio log(s_i) is capped at GSPO_LOG_RATIO_MAX before exp(), and ppo_kl is the
    masked mean of the raw old_logp - logp. Published GSPO has no dual clip (actor.clip_ratio_c is not
    read), and pg_clipfrac_lower is 0. Pass the small GSPO clip ranges
    (e.g. 3e-4 / 4e-4); the default aggregation is verl's for GSPO, seq-mean-token-mean.
    ``rollout_is_weights`` as in :func:`ppo_clip_loss`.
    """
    check_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high)
    dtype = acc_dtype(logp)
    adv = advantages.to(dtype)
    logp = logp.to(dtype)
    token_log_ratio = logp - old_logp.to(dtype)  # (B, T), unclamped
    seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1).detach()  # (B,)
    # Value log(s_i) on every token; gradient d logp_t (the token's share of d log s_i), zero once capped.
    log_ratio = (logp - logp.detach() + seq_log_ratio.unsqueeze(-1)).clamp(max=GSPO_LOG_RATIO_MAX)  # (B, T)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    loss = agg_loss(is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(dtype), mask),
            "pg_clipfrac_lower": zero(loss),
            "ppo_kl": masked_mean(-token_log_ratio, mask),
        }
    return loss, metrics


# ------------------------------------------------------------------------------------------------
# verl 0.9.1's other loss modes: gpg (plain policy gradient), cispo (clipped IS weight on the log-prob
# gradient), sapo (a smooth gate in place of the clip), dro (a quadratic log-ratio penalty), dppo_tv /
# dppo_kl (a trust region on the probability itself), geo_mean (GMPO: the geometric mean of the token
# ratios). Each takes the settings names.POLICY_LOSS_READS lists and returns the metrics verl's function logs.
# ------------------------------------------------------------------------------------------------
# dppo_kl: the binary KL's log of (1 - p_old) / (1 - p) adds this to both sides (verl's 1e-8), so a token the
# policy is sure of (p = 1) stays finite.
DPPO_KL_EPS = 1e-8
# geo_mean: the per-response token means divide by (valid tokens + this), verl's 1e-8; an empty row gives 0.
GEO_MEAN_LEN_EPS = 1e-8
# geo_mean: log(w + this) of an IS weight w, verl's 1e-10, so that a zero weight stays finite.
GEO_MEAN_IS_EPS = 1e-10
# sapo: the loss is always the per-response token mean averaged over responses, as in verl 0.9.1.
SAPO_AGG_MODE = "seq-mean-token-mean"



@register_policy_loss("gpg")
def gpg_loss(logp, old_logp, advantages, mask, *, agg_mode: str = "token-mean", rollout_is_weights=None,
             **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG: the REINFORCE loss -A * logp, no ratio and no clip (old_logp is not read). No metrics, as in verl."""
    check_policy_inputs(logp, old_logp, advantages, mask, 0.0, 0.0)
    dtype = acc_dtype(logp)
    per_token = -advantages.to(dtype) * logp.to(dtype)
    return agg_loss(is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs), {}


@register_policy_loss("cispo")
def cispo_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
               agg_mode: str = "token-mean", rollout_is_weights=None,
               **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: -sg(clip(rho, 1 - clip_low, 1 + clip_high)) * A * logp; every token keeps a gradient, weighted by
    its clipped ratio. pg_clipfrac: tokens whose ratio the clip changed; pg_clipfrac_lower 0."""
    check_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high)
    dtype = acc_dtype(logp)
    logp = logp.to(dtype)
    log_ratio = clamped_log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * advantages.to(dtype) * logp
    loss = agg_loss(is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean((weight != ratio).to(dtype), mask), "pg_clipfrac_lower": zero(loss),
                   "ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


@register_policy_loss("sapo")
def sapo_loss(logp, old_logp, advantages, mask, *, tau_pos: float = 1.0, tau_neg: float = 1.05,
              agg_mode: str = SAPO_AGG_MODE, rollout_is_weights=None,
              **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: -A * g(rho) with the gate g(rho) = sigmoid(tau * (rho - 1)) * 4 / tau, tau = tau_pos where A > 0
    and tau_neg elsewhere; aggregated with SAPO_AGG_MODE whatever ``agg_mode`` says (verl's choice; the KL and
    entropy terms still follow actor.loss_agg_mode). At rho = 1 the gradient is the policy gradient's."""
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"actor_rollout_ref.actor.tau_pos / tau_neg: expected > 0, got {tau_pos} / {tau_neg}")
    check_policy_inputs(logp, old_logp, advantages, mask, 0.0, 0.0)
    dtype = acc_dtype(logp)
    adv = advantages.to(dtype)
    log_ratio = clamped_log_ratio(logp.to(dtype), old_logp)
    tau = torch.full_like(adv, tau_neg).masked_fill(adv > 0, tau_pos)  # (B, T)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss = agg_loss(is_weighted(-gate * adv, rollout_is_weights), mask, SAPO_AGG_MODE, **agg_kwargs)
    with torch.no_grad():
        metrics = {"pg_clipfrac": zero(loss), "pg_clipfrac_lower": zero(loss), "ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


@register_policy_loss("dro")
def dro_loss(logp, old_logp, advantages, mask, *, dro_beta: float | None = None, agg_mode: str = "token-mean",
             rollout_is_weights=None, **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO: -(A * logp - dro_beta / 2 * (logp - old_logp)^2), the log ratio unclamped. Metric: ppo_kl only."""
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta={dro_beta}: loss_mode=dro needs a value > 0")
    check_policy_inputs(logp, old_logp, advantages, mask, 0.0, 0.0)
    dtype = acc_dtype(logp)
    logp = logp.to(dtype)
    log_ratio = logp - old_logp.to(dtype)
    per_token = -(advantages.to(dtype) * logp - 0.5 * dro_beta * log_ratio.square())
    loss = agg_loss(is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


def _dppo_loss(logp, old_logp, advantages, mask, keep_of, *, clip_low: float, clip_high: float, clip_c: float,
               agg_mode: str, rollout_is_weights, agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO: -A * sg(min(rho, clip_c)) * logp on the tokens ``keep_of(logp, old_logp, A > 0)`` keeps inside the
    trust region, 0 elsewhere. pg_clipfrac: tokens outside it; pg_clipfrac_lower: kept tokens whose rho > clip_c."""
    check_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high, clip_c)
    dtype = acc_dtype(logp)
    adv, logp, old_logp = advantages.to(dtype), logp.to(dtype), old_logp.to(dtype)
    log_ratio = clamped_log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio).detach()
    with torch.no_grad():
        keep = keep_of(logp, old_logp, adv > 0).to(dtype)  # (B, T) 1 inside the region
    per_token = -adv * ratio.clamp(max=clip_c) * logp * keep
    loss = agg_loss(is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean(1.0 - keep, mask),
                   "pg_clipfrac_lower": masked_mean((ratio > clip_c).to(dtype) * keep, mask),
                   "ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


@register_policy_loss("dppo_tv")
def dppo_tv_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
                 clip_c: float = 3.0, agg_mode: str = "token-mean", rollout_is_weights=None,
                 **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV: a token stays while p - p_old <= clip_high (A > 0) or p - p_old >= -clip_low (A <= 0)."""
    def keep(logp, old_logp, positive):
        p, p_old = logp.exp(), old_logp.exp()
        return torch.where(positive, p - p_old <= clip_high, p - p_old >= -clip_low)

    return _dppo_loss(logp, old_logp, advantages, mask, keep, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
                      agg_mode=agg_mode, rollout_is_weights=rollout_is_weights, agg_kwargs=agg_kwargs)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
                 clip_c: float = 3.0, agg_mode: str = "token-mean", rollout_is_weights=None,
                 **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL: with d = KL(Bernoulli(p_old) || Bernoulli(p)), a token stays while d <= clip_high or
    p <= p_old (A > 0), or while d <= clip_low or p >= p_old (A <= 0)."""
    def keep(logp, old_logp, positive):  # the log term from the log-probs: exact where p_old underflows to 0
        p, p_old = logp.exp(), old_logp.exp()
        d = p_old * (old_logp - logp) + (1 - p_old) * torch.log((1 - p_old + DPPO_KL_EPS) / (1 - p + DPPO_KL_EPS))
        return torch.where(positive, (d <= clip_high) | (p <= p_old), (d <= clip_low) | (p >= p_old))

    return _dppo_loss(logp, old_logp, advantages, mask, keep, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
                      agg_mode=agg_mode, rollout_is_weights=rollout_is_weights, agg_kwargs=agg_kwargs)


@register_policy_loss("geo_mean")
def geo_mean_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
                  agg_mode: str = "token-mean", rollout_is_weights=None, num_seqs=None,
                  **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: per response, the geometric mean of the token ratios, each log ratio clipped to
    [-clip_low, clip_high] on the side the advantage's sign pessimises, times -(the mean advantage); the loss
    is the mean over responses (``num_seqs``: the global count; default this call's rows). ``agg_mode`` is
    not read (verl's choice). IS weights enter as their per-response geometric mean."""
    check_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high)
    dtype = acc_dtype(logp)
    adv, valid = advantages.to(dtype), mask.bool()
    log_ratio = logp.to(dtype) - old_logp.to(dtype)  # (B, T), unclamped as in verl
    clipped = log_ratio.clamp(-clip_low, clip_high)
    sign = torch.sign(adv)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)  # 0 where A = 0
    length = valid.sum(-1).to(dtype) + GEO_MEAN_LEN_EPS  # (B,)
    seq_ratio = torch.exp(masked_values(pessimistic, valid).sum(-1) / length)  # (B,); padding cannot leak in
    seq_adv = masked_values(adv, valid).sum(-1) / length
    per_seq = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach().to(dtype) + GEO_MEAN_IS_EPS)
        per_seq = per_seq * torch.exp(masked_values(log_w, valid).sum(-1) / length)
    loss = per_seq.sum() / positive_count(mask.shape[0] if num_seqs is None else num_seqs, dtype, per_seq.device)
    with torch.no_grad():
        changed = (log_ratio != clipped).to(dtype)
        metrics = {"pg_clipfrac": masked_mean(changed * (adv > 0), mask),
                   "pg_clipfrac_lower": masked_mean(changed * (adv < 0), mask),
                   "ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


# ------------------------------------------------------------------------------------------------
# Value loss (critic)
# ------------------------------------------------------------------------------------------------
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float = 0.5,
    agg_mode: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * agg(max((V - R)^2, (clip(V, V_old +- clip_range) - R)^2)) (critic.cliprange_value).

    Metrics: vf_clipfrac (the clipped branch taken), vpred_mean.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"value_loss: expected equal (B, T) shapes, got values {tuple(values.shape)}, old_values "
            f"{tuple(old_values.shape)}, returns {tuple(returns.shape)}, mask {tuple(mask.shape)}"
        )
    dtype = acc_dtype(values)
    values, old_values, returns = values.to(dtype), old_values.to(dtype), returns.to(dtype)
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(dtype), mask),
            "vpred_mean": masked_mean(values, mask),
        }
    return loss, metrics
