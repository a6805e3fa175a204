"""Rollout/training mismatch: how far the engine's log-probs are from the actor's for the same tokens.

A broken weight sync (a tensor not loaded, a tied embedding left stale, a dtype cast gone wrong) or a
kernel mismatch between engine and trainer shows up here first, long before the reward curve moves.
In fp32 with the same weights the gap is ~1e-5; bf16 engines typically sit around 1e-2 mean.
"""

from __future__ import annotations

import torch


def logp_abs_diff(rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|rollout logp - actor old logp| at the response tokens: (B, T) each -> (N,) fp32."""
    if rollout_logp.shape != old_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"rollout_logp {tuple(rollout_logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have the same (B, T) shape"
        )
    return (rollout_logp.float() - old_logp.float()).abs()[mask.bool()]


def logp_diff_metrics(rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |rollout logp - actor old logp| over response tokens: (B, T) each -> rollout/logp_diff_*."""
    diff = logp_abs_diff(rollout_logp, old_logp, mask)  # (N,)
    if diff.numel() == 0:
        return {"rollout/logp_diff_mean": 0.0, "rollout/logp_diff_max": 0.0}
    return {"rollout/logp_diff_mean": float(diff.mean()), "rollout/logp_diff_max": float(diff.max())}
