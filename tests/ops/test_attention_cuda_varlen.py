"""attention's CUDA varlen branch (torch's flash varlen kernel) on CPU through a stand-in kernel: the arguments it
hands the kernel, when it falls back to the reference, the one-time probe; the real kernel on a GPU (``cuda``)."""

from __future__ import annotations

import logging

import pytest
import torch

from grpo_npu import device
from grpo_npu.ops import attention as op
from grpo_npu.ops import dispatch

# (query length, key length) per segment: prompts (Sq = Skv) and responses that also see their prompt (Sq < Skv).
SEGMENTS = [(9, 9), (3, 12), (5, 14), (1, 10), (7, 7), (2, 9)]


class FakeKernel:
    """varlen_attn's keyword signature; computes with the reference from the offsets it is handed (autograd and all)
    and records every call. ``wrong``: returns zeros (a kernel that disagrees); ``raises``: raises it."""

    def __init__(self, wrong: bool = False, raises: Exception | None = None) -> None:
        self.calls: list[dict] = []
        self.wrong, self.raises = wrong, raises

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        self.calls.append(dict(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, scale=scale, window_size=window_size,
                               enable_gqa=enable_gqa, dtype=q.dtype))
        if self.raises is not None:
            raise self.raises
        out = op.attention_reference(q, k, v, causal=tuple(window_size) == (-1, 0), attn_mask=None,
                                     q_offsets=cu_q.tolist(), k_offsets=cu_k.tolist(), scale=scale)
        return out * 0 if self.wrong else out


@pytest.fixture
def cuda_varlen(monkeypatch):
    """The attention op forced onto its CUDA branch, a FakeKernel standing in for torch's, probes forgotten."""
    kernel = FakeKernel()
    monkeypatch.setattr(op, "varlen_kernel", lambda: kernel)
    monkeypatch.setattr(op, "_cuda_varlen_probed", {})
    with dispatch.use_backend("cuda", ("attention",)):
        yield kernel


def _inputs(segments, nq=4, nkv=2, d=64, dtype=torch.bfloat16):
    tq, tk = sum(a for a, _ in segments), sum(b for _, b in segments)
    q = torch.randn(tq, nq, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(tk, nkv, d, dtype=dtype, requires_grad=True) for _ in range(2))
    cu_q = op.cu_seqlens_from_lengths([a for a, _ in segments])
    cu_k = op.cu_seqlens_from_lengths([b for _, b in segments])
    return q, k, v, cu_q, cu_k


