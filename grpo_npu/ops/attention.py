"""Attention core (softmax(scale * q k^T, masked) v): ``torch_npu.npu_fusion_attention`` on Ascend, torch's
flash-attention varlen kernel for packed batches on CUDA.

Two layouts, the flash-attention ones:
- padded BSND: q (B, Sq, Nq, D), k/v (B, Skv, Nkv, D) -> (B, Sq, Nq, D);
- varlen TND: q (T, Nq, D), k/v (Tk, Nkv, D) with ``cu_seqlens`` (n+1,) cumulative offsets starting
  at 0 (flash-attn convention) -> (T, Nq, D). Sequences attend only within themselves.
GQA is native (Nq a multiple of Nkv). ``causal`` is bottom-right aligned (query i of Sq sees keys
j <= i + Skv - Sq), which is what both flash-attn and the NPU's sparse_mode 3 compute.
``attn_mask`` follows torch SDPA: bool, True = attend. The NPU kernel wants the opposite
(True = masked out); the NPU branch inverts it.

NPU call (op-plugin docs): default ``scale`` is 1.0, so 1/sqrt(D) is always passed; causal uses
``sparse_mode=3`` with the fixed 2048x2048 upper-triangular "compressed" mask (the kernel expands
it); varlen passes ``actual_seq_qlen``/``actual_seq_kvlen`` as host lists of cumulative END offsets
without the leading 0 (lengths 2,2,2 -> [2, 4, 6]), at most 1024 sequences per call (more go in groups). A
masked query row with no key to attend (left padding) returns zeros on every backend; the NPU branch never
hands such a row to the kernel (the kernel constraints, with their sources: docs/npu.md).

CUDA call (varlen only; padded batches stay torch SDPA, one call already): ``torch.nn.attention.varlen.varlen_attn``
(torch >= 2.11, the first with ``scale`` and ``window_size``; 2.12 adds ``enable_gqa``, passed where it exists):
flash-attention's varlen kernel, one launch for the whole packed micro-batch where the reference launches SDPA once
per segment in every layer. It takes device ``cu_seq_q``/``cu_seq_k`` (int32, with the leading 0), the longest
segment of each, GQA as is, and ``window_size=(-1, 0)`` for causal, which flash-attention aligns bottom-right. It
serves fp16/bf16 with a head dim that is a multiple of 8 up to 256 and segments with at least as many keys as
queries, after a one-time probe per device and dtype against the reference (forward and backward; a kernel that
raises or disagrees is logged once and the reference serves). Everything else takes the reference
(:mod:`grpo_npu.ops.attention_reference`: torch SDPA, per segment or per shared-prompt group).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from grpo_npu.ops import dispatch
from grpo_npu.ops.attention_reference import (
    PrefixGroups,
    attention_reference,
    bottom_right_causal,
    prefix_groups_attention,
)

log = logging.getLogger(__name__)


_VARLEN_KEYWORDS = ("scale", "window_size")  # varlen_attn's keywords from torch 2.11 (2.10's took neither)


@functools.cache
def varlen_kernel():
    """torch's flash-attention varlen function (``torch.nn.attention.varlen.varlen_attn``) where it takes a scale and a
    causal window (torch >= 2.11), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    return varlen_attn if all(name in parameters for name in _VARLEN_KEYWORDS) else None


@functools.cache
def _takes_enable_gqa(kernel) -> bool:
    """varlen_attn grew ``enable_gqa`` in torch 2.12 (and refuses fewer kv heads without it); 2.11 has no such
    keyword and hands the heads to flash-attention as they are."""
    return "enable_gqa" in inspect.signature(kernel).parameters


BACKEND = dispatch.register(dispatch.OpBackend(
    "attention", ("npu", "cuda", "reference"), dispatch.auto_npu_cuda_or_reference(lambda: varlen_kernel() is not None),
))

# sparse_mode 2/3 read a fixed-size upper-triangular mask and expand it to any (Sq, Skv).
COMPRESSED_MASK_SIZE = 2048
SPARSE_MODE_DEFAULT_MASK = 0  # atten_mask used as given (or full attention when it is None)
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3  # bottom-right aligned causal, from the compressed mask
_compressed_masks: dict[torch.device, torch.Tensor] = {}
# A varlen (TND) call takes at most 1K sequences ("varlen场景下长度最大支持1K", actual_seq_qlen; torch_npu 2.7.1 and
# 2.10.0.post4 op docs): longer packed batches go to the kernel in consecutive groups of sequences.
NPU_VARLEN_MAX_SEQUENCES = 1024


