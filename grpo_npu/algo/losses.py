"""Policy / value losses and loss aggregation.

Shapes: ``logp``, ``old_logp``, ``advantages``, ``values``, ``returns`` and ``mask`` are (B, T).
Losses return ``(loss, metrics)``: a 0-d float32 loss (float64 stays float64) and a dict of detached
0-d tensors, each a mean over this call's valid tokens (the caller averages them across
micro-batches). Nothing here reads a tensor back to Python (no ``item()``).
Formulas: docs/algorithms.md ("Policy losses", "Loss aggregation", "Value loss").

Micro-batching and data parallelism: build each micro-batch's loss with the GLOBAL counts of its
mini-batch (``num_tokens`` / ``num_seqs`` summed over all micro-batches and ranks, see
:func:`agg_counts`) and sum the micro-batch losses (gradient accumulation). The result equals the
loss of the whole mini-batch. Under data parallelism, where the gradient is averaged over ranks,
scale each rank's loss by the number of ranks.
"""

from __future__ import annotations

from typing import Callable

import torch

from grpo_npu.algo.masked import acc_dtype, masked_mean, masked_values
from grpo_npu.algo.names import AGG_MODES, POLICY_LOSS_MODES
from grpo_npu.algo.registry import Registry

# log(pi / pi_old) is clamped before exp(): exp(20) ~ 5e8 keeps the ratio and its gradient finite
# in float32 and bfloat16 however far the policies have drifted apart.
LOG_RATIO_CLAMP = 20.0

# GSPO: the log of the sequence ratio is capped at 10 (ratio e^10 ~ 2.2e4) before exp(), with no floor,
# as verl 0.9.1's compute_policy_loss_gspo does; the cap also stops the gradient of a capped sequence.
GSPO_LOG_RATIO_MAX = 10.0


# ------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------
def agg_counts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (num_tokens, num_seqs) of a (B, T) mask as 0-d int64 tensors; sum them to get global counts.

    num_seqs counts every row, a fully masked one (all its tokens rejected by rollout correction) included:
    verl 0.9.1 divides the ``seq-mean-*`` modes by its global_batch_size, ppo_mini_batch_size x n rows.
    """
    valid = mask.bool()
    return valid.sum(), torch.tensor(valid.shape[0], dtype=torch.int64, device=valid.device)


def _positive(count, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A count (int, float or tensor) as a 0-d tensor, at least 1 so that an empty batch gives loss 0."""
    return torch.as_tensor(count, device=device).to(dtype).clamp(min=1)


def agg_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens=None,
    num_seqs=None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) loss to a scalar with ``actor.loss_agg_mode`` ``mode``.

    token-mean:              sum(loss) / num_tokens
    token-sum:               sum(loss)
    seq-mean-token-sum:      sum_i sum_t(loss) / num_seqs
    seq-mean-token-mean:     sum_i (sum_t(loss) / len_i) / num_seqs
    seq-mean-token-sum-norm: sum(loss) / (num_seqs * horizon)
    Sums run over valid tokens. num_tokens / num_seqs are the global counts of the mini-batch (agg_counts: every
    row is a sequence); without them this call's own counts, where only rows with a valid token are sequences
    (verl's agg_loss without global_batch_size);
    horizon is data.max_response_length (default: the mask width T).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode: unknown value {mode!r}; known: {', '.join(AGG_MODES)}")
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"loss and mask: expected equal (B, T) shapes, got {tuple(loss.shape)} and {tuple(mask.shape)}")
    valid = mask.bool()
    values = masked_values(loss, valid)  # (B, T)
    dtype, device = values.dtype, values.device
    if mode == "token-sum":
        return values.sum()
    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = valid.sum()
        return values.sum() / _positive(num_tokens, dtype, device)
    if num_seqs is None:
        num_seqs = valid.any(-1).sum()
    per_seq = values.sum(-1)  # (B,) token sums, 0 for fully masked rows
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / valid.sum(-1).clamp(min=1).to(dtype)  # token means
    seq_mean = per_seq.sum() / _positive(num_seqs, dtype, device)
    if mode != "seq-mean-token-sum-norm":
        return seq_mean
    horizon = loss.shape[-1] if horizon is None else horizon
    if horizon <= 0:
        raise ValueError(f"horizon (data.max_response_length): expected > 0, got {horizon}")
    return seq_mean / horizon  # divided after the sequence mean, in verl's order (same float rounding)


# ------------------------------------------------------------------------------------------------
# Policy losses (actor.policy_loss.loss_mode)
# ------------------------------------------------------------------------------------------------
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("actor.policy_loss.loss_mode", POLICY_LOSS_MODES)


def register_policy_loss(name: str):
    """Decorator registering a policy loss with the ppo_clip_loss signature under ``name``."""
    return POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (vanilla | gspo)."""
    return POLICY_LOSSES.get(name)


def _check_policy_inputs(logp, old_logp, advantages, mask, clip_low: float, clip_high: float) -> None:
    shapes = {"logp": logp.shape, "old_logp": old_logp.shape, "advantages": advantages.shape, "mask": mask.shape}
    if len(set(shapes.values())) != 1 or logp.dim() != 2:
        raise ValueError("policy loss: expected equal (B, T) shapes, got " + ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items()))
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"actor.clip_ratio_low/high: expected >= 0, got {clip_low} / {clip_high}")


def _is_weighted(per_token: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token losses times the rollout-correction IS weights (detached, (B, T)); unchanged without weights."""
    if weights is None:
        return per_token
    if weights.shape != per_token.shape:
        raise ValueError(f"rollout_is_weights {tuple(weights.shape)}: expected the loss's (B, T) {tuple(per_token.shape)}")
    return per_token * weights.detach().to(per_token.dtype)


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
    _check_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high)
    if clip_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c: expected > 1, got {clip_c}")
    dtype = acc_dtype(logp)
    adv = advantages.to(dtype)
    log_ratio = (logp.to(dtype) - old_logp.to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = -adv * clip_c  # caps the loss of A < 0 tokens whose ratio has grown very large
    negative = adv < 0
    per_token = torch.where(negative, torch.minimum(loss_ppo, loss_dual), loss_ppo)
    loss = agg_loss(_is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(dtype), mask),
            "pg_clipfrac_lower": masked_mean((negative & (loss_dual < loss_ppo)).to(dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
    return loss, metrics


@register_policy_loss("gspo")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0, agg_mode: str = "seq-mean-token-mean",
              rollout_is_weights: torch.Tensor | None = None,
              **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the sequence ratio s_i = exp(token-mean log ratio), per token sg(s_i) * pi / sg(pi), clipped.

    As verl's compute_policy_loss_gspo: the token log ratios enter the sequence mean unclamped, the
    per-token log ratio log(s_i) is capped at GSPO_LOG_RATIO_MAX before exp(), and ppo_kl is the
    masked mean of the raw old_logp - logp. Published GSPO has no dual clip: ``clip_c`` is accepted
    for the common signature and unused, and pg_clipfrac_lower is 0. Pass the small GSPO clip ranges
    (e.g. 3e-4 / 4e-4); the default aggregation is verl's for GSPO, seq-mean-token-mean.
    ``rollout_is_weights`` as in :func:`ppo_clip_loss`.
    """
    _check_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high)
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
    loss = agg_loss(_is_weighted(per_token, rollout_is_weights), mask, agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(dtype), mask),
            "pg_clipfrac_lower": torch.zeros((), dtype=dtype, device=logp.device),
            "ppo_kl": masked_mean(-token_log_ratio, mask),
        }
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
