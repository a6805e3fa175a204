"""Linear layers on CPU through oneDNN: ``y = x @ W.T + b`` and its backward, fp32, same result as F.linear.

On this project's CPU (AMD EPYC, AVX-512) torch's fp32 ``F.linear`` goes to MKL's sgemm, which ran at
150-190 GFLOP/s (2 threads) on Qwen2.5-0.5B's layer shapes, while oneDNN's matmul, the library vLLM's
CPU backend uses, ran the same products at 370-400 GFLOP/s. torch reaches oneDNN for fp32 only through
``torch.ops.mkldnn._linear_pointwise``, a forward-only op that takes plain strided tensors. This module
wraps it in an autograd Function whose backward is two more oneDNN products on transposed views:
grad_x = g @ W (weight argument W.T) and grad_W = g.T @ x (weight argument x.T); the bias gradient is a sum.

Backends: ``onednn`` (CPU fp32 tensors, when the op exists and a probe matches F.linear) and
``reference`` (F.linear: every other dtype and device, DTensors, empty inputs).

Small products stay on F.linear under either backend: oneDNN's call costs 10-15 us more than MKL's, so MKL
finishes first below a few million multiply-adds. Measured on this project's CPU (2 threads, fp32, best of 3):
(M, N, K) = (64, 128, 128) 11 us against oneDNN's 22, (128, 128, 128) 27 against 36, (4, 1024, 128) 30 against
34, (64, 256, 256) 55 against 58; from (128, 384, 128) (6.3 M) oneDNN is faster, and at (4, 896, 896) (weights of
0.8 M values, 3.2 M multiply-adds) it is 88 against MKL's 157 us. Hence both bounds: :data:`SMALL_WEIGHT`
and :data:`SMALL_PRODUCT`. The decision depends on the shapes alone, so a pass with and one without autograd
over the same rows multiply alike. The transformers rollout's decode steps of a small model are made of such
products.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from grpo_npu.ops import dispatch

log = logging.getLogger(__name__)


@functools.cache
def onednn_available() -> bool:
    """torch has oneDNN's fp32 linear and it agrees with F.linear on a probe (forward and both backward forms)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(s, generator=gen) for s in ((5, 24), (16, 24), (16,)))
        g = torch.randn(5, 16, generator=gen)
        pairs = [(_mm(x, w, b), F.linear(x, w, b)), (_mm(g, w.t()), g @ w), (_mm(g.t(), x.t()), g.t() @ x)]
        return all(torch.allclose(got, want, rtol=1e-4, atol=1e-5) for got, want in pairs)
    except (RuntimeError, TypeError) as exc:  # an op signature from another torch version
        log.info("oneDNN linear unavailable (%s); F.linear it is", str(exc).splitlines()[0])
        return False


def _auto() -> str:
    return "onednn" if onednn_available() else "reference"


SMALL_WEIGHT = 2**18  # weight values (N x K) at most, and ...
SMALL_PRODUCT = 2**22  # ... multiply-adds (M x N x K) at most: F.linear is faster than oneDNN (module docstring)

BACKEND = dispatch.register(dispatch.OpBackend("linear", supported=("onednn", "reference"), auto=_auto))


def set_backend(name: str | None) -> None:
    """Force 'onednn' | 'reference' for linear (None: automatic)."""
    BACKEND.set(name)


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T + bias, both 2-D and possibly transposed views, through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as (M, K), x @ weight.T + bias shaped like x with N features): the forward product, with or without
    autograd."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2, _mm(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2, y = _forward(x, weight, bias)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = _mm(g2, weight.t()).view(ctx.x_shape) if need_x else None
        grad_w = _mm(g2.t(), x2.t()) if need_w else None
        grad_b = g2.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b


def _onednn_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter)
            for t in tensors)
        and x.numel() > 0 and x.dim() >= 1 and weight.dim() == 2
    )


def mm_nt(a: torch.Tensor, b: torch.Tensor, *, onednn: bool) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T`` (views fine): through oneDNN when asked and the tensors fit, else torch's matmul.

    For callers doing their own matmuls (the chunked LM head of :func:`grpo_npu.ops.linear_logprobs`);
    no autograd: they write their own backward.
    """
    if onednn and BACKEND.pick(a) == "onednn" and _onednn_fits(a, b, None) and b.numel() > 0:
        return _mm(a, b)
    return a @ b.t()


def small_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``x @ weight.T`` is small enough that F.linear beats oneDNN (:data:`SMALL_WEIGHT`, :data:`SMALL_PRODUCT`)."""
    values = weight.shape[0] * weight.shape[-1]
    return values <= SMALL_WEIGHT and x.numel() // max(x.shape[-1], 1) * values <= SMALL_PRODUCT


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; fp32 CPU tensors go through oneDNN when the backend is ``onednn`` and the
    product is not small (:func:`small_product`).

    Without autograd (no-grad passes: generation, old and reference log-probs) the product is the same oneDNN
    call without the autograd Function around it, which cost 7-20 us a call (a decode step of a small model
    makes dozens of calls)."""
    if small_product(x, weight):
        return F.linear(x, weight, bias)
    if BACKEND.pick(x) == "onednn" and _onednn_fits(x, weight, bias):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                        (bias is not None and bias.requires_grad)):
            return _OneDNNLinear.apply(x, weight, bias)
        return _forward(x, weight, bias)[1]
    return F.linear(x, weight, bias)
