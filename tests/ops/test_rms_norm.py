"""rms_norm: reference == HF's Qwen2RMSNorm; NPU branch (through the emulator) == reference, fwd + bwd."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.ops import rms_norm as op

SHAPES = [(2, 7, 64), (1, 1, 32), (3, 5, 4, 16), (9, 128)]


def _slow_rms_norm(x, w, eps):
    xf = x.double()
    y = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return (w.double() * y.to(x.dtype).double()).to(torch.promote_types(x.dtype, w.dtype))


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_slow_formula_and_hf(shape, reference_backend):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    x = torch.randn(shape)
    hf = Qwen2RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1]))
    torch.testing.assert_close(op.rms_norm(x, hf.weight, 1e-6), _slow_rms_norm(x, hf.weight, 1e-6).float())
    torch.testing.assert_close(op.rms_norm(x, hf.weight, 1e-6), hf(x))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("branch", ["fake_npu", "cuda_branch"])
def test_branch_matches_reference_forward_backward(shape, dtype, branch, request):
    """The NPU branch (through the emulator) and the CUDA branch (torch's fused op, a composite of plain ops on CPU
    tensors) against HF's formula: forward and both gradients."""
    fake = request.getfixturevalue(branch)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], dtype=dtype)).requires_grad_()
    y = op.rms_norm(x, w, 1e-5)
    if branch == "fake_npu":
        assert fake.calls["npu_rms_norm"] == 1
    gy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), gy)

    x_ref, w_ref = x.detach().requires_grad_(), w.detach().requires_grad_()
    y_ref = op.rms_norm_reference(x_ref, w_ref, 1e-5)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), gy)
    assert y.dtype == y_ref.dtype == dtype
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(gx, gx_ref, **tol)
    torch.testing.assert_close(gw, gw_ref, **({"atol": 1e-1, "rtol": 2e-2} if tol else {}))


def test_npu_branch_casts_x_to_weight_dtype(fake_npu):
    x = torch.randn(2, 3, 16)  # fp32 activations into a bf16 norm: the kernel needs one dtype
    w = torch.ones(16, dtype=torch.bfloat16)
    y = op.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, op.rms_norm_reference(x.bfloat16(), w, 1e-6))


def test_rejects_mismatched_weight(reference_backend):
    with pytest.raises(ValueError, match="weight size"):
        op.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)


def test_cuda_branch_keeps_hf_dtype_promotion(cuda_branch):
    """bf16 activations into an fp32 norm weight: HF returns fp32 (promotion), so the branch takes the formula."""
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(16)
    y = op.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, op.rms_norm_reference(x, w, 1e-6))
