"""Rollout correction (verl's ``algorithm.rollout_correction``): the rollout engine's policy is not the actor's.

The engine samples with pi_rollout (another kernel, dtype or a stale weight); the loss assumes pi_old (the
actor's old log-probs). With the log ratio log r = old_logp - rollout_logp per response token:

- truncated importance sampling (``rollout_is``): weights w = min(r, threshold) per token (``token``) or
  w = min(prod_t r_t, threshold) per sequence (``sequence``), optionally divided by their batch mean;
  the policy loss multiplies its per-token terms by w before aggregation;
- rejection sampling (``rollout_rs``): tokens (``token_*``) or whole sequences (``seq_*``) whose
  divergence estimate lies outside the thresholds leave the loss mask;
- off-policy metrics (KL, perplexities, chi^2 between the two policies) on every step that has both
  log-probs.

Shapes: ``old_logp``, ``rollout_logp`` and ``mask`` are (B, T). As verl's ``rollout_corr_helper``: the same
formulas, thresholds and ``rollout_corr/*`` metric names, so a verl dashboard reads these runs.
Formulas: docs/algorithms.md ("Rollout correction").
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from grpo_npu.algo.losses import gpg_loss, ppo_clip_loss
from grpo_npu.algo.masked import acc_dtype, masked_mean, masked_sum
from grpo_npu.algo.names import ROLLOUT_IS_LEVELS, parse_rollout_is_threshold, parse_rollout_rs
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import RolloutCorrectionConfig

# log r is clamped to +-20 before exp() (exp(20) ~ 4.9e8), as verl's SAFETY_BOUND.
SAFETY_BOUND = 20.0

RsOptions = tuple[tuple[str, Optional[float], float], ...]  # (option, lower, upper) from names.parse_rollout_rs
SumsFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (sum, count) over ranks


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(~valid, float("-inf")).max()


def _masked_min(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(~valid, float("inf")).min()


def _clamped_std(x: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """sqrt(E[c^2] - E[c]^2) of c = clamp(x, low, high) over valid tokens; 0 with fewer than two tokens."""
    if mask.bool().sum() <= 1:
        return x.new_zeros(())
    c = x.clamp(min=low, max=high)
    return (masked_mean(c.square(), mask) - masked_mean(c, mask).square()).clamp(min=0).sqrt()


def _seq_summary(prefix: str, seq: torch.Tensor, high: float, low: float | None, ideal: float,
                 raw: torch.Tensor | None = None) -> dict:
    """``<prefix>_seq_{mean,std,max,min,max_deviation,fraction_high[,fraction_low]}`` of per-sequence values;
    the fractions count ``raw`` (default ``seq``) beyond the bounds."""
    raw = seq if raw is None else raw
    n = seq.numel()
    zero = seq.new_zeros(())
    out = {
        f"{prefix}_seq_mean": seq.mean() if n else zero,
        f"{prefix}_seq_std": seq.std() if n > 1 else zero,
        f"{prefix}_seq_max": seq.max() if n else zero,
        f"{prefix}_seq_min": seq.min() if n else zero,
        f"{prefix}_seq_max_deviation": (seq - ideal).abs().max() if n else zero,
        f"{prefix}_seq_fraction_high": (raw > high).float().mean() if n else zero,
    }
    if low is not None:
        out[f"{prefix}_seq_fraction_low"] = (raw < low).float().mean() if n else zero
    return out


# ------------------------------------------------------------------------------------------------
# Truncated importance sampling (rollout_is)
# ------------------------------------------------------------------------------------------------
def rollout_is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float, batch_normalize: bool = False,
    lower: float | None = None, all_reduce: SumsFn | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IS weights (B, T), 0 off the mask, detached; metrics ``rollout_is_*`` (0-d tensors).

    token:    w_t = exp(clamp(log r_t))
    sequence: w_t = exp(clamp(sum_t log r_t)) on every token of the sequence
    applied:  min(w, threshold) (TIS), or with ``lower`` w where lower <= w <= threshold and 0 elsewhere (IcePop)
    batch_normalize divides by the batch mean of the applied weights (over tokens, or over sequences for
    ``sequence``); ``all_reduce`` sums that mean's numerator and count over ranks (verl's distributed_masked_mean,
    in bypass mode). Metrics as verl 0.9.1's compute_is_metrics: mean, std, effective sample size, the token max /
    min and the per-sequence mean weights describe the applied weights (before batch normalisation); the fractions
    beyond the bounds (the lower one 1 / threshold for TIS) count the raw weights (token), the raw per-sequence
    means (``_seq_fraction_*``) or the summed log-ratios (sequence), and the sequence-level max / min come from
    the summed log-ratios; IcePop adds ``rollout_is_oob_ratio``, the share of tokens whose weight left the bounds.
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is: unknown value {level!r}; "
                         f"known: {', '.join(ROLLOUT_IS_LEVELS)}")
    if not threshold > 0 or (lower is not None and not 0 < lower <= threshold):
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold: bounds {lower} and {threshold}: "
                         "expected 0 < lower <= upper")
    log_ratio = log_ratio.to(acc_dtype(log_ratio))
    valid = mask.bool()
    m = valid.to(log_ratio.dtype)
    if level == "token":
        log_w = log_ratio  # (B, T)
        weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_w = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)  # (B, 1)
        weights = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * m  # raw
    if lower is None:
        applied = weights.clamp(max=threshold)
        low = 1.0 / threshold
    else:
        applied = torch.where((weights >= lower) & (weights <= threshold), weights, torch.zeros_like(weights))
        low = lower
    metrics: dict[str, torch.Tensor] = {"rollout_is_mean": masked_mean(applied, mask)}
    if level == "sequence":
        metrics["rollout_is_max"] = torch.exp(log_w.max().clamp(max=SAFETY_BOUND))
        metrics["rollout_is_min"] = torch.exp(log_w.min())
        metrics["rollout_is_ratio_fraction_high"] = (log_w > math.log(threshold)).float().mean()
        metrics["rollout_is_ratio_fraction_low"] = (log_w < math.log(low)).float().mean()
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((weights > threshold).float(), mask)
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((weights < low).float(), mask)
        metrics["rollout_is_max"] = _masked_max(applied, valid)
        metrics["rollout_is_min"] = _masked_min(applied, valid)
    metrics["rollout_is_std"] = _clamped_std(applied, mask, 0.0, threshold)
    w_ess = applied / (masked_mean(applied, mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(w_ess.square(), mask)
    seq_w = masked_mean(applied, mask, dim=-1)  # (B,)
    metrics.update(_seq_summary("rollout_is", seq_w, threshold, low, ideal=1.0, raw=masked_mean(weights, mask, dim=-1)))
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((weights < lower) | (weights > threshold)).float(), mask)

    weights = applied.detach()
    if batch_normalize:
        if level == "token":
            total, count = (weights * m).sum(), m.sum()
        else:
            has_tokens = valid.any(-1)  # one weight per sequence
            total, count = masked_mean(weights, mask, dim=-1)[has_tokens].sum(), has_tokens.sum().to(weights.dtype)
        if all_reduce is not None:
            total, count = all_reduce(total, count)
        mean = total / count.clamp(min=1)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean
        else:
            metrics["rollout_is_batch_norm_factor"] = weights.new_ones(())
    return weights, metrics


# ------------------------------------------------------------------------------------------------
# Rejection sampling (rollout_rs)
# ------------------------------------------------------------------------------------------------
def _option_stat(option: str, k: dict[str, torch.Tensor], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token statistic (B, T), per-sequence statistic (B,) or None for token options)."""
    level, _, estimator = option.rpartition("_")
    x = k[estimator]
    if level == "token":
        return x, None
    if level == "seq_sum":
        seq = masked_sum(x, mask, dim=-1)
    elif level == "seq_mean":
        seq = masked_mean(x, mask, dim=-1)
    else:  # seq_max: 0 for a sequence without tokens
        seq = x.masked_fill(~mask.bool(), float("-inf")).max(-1).values
        seq = torch.where(torch.isinf(seq), torch.zeros_like(seq), seq)
    return seq.unsqueeze(-1).expand_as(x), seq


