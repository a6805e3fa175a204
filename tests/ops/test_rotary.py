"""apply_rotary: reference == HF apply_rotary_pos_emb; NPU branch == reference, fwd + bwd, GQA, odd S."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.ops import rotary as op

# (B, Nq, Nkv, S, D, cos batch)
CASES = [(2, 4, 2, 7, 16, 2), (1, 2, 2, 1, 8, 1), (3, 6, 1, 5, 32, 1), (2, 4, 4, 9, 64, 2)]


def _cos_sin(b, s, d):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.arange(s).float()[None].expand(b, s) + torch.arange(b)[:, None]  # distinct rows per batch
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos(), emb.sin()  # (b, S, D)


def _inputs(b, nq, nkv, s, d, cb, dtype=torch.float32):
    q = torch.randn(b, nq, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, nkv, s, d, dtype=dtype, requires_grad=True)
    cos, sin = _cos_sin(cb, s, d)
    return q, k, cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_hf(case, reference_backend):
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    q, k, cos, sin = _inputs(*case)
    got = op.apply_rotary(q, k, cos, sin)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("branch", ["fake_npu", "cuda_branch"])
def test_branch_matches_reference_forward_backward(case, dtype, branch, request):
    """The NPU branch (through the emulator) and the CUDA branch (plain ops, run here on CPU tensors)."""
    fake = request.getfixturevalue(branch)
    q, k, cos, sin = _inputs(*case, dtype=dtype)
    qr, kr = op.apply_rotary(q, k, cos, sin)
    if branch == "fake_npu":
        assert fake.calls["npu_rotary_mul"] == 2
    gq_out, gk_out = torch.randn_like(qr), torch.randn_like(kr)
    gq, gk = torch.autograd.grad((qr, kr), (q, k), (gq_out, gk_out))

    q2, k2 = q.detach().requires_grad_(), k.detach().requires_grad_()
    qr2, kr2 = op.apply_rotary_reference(q2, k2, cos, sin)
    gq2, gk2 = torch.autograd.grad((qr2, kr2), (q2, k2), (gq_out, gk_out))
    tol = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    for got, want in ((qr, qr2), (kr, kr2), (gq, gq2), (gk, gk2)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tol)


def test_rejects_bad_shapes(reference_backend):
    q, k, cos, sin = _inputs(2, 4, 2, 7, 16, 2)
    with pytest.raises(ValueError, match="cos/sin"):
        op.apply_rotary(q, k, cos[..., :8], sin[..., :8])
    with pytest.raises(ValueError, match=r"\(B, S, D\)"):
        op.apply_rotary(q, k, cos[:, None], sin[:, None])
    with pytest.raises(ValueError, match=r"\(B, N, S, D\)"):
        op.apply_rotary(q[0], k[0], cos, sin)


def test_cuda_branch_gradient_is_exact_for_unequal_halves(cuda_branch):
    """gradcheck in float64 with cos/sin halves that differ (HF's are equal): the hand-written backward is the
    derivative of the forward for any cos/sin, not only for HF's."""
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: op.apply_rotary(a, b, cos, sin), (q, k))
    want = op.apply_rotary_reference(q, k, cos, sin)
    for got, ref in zip(op.apply_rotary(q, k, cos, sin), want):
        torch.testing.assert_close(got, ref)


def test_cuda_branch_runs_fewer_ops_than_the_formula(cuda_branch):
    """Why the branch exists: fewer ATen calls (each a kernel launch on a GPU), forward + backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket not in (torch.ops.aten.view, torch.ops.aten.unsqueeze, torch.ops.aten.slice,
                                           torch.ops.aten.detach, torch.ops.aten.split, torch.ops.aten.expand):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    def ops(fn):
        q, k, cos, sin = _inputs(2, 4, 2, 7, 16, 2)
        Count.n = 0
        with Count():
            qr, kr = fn(q, k, cos, sin)
            torch.autograd.grad((qr, kr), (q, k), (torch.ones_like(qr), torch.ones_like(kr)))
        return Count.n

    fused, formula = ops(op.apply_rotary), ops(op.apply_rotary_reference)
    assert fused < formula * 0.75, (fused, formula)
