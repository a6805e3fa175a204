"""RMSNorm: ``torch_npu.npu_rms_norm`` on Ascend, torch's fused kernel on CUDA, the Hugging Face Qwen2/Llama formula
elsewhere.

The CUDA branch is ``aten::_fused_rms_norm`` (CUDA kernel from torch 2.9; its backward is one fused kernel
too, ``_fused_rms_norm_backward``): one launch per norm in each direction where the formula below takes eight
forward (two casts, pow, mean, add, rsqrt, two multiplies) and about twice that backward. Eager updates on a GPU
are bound by launches (docs/performance.md), and a Qwen2 layer has two norms. It computes in fp32 and rounds
once, where HF rounds the normalised value to the input dtype before scaling: the two differ by at most one
rounding of the output dtype. On CPU the same op is a composite of plain ops, which is how tests run the branch.
"""

from __future__ import annotations

import torch

from grpo_npu.ops import dispatch

BACKEND = dispatch.register(dispatch.OpBackend(
    "rms_norm", ("npu", "cuda", "reference"),
    dispatch.auto_npu_cuda_or_reference(lambda: hasattr(torch.ops.aten, "_fused_rms_norm")),
))


def set_backend(name: str | None) -> None:
    """Force 'npu' | 'cuda' | 'reference' for rms_norm (None: automatic)."""
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


def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's result dtype is promote(weight, x); the fused op returns x's dtype, so it only serves one dtype.
    if x.dtype != weight.dtype:
        return rms_norm_reference(x, weight, eps)
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]  # the OpOverload: dynamo traces it


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim of x (..., H) and scale by weight (H,). Same dtype rules as HF."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_norm: x last dim {x.shape[-1]} != weight size {weight.shape[-1]}")
    backend = BACKEND.pick(x)
    if backend == "npu":
        return _rms_norm_npu(x, weight, eps)
    if backend == "cuda":
        return _rms_norm_cuda(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
