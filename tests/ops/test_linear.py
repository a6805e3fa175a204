"""grpo_npu.ops.linear: oneDNN's fp32 linear and its hand-written backward against F.linear in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpo_npu.ops import dispatch
from grpo_npu.ops import linear as linear_op

needs_onednn = pytest.mark.skipif(not linear_op.onednn_available(), reason="torch has no usable oneDNN linear")


def _reference(x, w, b, g):
    """Output and gradients of F.linear in float64, the ground truth."""
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y = F.linear(x64, w64, b64)
    y.backward(g.double())
    return y, x64.grad, w64.grad, None if b is None else b64.grad


@pytest.fixture
def counted_mm(monkeypatch):
    """Counts oneDNN's products; the tests' small shapes are taken to oneDNN too (no small-product bound)."""
    monkeypatch.setattr(linear_op, "SMALL_WEIGHT", -1)
    calls = []
    real = linear_op._mm

    def spy(*args):
        calls.append(tuple(getattr(a, "shape", None) for a in args))
        return real(*args)

    monkeypatch.setattr(linear_op, "_mm", spy)
    return calls


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 24), (2, 9, 24), (3, 1, 24)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("transposed_input", [False, True])
def test_forward_and_backward_match_float64(shape, bias, transposed_input, counted_mm):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    if transposed_input:  # a non-contiguous view of the same values
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    w = torch.randn(40, 24, generator=gen) * 0.3
    b = torch.randn(40, generator=gen) if bias else None
    g = torch.randn(*shape[:-1], 40, generator=gen)
    want_y, want_gx, want_gw, want_gb = _reference(x, w, b, g)

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = None if b is None else b.clone().requires_grad_()
    with dispatch.use_backend("onednn", ops=("linear",)):
        y = linear_op.linear(xs, ws, bs)
    y.backward(g)
    assert len(counted_mm) == 3  # forward, grad_x, grad_w: all three through oneDNN
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), want_y, **tol)
    torch.testing.assert_close(xs.grad.double(), want_gx, **tol)
    torch.testing.assert_close(ws.grad.double(), want_gw, **tol)
    if bias:
        torch.testing.assert_close(bs.grad.double(), want_gb, **tol)


@needs_onednn
def test_frozen_weight_skips_its_product(counted_mm):
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(6, 8)  # no grad: a reference model's or a frozen layer's weight
    with dispatch.use_backend("onednn", ops=("linear",)):
        linear_op.linear(x, w).sum().backward()
    assert len(counted_mm) == 2
    torch.testing.assert_close(x.grad, torch.ones(5, 6) @ w)


@pytest.mark.parametrize("make", [
    lambda: (torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)),
    lambda: (torch.randn(0, 8), torch.randn(6, 8)),
    lambda: (torch.randn(4, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)),
])
def test_other_dtypes_and_empty_inputs_take_f_linear(make, counted_mm):
    x, w = make()
    with dispatch.use_backend("onednn", ops=("linear",)):
        y = linear_op.linear(x, w)
    assert counted_mm == []
    torch.testing.assert_close(y, F.linear(x, w))


def test_reference_backend_never_calls_onednn(counted_mm):
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with dispatch.use_backend("reference", ops=("linear",)):
        y = linear_op.linear(x, w)
    assert counted_mm == []
    torch.testing.assert_close(y, F.linear(x, w), rtol=0, atol=0)


def test_automatic_backend_serves_cpu_tensors_only():
    assert linear_op.BACKEND.get() == ("onednn" if linear_op.onednn_available() else "reference")
    assert dispatch.BACKEND_DEVICE["onednn"] == "cpu"
    with pytest.raises(ValueError, match="has no backend 'npu'"):
        linear_op.set_backend("npu")


@needs_onednn
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_without_autograd_the_same_product_skips_the_function(mode, counted_mm, monkeypatch):
    """Generation and the log-prob passes run without autograd: the same oneDNN call, bitwise the same output,
    without the autograd Function around it."""
    applied = []
    real_apply = linear_op._OneDNNLinear.apply
    monkeypatch.setattr(linear_op._OneDNNLinear, "apply", lambda *args: applied.append(1) or real_apply(*args))
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 5, 24, generator=gen), torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    with dispatch.use_backend("onednn", ops=("linear",)):
        with_grad = linear_op.linear(x, w.clone().requires_grad_(), b)
        assert applied == [1]
        if mode == "no_grad":
            with torch.no_grad():
                y = linear_op.linear(x, w.clone().requires_grad_(), b)
        elif mode == "inference_mode":
            with torch.inference_mode():
                y = linear_op.linear(x, w, b)
        else:
            y = linear_op.linear(x, w, b)
    assert applied == [1] and len(counted_mm) == 2  # one oneDNN product each, no Function the second time
    assert y.grad_fn is None and y.shape == (2, 5, 40)
    assert torch.equal(y, with_grad.detach())


@needs_onednn
@pytest.mark.parametrize("m, n, k, onednn", [
    (64, 128, 128, False), (128, 128, 128, False), (4, 1024, 128, False), (64, 256, 256, False),
    (128, 384, 128, True),  # 6.3 M multiply-adds
    (4, 896, 896, True),  # 3.2 M multiply-adds, but 0.8 M weight values
])
@pytest.mark.parametrize("grad", [False, True])
def test_small_products_stay_on_f_linear_with_or_without_autograd(m, n, k, onednn, grad, monkeypatch):
    calls = []
    real = linear_op._mm
    monkeypatch.setattr(linear_op, "_mm", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen, requires_grad=grad)
    with dispatch.use_backend("onednn", ops=("linear",)):
        y = linear_op.linear(x, w)
    assert bool(calls) == onednn and linear_op.small_product(x, w) == (not onednn)
    if onednn:
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
    else:
        assert torch.equal(y, F.linear(x, w))
        if grad:
            y.sum().backward()
            assert w.grad is not None and not calls
