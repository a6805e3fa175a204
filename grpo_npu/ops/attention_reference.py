"""The attention op's plain-PyTorch path: torch SDPA per batch (padded) or per segment (varlen), and shared-prompt
groups in one masked call where that is cheaper.

Layouts and the bottom-right causal alignment are :mod:`grpo_npu.ops.attention`'s. This path serves every device
without a kernel of its own (the CPU, CUDA in fp32, anything the NPU/CUDA kernels do not take).

Shared-prompt packing (``grpo_npu.workers.model_inputs.shared_prefix_inputs``) lays out each group as its prompt
followed by its responses; a prompt attends causally to itself, a response to the whole prompt and causally to
itself. Per segment that is 1 + n SDPA calls per group and layer, with keys gathered per response. Short
segments make those calls mostly fixed cost: on the CPU (2 threads) a call costs about as much as 1.2M
multiply-adds of attention work (query-key pairs x query heads x head dim), while a GRPO response of 13 tokens
against a 37-token prompt is 0.07M at 4 heads of 32. :func:`prefix_groups_attention` then computes the group in one SDPA call over
its own tokens with an additive (L, L) mask: more pairs (the masked ones are computed too) in fewer calls. It
takes the one call where the extra pairs cost less than the calls saved (:func:`one_call_pays`); at the tiny
model's shapes (4 heads of 32, groups of 56-190 tokens) that halves the attention's time, forward and backward
(docs/performance.md, "Session 14"); longer groups keep their per-segment calls, and no group over
ONE_CALL_MAX_TOKENS takes one, so the masks stay small.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

CACHED_MASK_ELEMENTS = 64 * 1024  # causal masks up to this size are kept (at most 1024 of them: <= 64 MiB)
# One SDPA call's fixed cost, in multiply-adds of attention work (query-key pairs x query heads x head dim), and
# how much more a pair costs in a short segment's call than in a group's masked one: torch 2.13's CPU flash
# attention, 2 threads, 4-14 query heads of 32-64 (fits 12 measured shapes, fwd and fwd+bwd: docs/performance.md).
CALL_COST_MULTIPLY_ADDS = 1.2e6
SEGMENT_PAIR_COST = 1.6
# Groups up to this many tokens may take one call: their (L, L) fp32 mask is at most 1 MiB, and the masks of a
# micro-batch hold at most this many values per token (memory linear in the tokens, never quadratic).
ONE_CALL_MAX_TOKENS = 512


def _cached_when_small(build):
    """``build(sq, skv, ...)`` with results of at most CACHED_MASK_ELEMENTS elements cached (at most 1024 of them):
    varlen attention asks for one mask per segment, in every layer. Never modify a result."""
    cached = functools.lru_cache(maxsize=1024)(build)

    @functools.wraps(build)
    def get(sq: int, skv: int, *args):
        return (cached if sq * skv <= CACHED_MASK_ELEMENTS else build)(sq, skv, *args)

    return get


@_cached_when_small
def bottom_right_causal(sq: int, skv: int, device: torch.device) -> torch.Tensor:
    """(Sq, Skv) bool, True where query i may see key j (j <= i + Skv - Sq)."""
    return torch.ones(sq, skv, dtype=torch.bool, device=device).tril(diagonal=skv - sq)


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as the additive one torch SDPA makes of it on every call: 0 where seen, -inf
    elsewhere (same values, so the same results)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


@_cached_when_small
def causal_bias(sq: int, skv: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(Sq, Skv) additive mask of :func:`bottom_right_causal`."""
    return _additive(bottom_right_causal(sq, skv, device), dtype)


