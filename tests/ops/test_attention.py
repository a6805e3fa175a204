"""attention: reference == a naive softmax written here; NPU branch (emulator) == reference, fwd + bwd.

Covers MHA and GQA, odd lengths, Sq < Skv (decode with a cache), padding masks and varlen batches.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from grpo_npu.ops import attention as op


def _naive(q, k, v, keep, scale):
    """BSND q/k/v, keep (B|1, 1, Sq, Skv) bool True = attend; fully masked rows -> 0."""
    group = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2)


def _causal_keep(sq, skv):
    return torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)


# (B, Sq, Skv, Nq, Nkv, D)
DENSE = [(2, 7, 7, 4, 2, 16), (1, 1, 9, 4, 4, 8), (3, 5, 5, 6, 1, 32), (2, 3, 8, 4, 2, 16), (1, 13, 13, 2, 2, 64)]


def _qkv(b, sq, skv, nq, nkv, d, dtype=torch.float32):
    q = torch.randn(b, sq, nq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, skv, nkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, skv, nkv, d, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("case", DENSE)
@pytest.mark.parametrize("causal", [True, False])
def test_reference_dense_matches_naive(case, causal, reference_backend):
    q, k, v = _qkv(*case)
    sq, skv = case[1], case[2]
    keep = _causal_keep(sq, skv) if causal else torch.ones(sq, skv, dtype=torch.bool)
    want = _naive(q, k, v, keep, 1 / math.sqrt(case[-1]))
    torch.testing.assert_close(op.attention(q, k, v, causal=causal), want.float())


def _padding_keep(b, s, pad):
    """Left padding: row i has pad[i] leading pad tokens. (B, 1, S, S) causal & not-pad keys."""
    valid = torch.arange(s)[None] >= torch.tensor(pad)[:, None]  # (B, S)
    return (_causal_keep(s, s)[None] & valid[:, None, :])[:, None]


def test_reference_padding_mask_matches_naive(reference_backend):
    q, k, v = _qkv(3, 6, 6, 4, 2, 16)
    keep = _padding_keep(3, 6, [0, 2, 5])
    got = op.attention(q, k, v, causal=False, attn_mask=keep)
    torch.testing.assert_close(got, _naive(q, k, v, keep, 0.25).float())
    # causal=True on top of a mask intersects them: same result for an already-causal mask
    torch.testing.assert_close(op.attention(q, k, v, causal=True, attn_mask=keep), got)


LENGTHS = [[3, 1, 5], [7], [2, 2, 2, 1], [4, 0, 3]]


@pytest.mark.parametrize("lengths", LENGTHS)
def test_reference_varlen_matches_per_sequence(lengths, reference_backend):
    t = sum(lengths)
    q, k, v = torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    cu = op.cu_seqlens_from_lengths(lengths)
    got = op.attention(q, k, v, causal=True, cu_seqlens=cu)
    start = 0
    for n in lengths:
        if n:
            sl = slice(start, start + n)
            want = _naive(q[None, sl], k[None, sl], v[None, sl], _causal_keep(n, n), 0.25)[0]
            torch.testing.assert_close(got[sl], want.float())
        start += n


# (query length, key length) per segment, shared-prompt style: prompt segments (Sq = Skv), responses that also
# see their prompt (Sq < Skv), and an empty query segment.
SHARED_PREFIX = [(9, 9), (3, 12), (5, 14), (1, 10), (7, 7), (0, 4), (2, 9), (6, 13), (4, 11)]


@pytest.mark.parametrize("causal", [True, False])
def test_reference_varlen_separate_key_segments_fwd_bwd(causal, reference_backend):
    """cu_seqlens_k apart from cu_seqlens: outputs and gradients of a naive softmax per segment, and bit for bit
    those of one SDPA call per segment on slices of the inputs with a bool causal mask (what the op computed before
    it split the inputs, went heads-first once and cached its masks as additive ones)."""
    tq, tk = sum(a for a, _ in SHARED_PREFIX), sum(b for _, b in SHARED_PREFIX)
    q = torch.randn(tq, 4, 16, requires_grad=True)
    k, v = (torch.randn(tk, 2, 16, requires_grad=True) for _ in range(2))
    out = op.attention(q, k, v, causal=causal, cu_seqlens=op.cu_seqlens_from_lengths([a for a, _ in SHARED_PREFIX]),
                       cu_seqlens_k=op.cu_seqlens_from_lengths([b for _, b in SHARED_PREFIX]))
    g = torch.randn_like(out)
    grads = _grads(out, (q, k, v), g)
    wants, sliced, qs, ks = [], [], 0, 0
    for a, b in SHARED_PREFIX:
        keep = _causal_keep(a, b) if causal else torch.ones(a, b, dtype=torch.bool)
        wants.append(_naive(q[None, qs:qs + a], k[None, ks:ks + b], v[None, ks:ks + b], keep, 0.25)[0])
        if a:
            sliced.append(_sdpa_per_slice(q[None, qs:qs + a], k[None, ks:ks + b], v[None, ks:ks + b], causal, 0.25)[0])
        qs, ks = qs + a, ks + b
    want = torch.cat(wants)
    torch.testing.assert_close(out, want.float())
    for got, ref in zip(grads, _grads(want, (q, k, v), g.double())):
        torch.testing.assert_close(got, ref.float())
    per_slice = torch.cat(sliced)
    assert torch.equal(out, per_slice)
    assert all(torch.equal(a, b) for a, b in zip(grads, _grads(per_slice, (q, k, v), g)))


def _sdpa_per_slice(q, k, v, causal, scale):
    """(1, S, N, D) slices -> one torch SDPA call, a bool bottom-right mask where Sq != Skv."""
    sq, skv = q.shape[1], k.shape[1]
    mask = _causal_keep(sq, skv) if causal and sq != skv else None
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal and mask is None, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


def _compare_branches(fake_npu, kwargs, q, k, v, tol):
    out = op.attention(q, k, v, **kwargs)
    assert fake_npu.calls["npu_fusion_attention"] == 1
    g = torch.randn_like(out)
    grads = _grads(out, (q, k, v), g)
    with op.dispatch.use_backend("reference", ("attention",)):
        ref = op.attention(q, k, v, **kwargs)
    ref_grads = _grads(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("case", DENSE)
@pytest.mark.parametrize("causal", [True, False])
def test_npu_branch_dense_matches_reference(case, causal, fake_npu):
    _compare_branches(fake_npu, {"causal": causal}, *_qkv(*case), tol={})


def test_npu_branch_dense_bf16(fake_npu):
    _compare_branches(fake_npu, {"causal": True}, *_qkv(2, 9, 9, 4, 2, 32, torch.bfloat16), tol={"atol": 3e-2, "rtol": 3e-2})


@pytest.mark.parametrize("pad", [[0, 2, 3], [1, 0, 0]])
def test_npu_branch_padding_mask_matches_reference(pad, fake_npu):
    q, k, v = _qkv(3, 6, 6, 4, 2, 16)
    keep = _padding_keep(3, 6, pad)
    _compare_branches(fake_npu, {"causal": False, "attn_mask": keep}, q, k, v, tol={})


def test_npu_branch_broadcast_padding_mask(fake_npu):
    q, k, v = _qkv(2, 1, 5, 4, 2, 16)  # one decode step over a cache with padded keys
    keep = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]  # (B, 1, 1, Skv)
    _compare_branches(fake_npu, {"causal": False, "attn_mask": keep}, q, k, v, tol={})


def test_npu_branch_per_head_mask_shared_by_the_batch(fake_npu):
    """A (1, Nq, Sq, Skv) mask reaches the kernel as BNSS: its docs take BNSS, B1SS, 11SS or SS, not 1NSS."""
    q, k, v = _qkv(2, 5, 5, 4, 2, 16)
    keep = torch.rand(1, 4, 5, 5) > 0.4
    keep[..., 0] = True  # every query row keeps a key
    _compare_branches(fake_npu, {"causal": False, "attn_mask": keep}, q, k, v, tol={})


@pytest.mark.parametrize("lengths", LENGTHS + [[0, 3, 2]])
def test_npu_branch_varlen_matches_reference(lengths, fake_npu):
    t = sum(lengths)
    q = torch.randn(t, 4, 16, requires_grad=True)
    k = torch.randn(t, 2, 16, requires_grad=True)
    v = torch.randn(t, 2, 16, requires_grad=True)
    _compare_branches(fake_npu, {"causal": True, "cu_seqlens": op.cu_seqlens_from_lengths(lengths)}, q, k, v, tol={})


def test_npu_branch_varlen_beyond_the_kernels_sequence_limit(fake_npu):
    """A varlen call takes at most 1024 sequences (torch_npu 2.7.1 / 2.10.0.post4 docs): more go in groups."""
    lengths = [1, 2, 0, 3] * 260  # 1040 sequences, a group boundary among them
    t = sum(lengths)
    q = torch.randn(t, 2, 8, requires_grad=True)
    k = torch.randn(t, 1, 8, requires_grad=True)
    v = torch.randn(t, 1, 8, requires_grad=True)
    kwargs = {"causal": True, "cu_seqlens": op.cu_seqlens_from_lengths(lengths)}
    out = op.attention(q, k, v, **kwargs)
    assert fake_npu.calls["npu_fusion_attention"] == 2
    g = torch.randn_like(out)
    with op.dispatch.use_backend("reference", ("attention",)):
        ref = op.attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, ref)
    for a, b in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b)


def test_cu_seqlens_from_lengths():
    assert op.cu_seqlens_from_lengths([3, 1, 5]).tolist() == [0, 3, 4, 9]


def test_rejects_bad_inputs(reference_backend):
    q, k, v = _qkv(1, 4, 4, 4, 3, 8)
    with pytest.raises(ValueError, match="multiple"):
        op.attention(q, k, v)
    q, k, v = _qkv(1, 4, 4, 4, 2, 8)
    with pytest.raises(ValueError, match="bool"):
        op.attention(q, k, v, attn_mask=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="token count"):
        op.attention(q[0], k[0], v[0], cu_seqlens=[0, 2, 3])
    with pytest.raises(ValueError, match="cu_seqlens"):
        op.attention(q[0], k[0], v[0], cu_seqlens=[0, 4], attn_mask=torch.ones(4, 4, dtype=torch.bool))