def set_backend(name: str | None) -> None:
    """Force 'npu' | 'cuda' | 'reference' for attention (None: automatic)."""
    BACKEND.set(name)


def cu_seqlens_from_lengths(lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Sequence lengths (n,) -> cumulative offsets (n+1,) int32 starting at 0."""
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


_recent_offsets: list[tuple[torch.Tensor, int, list[int]]] = []  # (cu_seqlens tensor, its version, its host list)


def _host_offsets(cu_seqlens: Sequence[int] | torch.Tensor) -> list[int]:
    """cu_seqlens as a host list. Every layer of a forward passes the same one or two tensors (queries, keys): their
    lists are kept for the next calls, so accelerator tensors are read back (a device sync) once per forward, not
    once per layer."""
    if not isinstance(cu_seqlens, torch.Tensor):
        return [int(x) for x in cu_seqlens]
    for tensor, version, offsets in _recent_offsets:
        if tensor is cu_seqlens and version == cu_seqlens._version:
            return offsets
    offsets = [int(x) for x in cu_seqlens.tolist()]
    _recent_offsets[:] = [(cu_seqlens, cu_seqlens._version, offsets), *_recent_offsets[:1]]
    return offsets


def _offsets(cu_seqlens: Sequence[int] | torch.Tensor, total: int, name: str) -> list[int]:
    """Validated host list of cumulative offsets [0, ..., total]."""
    offsets = _host_offsets(cu_seqlens)
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"attention: {name} must run from 0 to the token count {total}, got {offsets}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"attention: {name} must be non-decreasing, got {offsets}")
    return offsets


def _compressed_causal_mask(device: torch.device) -> torch.Tensor:
    mask = _compressed_masks.get(device)
    if mask is None:
        mask = torch.triu(torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device), 1)
        _compressed_masks[device] = mask
    return mask


def _attention_npu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   attn_mask: torch.Tensor | None, q_offsets: list[int] | None, k_offsets: list[int] | None,
                   scale: float) -> torch.Tensor:
    # Every argument is named in the one call below, so tests/ops/test_npu_schemas.py can check the
    # call against the schema of each supported torch_npu.
    if q_offsets is not None and len(q_offsets) - 1 > NPU_VARLEN_MAX_SEQUENCES:
        return _varlen_npu_in_groups(q, k, v, causal=causal, q_offsets=q_offsets, k_offsets=k_offsets, scale=scale)
    layout, seq_qlen, seq_kvlen = "BSND", None, None
    atten_mask, sparse_mode, empty_rows = None, SPARSE_MODE_DEFAULT_MASK, None
    if q_offsets is not None:
        layout = "TND"
        # Cumulative END offsets without the leading 0; sequences empty on both sides are dropped.
        segments = zip(q_offsets, q_offsets[1:], k_offsets, k_offsets[1:])
        ends = [(qe, ke) for qs, qe, ks, ke in segments if (qs, ks) != (qe, ke)]
        seq_qlen, seq_kvlen = [qe for qe, _ in ends], [ke for _, ke in ends]
    if attn_mask is not None:
        sq, skv = q.shape[1], k.shape[1]
        keep = attn_mask if attn_mask.dim() == 4 else attn_mask[None, None]  # (B|1, N|1, Sq|1, Skv)
        if causal:
            keep = keep & bottom_right_causal(sq, skv, q.device)
        # the kernel takes BNSS / B1SS / 11SS / SS, not 1NSS: expand broadcast q/kv dims, and the batch of a per-head mask
        keep = keep.expand(q.shape[0] if keep.shape[1] > 1 else keep.shape[0], keep.shape[1], sq, skv)
        # A query row with no key to attend (left padding) must not reach the kernel: its docs make
        # such rows lose precision (BSND) or forbid them (TND, torch_npu >= 2.7.1). The row attends
        # to every key instead and its output is zeroed below, as torch SDPA returns for it.
        empty_rows = ~keep.any(-1, keepdim=True)  # (B|1, N|1, Sq, 1)
        atten_mask = torch.logical_not(keep | empty_rows).contiguous()  # NPU: True = masked out
    elif causal:
        atten_mask, sparse_mode = _compressed_causal_mask(q.device), SPARSE_MODE_RIGHT_DOWN_CAUSAL
    out = dispatch.torch_npu().npu_fusion_attention(
        q, k, v, q.shape[-2], layout,
        atten_mask=atten_mask, scale=scale, keep_prob=1.0,
        actual_seq_qlen=seq_qlen, actual_seq_kvlen=seq_kvlen, sparse_mode=sparse_mode,
    )[0]  # fmt: skip
    if empty_rows is not None:
        out = out.masked_fill(empty_rows.transpose(1, 2), 0.0)  # (B|1, Sq, N|1, 1) over (B, Sq, Nq, D)
    return out


def _varlen_npu_in_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offsets: list[int],
                          k_offsets: list[int], scale: float) -> torch.Tensor:
    """A varlen batch of more sequences than one kernel call takes, as calls of NPU_VARLEN_MAX_SEQUENCES each (the
    sequences attend only within themselves, so the split is exact)."""
    outs, n = [], NPU_VARLEN_MAX_SEQUENCES
    for first in range(0, len(q_offsets) - 1, n):
        qo, ko = q_offsets[first:first + n + 1], k_offsets[first:first + n + 1]
        if qo[-1] == qo[0]:
            continue  # no queries in this group: nothing to compute (its rows of the output are empty)
        outs.append(_attention_npu(q[qo[0]:qo[-1]], k[ko[0]:ko[-1]], v[ko[0]:ko[-1]], causal=causal, attn_mask=None,
                                   q_offsets=[o - qo[0] for o in qo], k_offsets=[o - ko[0] for o in ko], scale=scale))
    return torch.cat(outs)


_CUDA_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_CUDA_VARLEN_MAX_HEAD_DIM = 256
_cuda_varlen_probed: dict[tuple[torch.device, torch.dtype], bool] = {}


def _cuda_varlen_fits(q: torch.Tensor, k: torch.Tensor, q_offsets: list[int], k_offsets: list[int]) -> bool:
    """The flash varlen kernel computes this call as the reference does (module docstring)."""
    d = q.shape[-1]
    if q.dtype not in _CUDA_VARLEN_DTYPES or k.dtype != q.dtype or d % 8 or d > _CUDA_VARLEN_MAX_HEAD_DIM:
        return False
    segments = zip(q_offsets, q_offsets[1:], k_offsets, k_offsets[1:])
    # Every segment has queries, and keys for each of them (else rows without a key: the reference's zeros).
    if any(qe == qs or qe - qs > ke - ks for qs, qe, ks, ke in segments):
        return False
    return _cuda_varlen_works(q.device, q.dtype)


def _cuda_varlen_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel passed its probe on this device and dtype (run on the first call, logged when it fails)."""
    key = (device, dtype)
    if key not in _cuda_varlen_probed:
        try:
            with torch.inference_mode(False), torch.enable_grad():  # the first call may come from a no-grad pass
                reason = _cuda_varlen_disagreement(device, dtype)
        except (RuntimeError, TypeError, ValueError) as exc:  # no kernel for this GPU, or another signature
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if reason is not None:
            log.warning("attention: torch's flash varlen kernel is not used on %s %s (%s); packed batches attend "
                        "one segment at a time", device, dtype, reason)
        _cuda_varlen_probed[key] = reason is None
    return _cuda_varlen_probed[key]


def _cuda_varlen_disagreement(device: torch.device, dtype: torch.dtype) -> str | None:
    """The kernel's output and gradients against the reference's on GQA, causal, Sq < Skv segments: None when they
    agree within a rounding of ``dtype``, else what differs."""
    gen = torch.Generator(device=device).manual_seed(0)
    lengths_q, lengths_k = [5, 3, 9], [5, 7, 9]
    q_off, k_off = (cu_seqlens_from_lengths(x).tolist() for x in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), 4, 64, generator=gen, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=gen, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    got = _attention_cuda_varlen(q, k, v, causal=True, q_offsets=q_off, k_offsets=k_off, scale=0.125)
    want = attention_reference(q, k, v, causal=True, attn_mask=None, q_offsets=q_off, k_offsets=k_off, scale=0.125)
    grad = torch.randn(got.shape, generator=gen, device=device, dtype=dtype)
    pairs = zip(("output", "dq", "dk", "dv"), (got, *torch.autograd.grad(got, (q, k, v), grad)),
                (want, *torch.autograd.grad(want, (q, k, v), grad)))
    bad = [name for name, a, b in pairs if not torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)]
    return f"its {', '.join(bad)} disagree with the reference" if bad else None