def rollout_rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, options: RsOptions,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss mask (B, T) after rejection: ``mask`` minus every token an option rejects; metrics ``rollout_rs_*``.

    Per token k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(log r) - 1 - log r (log r clamped to +-20); a
    ``token_*`` option tests each token, ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*`` the sum / mean /
    maximum over the sequence and keep or reject it whole. k1 keeps log(lower) <= stat <= log(upper),
    k2 / k3 keep stat <= upper. A token stays when every option keeps it. ``options`` come from
    :func:`grpo_npu.algo.names.parse_rollout_rs`.
    """
    log_ratio = log_ratio.to(acc_dtype(log_ratio))
    valid = mask.bool()
    seq_valid = valid.any(-1)  # (B,)
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
    keep_all = torch.ones_like(log_ratio)
    metrics: dict[str, torch.Tensor] = {}
    for option, lower, upper in options:
        stat, seq_stat = _option_stat(option, k, mask)
        k1 = option.endswith("k1")
        high = math.log(upper) if k1 else upper
        low = math.log(lower) if k1 else 0.0
        keep = (stat >= low) & (stat <= high) if k1 else stat <= high  # (B, T)
        keep_f = keep.to(log_ratio.dtype)
        keep_all = keep_all * keep_f
        metrics.update(_rs_metrics(f"rollout_rs_{option}", stat, seq_stat, mask, high, low if k1 else None))
        seq_keep = (keep | ~valid).all(-1)  # (B,)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1.0 - keep_f, mask)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            (~seq_keep & seq_valid).float().sum() / seq_valid.sum() if seq_valid.any() else log_ratio.new_zeros(()))
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - keep_all, mask)
    metrics["rollout_rs_seq_masked_fraction"] = ((keep_all < 0.5) & valid).any(-1).float().mean()
    return (mask * keep_all).to(mask.dtype), metrics


def _rs_metrics(prefix: str, stat: torch.Tensor, seq_stat: torch.Tensor | None, mask: torch.Tensor,
                high: float, low: float | None) -> dict[str, torch.Tensor]:
    """verl's compute_rs_metrics: ``low`` None for options without a lower bound (k2 / k3)."""
    valid = mask.bool()
    seq_valid = valid.any(-1)
    seq = (seq_stat if seq_stat is not None else masked_mean(stat, mask, dim=-1))[seq_valid]
    by_seq = seq_stat is not None and seq.numel() > 0
    out = {f"{prefix}_mean": masked_mean(stat, mask)}
    out[f"{prefix}_max"] = seq.max() if by_seq else _masked_max(stat, valid)
    out[f"{prefix}_min"] = seq.min() if by_seq else _masked_min(stat, valid)
    zero = stat.new_zeros(())
    if by_seq:
        out[f"{prefix}_fraction_high"] = (seq > high).float().mean()
        out[f"{prefix}_fraction_low"] = (seq < low).float().mean() if low is not None else zero
    else:
        out[f"{prefix}_fraction_high"] = masked_mean((stat > high).float(), mask)
        out[f"{prefix}_fraction_low"] = masked_mean((stat < low).float(), mask) if low is not None else zero
    out[f"{prefix}_std"] = _clamped_std(stat, mask, low if low is not None else 0.0, high)
    summary = _seq_summary(prefix, seq, high, low, ideal=0.0)
    if not seq.numel():
        summary[f"{prefix}_seq_fraction_low"] = zero
    out.update(summary)
    return out


