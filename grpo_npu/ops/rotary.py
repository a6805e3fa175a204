"""Rotary position embedding (``rotate_half`` form): ``torch_npu.npu_rotary_mul`` on Ascend.

Layout convention, as in Hugging Face attention modules: q (B, Nq, S, D) and k (B, Nkv, S, D)
(BNSD), cos/sin (B, S, D) or (1, S, D) as returned by the model's rotary embedding. The NPU kernel
takes 4-D cos/sin that broadcast over the head axis, so for BNSD they become B1SD / 11SD.

The CUDA branch computes the same rotation with fewer kernel launches (eager GPU updates are bound by
launches, docs/performance.md). ``rotate_half(x) * sin`` is ``roll(x, D/2) * sin_signed`` with the first half of
sin negated, so the rotation is ``addcmul(x * cos, roll(x, D/2), sin_signed)``: three launches per tensor where
the formula takes five (mul, neg, cat, mul, add), and a backward of three, ``g * cos + roll(g * sin_signed, D/2)``
(rolling by half of an even length is its own inverse), where autograd replays about six. It rounds once less
than the formula (addcmul keeps ``roll * sin`` in fp32 before the add): within one rounding of the input dtype.
"""

from __future__ import annotations

import torch

from grpo_npu.ops import dispatch

BACKEND = dispatch.register(dispatch.OpBackend("rotary", ("npu", "cuda", "reference"),
                                               dispatch.auto_npu_cuda_or_reference()))


def set_backend(name: str | None) -> None:
    """Force 'npu' | 'cuda' | 'reference' for rotary (None: automatic)."""
    BACKEND.set(name)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q*cos + rotate_half(q)*sin (same for k), cos/sin (B, S, D) broadcast over heads."""
    cos = cos.unsqueeze(1)  # (B, 1, S, D)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _apply_rotary_npu(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    npu = dispatch.torch_npu()
    # BNSD input takes B1SD (or 11SD) cos/sin in the input's dtype.
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    return npu.npu_rotary_mul(q, cos, sin), npu.npu_rotary_mul(k, cos, sin)


class _RollRotation(torch.autograd.Function):
    """x * cos + roll(x, D/2) * sin_signed over the last dim; no gradient for cos and sin (position constants)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin_signed)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin_signed = ctx.saved_tensors
        return torch.addcmul((grad * sin_signed).roll(grad.shape[-1] // 2, -1), grad, cos), None, None


def _apply_rotary_cuda(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    half = sin.shape[-1] // 2
    cos = cos.unsqueeze(1)  # (B, 1, S, D)
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
    return _RollRotation.apply(q, cos, sin_signed), _RollRotation.apply(k, cos, sin_signed)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, Nq, S, D) and k (B, Nkv, S, D) by cos/sin (B|1, S, D). Returns (q_rot, k_rot)."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rotary: q and k must be (B, N, S, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"apply_rotary: cos/sin must both be (B, S, D), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.shape[-1] != q.shape[-1] or cos.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"apply_rotary: cos/sin {tuple(cos.shape)} do not match q {tuple(q.shape)} in (S, D); "
            "partial rotary (rotary dim < head dim) is not supported"
        )
    if q.shape[-1] % 2:
        raise ValueError(f"apply_rotary: head dim must be even (two rotated halves), got {q.shape[-1]}")
    backend = BACKEND.pick(q)
    if backend == "npu":
        return _apply_rotary_npu(q, k, cos, sin)
    if backend == "cuda":
        return _apply_rotary_cuda(q, k, cos, sin)
    return apply_rotary_reference(q, k, cos, sin)
