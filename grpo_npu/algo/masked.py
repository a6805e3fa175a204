"""Masked reductions over (B, T) tensors, accumulated in float32 (float64 stays float64).

Convention: ``mask`` is the (B, T) response mask, bool or 0/1; nonzero marks a real response token.
Values at masked-out positions are never read (``torch.where``, not multiplication), so padding
that holds ``inf`` or ``nan`` cannot leak into a result.
"""

from __future__ import annotations

import torch

# Added to the variance before the reciprocal square root when whitening, as verl does: a batch whose
# values are all equal whitens to zeros instead of dividing by zero.
WHITEN_EPS = 1e-8


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype to accumulate ``t`` in: float64 stays float64, everything else becomes float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def masked_values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` upcast to its accumulation dtype with masked-out positions set to 0."""
    x = x.to(acc_dtype(x))
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over valid positions (all of them, or along ``dim``)."""
    v = masked_values(x, mask)
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid positions; 0 where there are none."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    total = masked_sum(x, mask, dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """(x - mean) / sqrt(unbiased var + eps) over all valid positions of the batch; 0 off the mask.

    With fewer than two valid positions the variance is taken as 0 (the single value whitens to 0).
    Values are shifted by the first valid one before summing, so an all-equal batch whitens to
    exactly 0 rather than to float residues amplified by 1 / sqrt(eps).
    """
    valid = mask.bool()
    count = valid.sum().clamp(min=1)
    v = masked_values(x, valid)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    if v.numel() == 0:
        return v
    shift = v.reshape(-1)[valid.reshape(-1).to(torch.uint8).argmax()]  # first valid value (0 if none)
    offset = torch.where(valid, v - shift, zero)
    centred = torch.where(valid, offset - offset.sum() / count.to(v.dtype), zero)
    var = centred.square().sum() / (count - 1).clamp(min=1).to(v.dtype)
    return centred * torch.rsqrt(var + eps)