def _with_grads(q, k, v, g, **kwargs):
    out = op.attention(q, k, v, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


@pytest.mark.parametrize("causal", [True, False])
def test_cuda_branch_hands_the_kernel_device_offsets_and_matches_the_reference(cuda_varlen, causal):
    q, k, v, cu_q, cu_k = _inputs(SEGMENTS)
    g = torch.randn(q.shape, dtype=q.dtype)
    got = _with_grads(q, k, v, g, causal=causal, cu_seqlens=cu_q, cu_seqlens_k=cu_k, scale=0.2)
    with dispatch.use_backend("reference", ("attention",)):
        want = _with_grads(q, k, v, g, causal=causal, cu_seqlens=cu_q, cu_seqlens_k=cu_k, scale=0.2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    probe, call = cuda_varlen.calls  # the first call probes the kernel once, then the real call
    assert probe["window_size"] == (-1, 0) and probe["enable_gqa"]  # the probe: causal, GQA
    assert call["cu_q"] is cu_q and call["cu_k"] is cu_k  # int32 tensors on the device already: handed over as is
    assert (call["max_q"], call["max_k"]) == (9, 14)
    assert call["window_size"] == ((-1, 0) if causal else (-1, -1))
    assert call["enable_gqa"] and call["scale"] == 0.2


def test_cuda_branch_builds_offsets_from_lists_and_shares_one_for_self_attention(cuda_varlen):
    lengths = [4, 6, 1, 5]
    q, k, v, _, _ = _inputs([(n, n) for n in lengths], nq=2, nkv=2)
    op.attention(q, k, v, causal=True, cu_seqlens=[0, 4, 10, 11, 16])
    call = cuda_varlen.calls[-1]
    assert call["cu_q"].dtype == torch.int32 and call["cu_q"].tolist() == [0, 4, 10, 11, 16]
    assert call["cu_k"] is call["cu_q"] and call["max_q"] == call["max_k"] == 6
    assert not call["enable_gqa"]


@pytest.mark.parametrize("case", ["float32", "head_dim_12", "head_dim_512", "more_queries_than_keys", "empty_queries"])
def test_cuda_branch_leaves_to_the_reference_what_the_kernel_does_not_compute_alike(cuda_varlen, case):
    segments, d, dtype = [(3, 3), (4, 6)], 64, torch.bfloat16
    if case == "float32":
        dtype = torch.float32
    elif case.startswith("head_dim"):
        d = int(case.rsplit("_", 1)[1])
    elif case == "more_queries_than_keys":
        segments = [(3, 3), (6, 4)]
    else:
        segments = [(3, 3), (0, 4), (2, 2)]
    q, k, v, cu_q, cu_k = _inputs(segments, d=d, dtype=dtype)
    out = op.attention(q, k, v, causal=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    with dispatch.use_backend("reference", ("attention",)):
        torch.testing.assert_close(out, op.attention(q, k, v, causal=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k))
    assert cuda_varlen.calls == []  # not even probed


FAILING = [FakeKernel(wrong=True), FakeKernel(raises=RuntimeError("no kernel image for sm70"))]


@pytest.mark.parametrize("kernel", FAILING, ids=["disagrees", "raises"])
def test_a_kernel_that_fails_its_probe_is_never_used_and_said_once(monkeypatch, caplog, kernel):
    monkeypatch.setattr(op, "varlen_kernel", lambda: kernel)
    monkeypatch.setattr(op, "_cuda_varlen_probed", {})
    q, k, v, cu_q, cu_k = _inputs(SEGMENTS)
    with dispatch.use_backend("reference", ("attention",)):
        want = op.attention(q, k, v, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    with dispatch.use_backend("cuda", ("attention",)), caplog.at_level(logging.WARNING, "grpo_npu.ops.attention"):
        with torch.no_grad():  # the first packed call of a run is often a no-grad log-prob pass: the probe still runs
            first = op.attention(q, k, v, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
        second = op.attention(q, k, v, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert len(kernel.calls) == 1  # the probe only
    warnings = [r.getMessage() for r in caplog.records if "flash varlen kernel is not used" in r.getMessage()]
    assert len(warnings) == 1
    assert ("disagree" in warnings[0]) if kernel.raises is None else ("no kernel image for sm70" in warnings[0])


def test_host_offsets_are_read_once_per_tensor_and_again_after_a_change():
    cu_q, cu_k = op.cu_seqlens_from_lengths([2, 3]), op.cu_seqlens_from_lengths([2, 5])
    first_q, first_k = op._host_offsets(cu_q), op._host_offsets(cu_k)
    assert first_q == [0, 2, 5] and first_k == [0, 2, 7]
    assert op._host_offsets(cu_q) is first_q and op._host_offsets(cu_k) is first_k  # queries and keys both kept
    cu_q[2] = 6  # in place: a new version, read again
    assert op._host_offsets(cu_q) == [0, 2, 6]
    assert op._host_offsets([0, 1]) == [0, 1]


def test_a_kernel_without_enable_gqa_gets_the_heads_as_they_are(monkeypatch):
    """torch 2.11's varlen_attn (return_aux, scale, window_size) has no enable_gqa: GQA goes to flash-attention as is."""
    seen = []

    def kernel_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        seen.append(dict(scale=scale, window_size=window_size))
        return op.attention_reference(q, k, v, causal=window_size == (-1, 0), attn_mask=None,
                                      q_offsets=cu_q.tolist(), k_offsets=cu_k.tolist(), scale=scale)

    monkeypatch.setattr(op, "varlen_kernel", lambda: kernel_2_11)
    monkeypatch.setattr(op, "_cuda_varlen_probed", {})
    q, k, v, cu_q, cu_k = _inputs(SEGMENTS)
    with dispatch.use_backend("cuda", ("attention",)):
        op.attention(q, k, v, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    assert seen == [dict(scale=0.125, window_size=(-1, 0)), dict(scale=0.125, window_size=(-1, 0))]  # probe, call


def test_varlen_kernel_needs_the_keyword_signature(monkeypatch):
    import torch.nn.attention.varlen as varlen_module

    op.varlen_kernel.cache_clear()
    try:
        monkeypatch.setattr(varlen_module, "varlen_attn", lambda q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False: q)
        assert op.varlen_kernel() is None  # torch 2.10's form: no scale or window
    finally:
        op.varlen_kernel.cache_clear()


@pytest.mark.cuda
def test_cuda_flash_varlen_matches_the_reference_fwd_bwd():
    """On a GPU: the real kernel passes its probe and agrees with one SDPA call per segment (bf16, GQA, shared-prompt
    segments and self-attention), outputs and gradients."""
    dev = device.get_device("cuda").torch_device()
    op._cuda_varlen_probed.clear()
    for segments in (SEGMENTS, [(n, n) for n in (17, 1, 64, 33)]):
        q, k, v, cu_q, cu_k = (t.detach().to(dev) for t in _inputs(segments))
        # q as the model hands it over: a (T, N, D) view of heads-first storage (strides D, T*D, 1)
        q = q.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
        k, v = k.requires_grad_(), v.requires_grad_()
        g = torch.randn(q.shape, dtype=q.dtype, device=dev)
        with dispatch.use_backend("cuda", ("attention",)):
            got = _with_grads(q, k, v, g, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
        with dispatch.use_backend("reference", ("attention",)):
            want = _with_grads(q, k, v, g, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert op._cuda_varlen_probed == {(q.device, torch.bfloat16): True}