def _device_offsets(given: Sequence[int] | torch.Tensor | None, offsets: list[int],
                    device: torch.device) -> torch.Tensor:
    """The int32 offsets on ``device``: the caller's tensor when it is one already (no copy), else a new one."""
    if isinstance(given, torch.Tensor) and given.device == device and given.dtype == torch.int32 and given.dim() == 1:
        return given
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _attention_cuda_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offsets: list[int],
                           k_offsets: list[int], scale: float, cu_seqlens=None, cu_seqlens_k=None) -> torch.Tensor:
    kernel = varlen_kernel()
    if kernel is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn with scale/window_size "
                           "(torch >= 2.11)")
    cu_q = _device_offsets(cu_seqlens, q_offsets, q.device)
    same = cu_seqlens_k is None and k_offsets == q_offsets
    cu_k = cu_q if same else _device_offsets(cu_seqlens_k, k_offsets, q.device)
    max_q = max(b - a for a, b in zip(q_offsets, q_offsets[1:]))
    max_k = max(b - a for a, b in zip(k_offsets, k_offsets[1:]))
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] and _takes_enable_gqa(kernel) else {}
    return kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0) if causal else (-1, -1), **gqa)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    cu_seqlens_k: Sequence[int] | torch.Tensor | None = None,
    scale: float | None = None,
    kv_index: torch.Tensor | None = None,
    prefix_groups: PrefixGroups | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention in BSND (or TND with ``cu_seqlens``); see the module docstring.

    ``kv_index`` (varlen only): k/v are packed tokens and segment i's keys are ``k[kv_index]`` between
    ``cu_seqlens_k[i]`` and ``[i + 1]`` (shared-prompt packing). ``prefix_groups`` (with ``kv_index``, causal)
    describes that layout as (prompt tokens, response tokens...) per group, so that the reference path may
    attend a group in one masked call (:mod:`grpo_npu.ops.attention_reference`).
    """
    varlen = cu_seqlens is not None
    token_dims = 3 if varlen else 4
    if q.dim() != token_dims or k.dim() != token_dims:
        want = "(T, N, D) with cu_seqlens" if varlen else "(B, S, N, D)"
        raise ValueError(f"attention: q/k/v must be {want}, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: head dims differ, q {q.shape[-1]} vs k {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"attention: query heads {q.shape[-2]} must be a multiple of kv heads {k.shape[-2]}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"attention: batch sizes differ, q {q.shape[0]} vs k {k.shape[0]}")
    if attn_mask is not None:
        if varlen:
            raise ValueError("attention: attn_mask cannot be combined with cu_seqlens (varlen is mask-free)")
        if attn_mask.dtype != torch.bool or attn_mask.dim() not in (2, 4):
            raise ValueError(
                f"attention: attn_mask must be bool (Sq, Skv) or (B|1, 1|N, Sq, Skv), got {attn_mask.dtype} "
                f"{tuple(attn_mask.shape)}"
            )
    if cu_seqlens_k is not None and not varlen:
        raise ValueError("attention: cu_seqlens_k needs cu_seqlens")
    if kv_index is not None and (not varlen or kv_index.dim() != 1):
        raise ValueError(f"attention: kv_index must be (Tk,) with cu_seqlens, got {tuple(kv_index.shape)}"
                         f"{'' if varlen else ' without cu_seqlens'}")
    if prefix_groups is not None and (kv_index is None or not causal):
        raise ValueError("attention: prefix_groups needs kv_index and causal=True (shared-prompt packing)")
    q_offsets = k_offsets = None
    if varlen:
        q_offsets = _offsets(cu_seqlens, q.shape[0], "cu_seqlens")
        k_total = k.shape[0] if kv_index is None else kv_index.shape[0]
        k_offsets = _offsets(cu_seqlens if cu_seqlens_k is None else cu_seqlens_k, k_total, "cu_seqlens_k")
        if len(k_offsets) != len(q_offsets):
            raise ValueError(f"attention: cu_seqlens has {len(q_offsets)} entries, cu_seqlens_k {len(k_offsets)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    backend = BACKEND.pick(q)
    cuda_varlen = backend == "cuda" and varlen and _cuda_varlen_fits(q, k, q_offsets, k_offsets)
    if prefix_groups is not None and backend != "npu" and not cuda_varlen:
        return prefix_groups_attention(q, k, v, kv_index=kv_index, groups=prefix_groups, q_offsets=q_offsets,
                                       k_offsets=k_offsets, scale=scale)
    if kv_index is not None:
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
    if backend == "npu":
        impl = _attention_npu
    elif cuda_varlen:
        return _attention_cuda_varlen(q, k, v, causal=causal, q_offsets=q_offsets, k_offsets=k_offsets, scale=scale,
                                      cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k)
    else:
        impl = attention_reference
    return impl(q, k, v, causal=causal, attn_mask=attn_mask, q_offsets=q_offsets, k_offsets=k_offsets, scale=scale)
