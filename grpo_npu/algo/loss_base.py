"""What every loss shares: aggregation over tokens and sequences, the policy-loss registry, and the input checks
and small pieces the policy losses of :mod:`grpo_npu.algo.losses` and :mod:`grpo_npu.algo.cov_losses` use.

Shapes: (B, T). Micro-batching and data parallelism: build each micro-batch's loss with the GLOBAL counts of its
mini-batch (``num_tokens`` / ``num_seqs`` summed over all micro-batches and ranks, see :func:`agg_counts`) and
sum the micro-batch losses (gradient accumulation). The result equals the loss of the whole mini-batch. Under data
parallelism, where the gradient is averaged over ranks, scale each rank's loss by the number of ranks.
"""

from __future__ import annotations

from typing import Callable

import torch

from grpo_npu.algo.masked import masked_values
from grpo_npu.algo.names import AGG_MODES, POLICY_LOSS_MODES
from grpo_npu.algo.registry import Registry

# log(pi / pi_old) is clamped before exp(): exp(20) ~ 5e8 keeps the ratio and its gradient finite
# in float32 and bfloat16 however far the policies have drifted apart.
LOG_RATIO_CLAMP = 20.0

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


def positive_count(count, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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
        return values.sum() / positive_count(num_tokens, dtype, device)
    if num_seqs is None:
        num_seqs = valid.any(-1).sum()
    per_seq = values.sum(-1)  # (B,) token sums, 0 for fully masked rows
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / valid.sum(-1).clamp(min=1).to(dtype)  # token means
    seq_mean = per_seq.sum() / positive_count(num_seqs, dtype, device)
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


def check_policy_inputs(logp, old_logp, advantages, mask, clip_low: float, clip_high: float,
                         clip_c: float | None = None) -> None:
    shapes = {"logp": logp.shape, "old_logp": old_logp.shape, "advantages": advantages.shape, "mask": mask.shape}
    if len(set(shapes.values())) != 1 or logp.dim() != 2:
        raise ValueError("policy loss: expected equal (B, T) shapes, got " + ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items()))
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"actor.clip_ratio_low/high: expected >= 0, got {clip_low} / {clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c: expected > 1, got {clip_c}")


def is_weighted(per_token: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token losses times the rollout-correction IS weights (detached, (B, T)); unchanged without weights."""
    if weights is None:
        return per_token
    if weights.shape != per_token.shape:
        raise ValueError(f"rollout_is_weights {tuple(weights.shape)}: expected the loss's (B, T) {tuple(per_token.shape)}")
    return per_token * weights.detach().to(per_token.dtype)


def clamped_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """(B, T) log(pi / pi_old), clamped to +-LOG_RATIO_CLAMP so that exp() stays finite."""
    return (logp - old_logp.to(logp.dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)
