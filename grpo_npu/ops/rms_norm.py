"""RMSNorm: ``torch_npu.npu_rms_norm`` on Ascend, the Hugging Face Qwen2/Llama formula elsewhere."""

from __future__ import annotations

import torch

from grpo_npu.ops import dispatch

BACKEND = dispatch.register(dispatch.OpBackend("rms_norm"))


def set_backend(name: str | None) -> None:
    """Force 'npu' | 'reference' for rms_norm (None: automatic)."""
    BACKEND.set(name)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen2RMSNorm order: fp32 variance, normalise, cast back to x's dtype, then scale."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _rms_norm_npu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The kernel wants x and gamma in one dtype; it returns (y, rstd) and rstd only serves its backward.
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    return dispatch.torch_npu().npu_rms_norm(x, weight, eps)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim of x (..., H) and scale by weight (H,). Same dtype rules as HF."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_norm: x last dim {x.shape[-1]} != weight size {weight.shape[-1]}")
    if BACKEND.pick(x) == "npu":
        return _rms_norm_npu(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