# ------------------------------------------------------------------------------------------------
# Off-policy metrics
# ------------------------------------------------------------------------------------------------
def offpolicy_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL, perplexities and chi^2 between the actor (training) and rollout policies (verl's compute_offpolicy_metrics).

    kl = E[rollout_logp - old_logp]; k3_kl = E[r - log r - 1]; *_ppl = batch mean of exp(-token-mean logp)
    per sequence; log_ppl_diff = rollout minus training token-mean logp per sequence; chi2_token = E[r^2] - 1,
    chi2_seq = E_seq[(prod_t r_t)^2] - 1 (log r clamped to +-20 for the chi^2 terms).
    """
    dtype = acc_dtype(old_logp)
    old, roll = old_logp.to(dtype), rollout_logp.to(dtype)
    log_ratio = old - roll
    mean_old = masked_mean(old, mask, dim=-1)  # (B,)
    mean_roll = masked_mean(roll, mask, dim=-1)
    log_ppl_diff = mean_roll - mean_old
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-mean_old).mean(),
        "training_log_ppl": (-mean_old).mean(),
        "kl": masked_mean(roll - old, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": torch.exp(-mean_roll).mean(),
        "rollout_log_ppl": (-mean_roll).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": masked_mean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    }


def probs_diff_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """|p_actor - p_rollout| over valid tokens and the Pearson correlation of the two (verl's calculate_debug_metrics)."""
    valid = mask.bool()
    dtype = acc_dtype(old_logp)
    p_old, p_roll = torch.exp(old_logp.to(dtype))[valid], torch.exp(rollout_logp.to(dtype))[valid]  # (N,)
    diff = (p_old - p_roll).abs()
    corr = torch.corrcoef(torch.stack([p_old, p_roll]))[0, 1] if diff.numel() > 1 else diff.new_zeros(())
    return {
        "training/rollout_probs_diff_valid": diff.new_ones(()),
        "training/rollout_probs_diff_max": diff.max(),
        "training/rollout_probs_diff_mean": diff.mean(),
        "training/rollout_probs_diff_std": diff.std(),
        "training/rollout_actor_probs_pearson_corr": corr,
    }


# ------------------------------------------------------------------------------------------------
# The whole correction
# ------------------------------------------------------------------------------------------------
def compute_rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    rs_options: RsOptions = (),
    all_reduce: SumsFn | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights (B, T) or None, loss mask (B, T), ``rollout_corr/*`` metrics as floats).

    ``rollout_is`` None: no weights; ``rollout_is_threshold`` one number (TIS) or "lower_upper" (IcePop,
    :func:`grpo_npu.algo.names.parse_rollout_is_threshold`); ``rs_options`` empty: the loss mask is ``mask``;
    ``all_reduce``: see :func:`rollout_is_weights`. The off-policy metrics are always computed. Needs at least one
    valid token.
    """
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape or old_logp.dim() != 2:
        raise ValueError(f"old_logp {tuple(old_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and mask "
                         f"{tuple(mask.shape)}: expected equal (B, T) shapes")
    if not mask.bool().any():
        raise ValueError("rollout correction: the response mask has no valid token")
    with torch.no_grad():
        dtype = acc_dtype(old_logp)  # float32, float64 stays float64
        log_ratio = old_logp.to(dtype) - rollout_logp.to(dtype)  # (B, T) log(pi_old / pi_rollout)
        metrics: dict[str, torch.Tensor] = {}
        weights = None
        if rollout_is is not None:
            weights, is_metrics = rollout_is_weights(log_ratio, mask, rollout_is, upper, rollout_is_batch_normalize,
                                                     lower=lower, all_reduce=all_reduce)
            metrics.update(is_metrics)
        loss_mask = mask
        if rs_options:
            loss_mask, rs_metrics = rollout_rejection_mask(log_ratio, mask, rs_options)
            metrics.update(rs_metrics)
        metrics.update(offpolicy_metrics(old_logp, rollout_logp, mask))
    return weights, loss_mask, {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}


def _correction_settings(cfg: RolloutCorrectionConfig) -> dict:
    rs = parse_rollout_rs(cfg.rollout_rs, cfg.rollout_rs_threshold) if cfg.rollout_rs is not None else ()
    return dict(rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold,
                rollout_is_batch_normalize=cfg.rollout_is_batch_normalize, rs_options=rs)


def bypass_metric_names(cfg: RolloutCorrectionConfig) -> tuple[str, ...]:
    """The ``rollout_corr/*`` names :func:`bypass_policy_loss` reports under ``cfg`` (they depend on the config only)."""
    one = torch.zeros(1, 1)
    return tuple(compute_rollout_correction(one, one, torch.ones(1, 1), **_correction_settings(cfg))[2])


def bypass_policy_loss(
    logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    cfg: RolloutCorrectionConfig, *, clip_low: float, clip_high: float, clip_c: float, agg_mode: str,
    all_reduce: SumsFn | None = None, **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float] | None]:
    """verl's bypass mode on one micro-batch (0.9.1's compute_policy_loss_bypass_mode): the rollout log-probs are the
    old policy, and the correction is computed here from the policy being trained.

    IS weights min(pi_theta / pi_rollout, threshold) and the rejection mask come from the current ``logp``
    (detached), per micro-batch (``rollout_is_batch_normalize`` divides by this micro-batch's mean, over the ranks
    when ``all_reduce`` sums across them, as verl's distributed_masked_mean does in its workers).
    ``loss_type=ppo_clip``: the PPO clipped loss with ratio pi_theta / pi_rollout over the tokens rejection keeps,
    without IS weights (the ratio is the correction); ``reinforce``: -A w log pi_theta aggregated over those tokens,
    w the IS weights (1 without ``rollout_is``), with ``ppo_kl`` = mean(rollout_logp - logp). Returns (loss, the loss
    mode's token-mean metrics, ``rollout_corr/*`` floats or None for a micro-batch without valid tokens).
    """
    weights, loss_mask, corr = None, mask, None
    if mask.bool().any():
        weights, loss_mask, corr = compute_rollout_correction(logp.detach(), rollout_logp, mask, all_reduce=all_reduce,
                                                              **_correction_settings(cfg))
    elif all_reduce is not None and cfg.rollout_is is not None and cfg.rollout_is_batch_normalize:
        zero = logp.new_zeros((), dtype=torch.float32)
        all_reduce(zero, zero)  # the other ranks' normalisation is a collective: this rank takes part with nothing
    if cfg.loss_type == "ppo_clip":
        loss, metrics = ppo_clip_loss(logp, rollout_logp, advantages, loss_mask, clip_low=clip_low, clip_high=clip_high,
                                      clip_c=clip_c, agg_mode=agg_mode, **agg_kwargs)
        return loss, metrics, corr
    # REINFORCE with the IS weights: GPG's loss -A w logp; verl's metric is the mean log ratio against the engine
    loss, _ = gpg_loss(logp, rollout_logp, advantages, loss_mask, agg_mode=agg_mode, rollout_is_weights=weights,
                       **agg_kwargs)
    dtype = acc_dtype(logp)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(rollout_logp.to(dtype) - logp.to(dtype), loss_mask)}
    return loss, metrics, corr


def correct_batch(batch: RolloutBatch, cfg: RolloutCorrectionConfig, metrics: dict[str, float]) -> RolloutBatch:
    """Apply ``algorithm.rollout_correction`` ``cfg`` to a batch with rollout and old log-probs (driver, once a step;
    in bypass mode the actor corrects each micro-batch instead and the batch is returned unchanged).

    Sets ``rollout_is_weights`` (when ``rollout_is`` is set) and ``loss_mask`` (when ``rollout_rs`` is set) and
    adds ``rollout_corr/*`` and ``training/rollout_probs_diff_*`` to ``metrics``. A batch without rollout
    log-probs (``rollout.calculate_log_probs=False``) or without old log-probs (they come from the update,
    which the config allows only with IS and RS off) is returned unchanged, with no metrics.
    """
    if (cfg.bypass_mode or batch.rollout_logp is None or batch.old_logp is None
            or not batch.response_mask.bool().any()):  # bypass: the actor corrects each micro-batch
        return batch
    settings = _correction_settings(cfg)
    weights, loss_mask, corr_metrics = compute_rollout_correction(batch.old_logp, batch.rollout_logp,
                                                                  batch.response_mask, **settings)
    metrics.update(corr_metrics)
    metrics.update({k: float(v) for k, v in probs_diff_metrics(batch.old_logp, batch.rollout_logp,
                                                                batch.response_mask).items()})
    return batch.replace(rollout_is_weights=weights, loss_mask=loss_mask if settings["rs_options"] else None)