def _sdpa_bhsd(q, k, v, causal: bool, attn_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """torch SDPA on (B, N, S, D) with a bottom-right aligned ``causal`` -> (B, Nq, Sq, D)."""
    sq, skv = q.shape[2], k.shape[2]
    if causal and (attn_mask is not None or sq != skv):  # SDPA's is_causal is top-left aligned
        if attn_mask is None:
            attn_mask = causal_bias(sq, skv, q.dtype, q.device)
        else:
            attn_mask = attn_mask & bottom_right_causal(sq, skv, q.device)
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _sdpa_bsnd(q, k, v, causal: bool, attn_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    out = _sdpa_bhsd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, attn_mask, scale)
    return out.transpose(1, 2)  # (B, Sq, Nq, D)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        attn_mask: torch.Tensor | None, q_offsets: list[int] | None, k_offsets: list[int] | None,
                        scale: float) -> torch.Tensor:
    """torch SDPA per batch (padded) or per sequence (varlen)."""
    if q_offsets is None:
        return _sdpa_bsnd(q, k, v, causal, attn_mask, scale)
    q_lens = [qe - qs for qs, qe in zip(q_offsets, q_offsets[1:])]
    k_lens = [ke - ks for ks, ke in zip(k_offsets, k_offsets[1:])]
    outs = []
    # Heads first once, then split, not sliced: each segment is a (1, N, S, D) view with the strides SDPA saw when
    # every segment was transposed on its own (the same results, a few view ops less per segment), and one backward
    # node concatenates the segments' gradients, where a slice each would scatter its gradient into a zero tensor.
    q_h, k_h, v_h = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (N, T, D)
    for qs, q_seg, k_seg, v_seg in zip(q_offsets, q_h.split(q_lens, 1), k_h.split(k_lens, 1), v_h.split(k_lens, 1)):
        if not q_seg.shape[1]:
            continue
        if not k_seg.shape[1]:
            raise ValueError(f"attention: query tokens {qs}:{qs + q_seg.shape[1]} have no keys (empty kv segment)")
        out = _sdpa_bhsd(q_seg.unsqueeze(0), k_seg.unsqueeze(0), v_seg.unsqueeze(0), causal, None, scale)
        outs.append(out.squeeze(0).transpose(0, 1))  # (S, Nq, D); squeeze, not [0]: its backward is a view
    return outs[0] if len(outs) == 1 else torch.cat(outs)


PrefixGroups = Sequence[tuple[int, Sequence[int]]]  # per group: (prompt tokens, each response's tokens), packed order


def one_call_pays(prompt_len: int, response_lens: Sequence[int], width: int) -> bool:
    """Whether one masked call over the group beats its 1 + n segment calls, at ``width`` = query heads x head dim.

    The masked call computes all L^2 pairs; the segments compute only the pairs they attend (a causal prompt, each
    response against the prompt and causally itself), each at SEGMENT_PAIR_COST, and pay CALL_COST_MULTIPLY_ADDS
    for each call beyond the first. Never for an empty group or one over ONE_CALL_MAX_TOKENS."""
    length = prompt_len + sum(response_lens)
    if not length or length > ONE_CALL_MAX_TOKENS:
        return False
    attended = prompt_len * (prompt_len + 1) // 2 + sum(r * prompt_len + r * (r + 1) // 2 for r in response_lens)
    extra = (length * length - SEGMENT_PAIR_COST * attended) * width
    return extra <= len(response_lens) * CALL_COST_MULTIPLY_ADDS


def prefix_group_bias(prompt_len: int, response_lens: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """(L, L) additive mask of one group (0 = attend, -inf = not): the prompt causal on itself, each response on
    the whole prompt and causally on itself."""
    length = prompt_len + sum(response_lens)
    keep = torch.zeros(length, length, dtype=torch.bool, device=device)
    keep[:prompt_len, :prompt_len] = bottom_right_causal(prompt_len, prompt_len, device)
    start = prompt_len
    for r in response_lens:
        keep[start:start + r, :prompt_len] = True
        keep[start:start + r, start:start + r] = bottom_right_causal(r, r, device)
        start += r
    return _additive(keep, dtype)


class _Chunk(NamedTuple):
    """Consecutive tokens attended one way: one group's masked call (``bias``), or a run of segment calls (None)."""

    bias: torch.Tensor | None
    q_len: int  # its tokens (queries; also its keys, not gathered)
    k_len: int  # its gathered keys
    q_offsets: list[int]  # its segments' offsets, from 0
    k_offsets: list[int]


class _GroupPlan:
    """One layout's chunks: each group that :func:`one_call_pays` for alone, the groups between them as runs of
    segment calls; and the layout's segment offsets, to check a call against."""

    def __init__(self, groups: tuple[tuple[int, tuple[int, ...]], ...], width: int, dtype: torch.dtype,
                 device: torch.device):
        self.q_offsets, self.k_offsets, self.chunks = [0], [0], []
        run = 0  # the first segment not in a chunk yet
        for prompt_len, response_lens in groups:
            if prompt_len < 0 or any(r <= 0 for r in response_lens):
                raise ValueError(f"attention: prefix_groups needs prompt lengths >= 0 and response lengths > 0, got "
                                 f"({prompt_len}, {response_lens})")
            first = len(self.q_offsets) - 1
            for q_len, k_len in [(prompt_len, prompt_len), *((r, prompt_len + r) for r in response_lens)]:
                self.q_offsets.append(self.q_offsets[-1] + q_len)
                self.k_offsets.append(self.k_offsets[-1] + k_len)
            if one_call_pays(prompt_len, response_lens, width):
                self._add_chunk(run, first, None)
                self._add_chunk(first, len(self.q_offsets) - 1,
                                prefix_group_bias(prompt_len, response_lens, dtype, device))
                run = len(self.q_offsets) - 1
        self._add_chunk(run, len(self.q_offsets) - 1, None)

    def _add_chunk(self, first: int, end: int, bias: torch.Tensor | None) -> None:
        if first == end:
            return
        qs, ks = self.q_offsets[first], self.k_offsets[first]
        self.chunks.append(_Chunk(bias, self.q_offsets[end] - qs, self.k_offsets[end] - ks,
                                  [o - qs for o in self.q_offsets[first:end + 1]],
                                  [o - ks for o in self.k_offsets[first:end + 1]]))


_recent_plans: list[tuple[tuple, _GroupPlan]] = []  # ((groups, width, dtype, device), plan), newest first


def _plan(groups: PrefixGroups, width: int, dtype: torch.dtype, device: torch.device) -> _GroupPlan:
    """The plan of ``groups``: every layer and pass of a micro-batch hands over the same layout, so the last two
    plans (masks included) are kept."""
    key = (tuple((int(p), tuple(int(r) for r in rs)) for p, rs in groups), width, dtype, device)
    for known, plan in _recent_plans:
        if known == key:
            return plan
    plan = _GroupPlan(key[0], width, dtype, device)
    _recent_plans[:] = [(key, plan), *_recent_plans[:1]]
    return plan


def prefix_groups_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kv_index: torch.Tensor,
                            groups: PrefixGroups, q_offsets: list[int], k_offsets: list[int],
                            scale: float) -> torch.Tensor:
    """Causal shared-prefix attention over packed groups: q (T, Nq, D), k/v (T, Nkv, D) the same tokens (not
    gathered); ``kv_index``/``q_offsets``/``k_offsets`` the per-segment layout that ``groups`` describes.

    Each group is one masked SDPA call where :func:`one_call_pays`, else its segments' calls over keys gathered by
    ``kv_index`` (as :func:`attention_reference`). Raises ValueError when the offsets are not the groups' layout.
    """
    plan = _plan(groups, q.shape[1] * q.shape[2], q.dtype, q.device)
    if plan.q_offsets != q_offsets or plan.k_offsets != k_offsets or k.shape[0] != q.shape[0]:
        raise ValueError(f"attention: prefix_groups describe {len(groups)} groups of {plan.q_offsets[-1]} "
                         f"tokens, not this call's segments (cu_seqlens {q_offsets[:6]}..., {k.shape[0]} key tokens)")
    chunks = plan.chunks

    def parts(t: torch.Tensor, lengths: list[int]) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
        # Split, not sliced: one backward node concatenates the chunks' gradients (a slice each would scatter its
        # gradient into a zero tensor of the whole batch).
        return [t] if len(lengths) == 1 else t.split(lengths)

    q_parts, k_parts, v_parts = (parts(t, [c.q_len for c in chunks]) for t in (q, k, v))
    gk_parts = gv_parts = None
    if any(c.bias is None for c in chunks):  # keys gathered for the segment calls
        gk_parts, gv_parts = (parts(t.index_select(0, kv_index), [c.k_len for c in chunks]) for t in (k, v))
    outs = []
    for i, chunk in enumerate(chunks):
        if chunk.bias is None:
            outs.append(attention_reference(q_parts[i], gk_parts[i], gv_parts[i], causal=True, attn_mask=None,
                                            q_offsets=chunk.q_offsets, k_offsets=chunk.k_offsets, scale=scale))
            continue
        q_g, k_g, v_g = (t[i].transpose(0, 1)[None] for t in (q_parts, k_parts, v_parts))  # (1, N, L, D)
        outs.append(_sdpa_bhsd(q_g, k_g, v_g, False, chunk.bias, scale).squeeze(0).transpose(0, 1))  # (L, Nq, D)
    return outs[0] if len(outs) == 1 else torch.cat(outs)
