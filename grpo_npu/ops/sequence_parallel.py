"""Ulysses sequence parallelism inside attention: each rank of a group of ``sp`` ranks holds a contiguous 1/sp of
a packed sequence's tokens, all heads; attention needs every token, so around it two all-to-alls swap that for all
tokens, 1/sp of the heads (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509; verl's ``verl/utils/ulysses.py``
does the same). Everything outside attention (projections, norms, MLP, rotary with each token's own position id) is
per token and runs on the rank's own slice.

Shapes (packed TND, as :func:`grpo_npu.ops.attention.attention` takes them): s = tokens on this rank, S = s * sp,
N heads, D head dim.

- :func:`seq_to_heads`: (s, N, D) -> (S, N / sp, D); rank j receives head chunk j of every rank's tokens, in rank
  order, so its S rows are the whole sequence in order.
- :func:`heads_to_seq`: the inverse, (S, N / sp, D) -> (s, N, D).
- :func:`ulysses_attention`: both around an attention call. Key/value heads that ``sp`` does not divide (GQA with
  fewer kv heads than ranks) are repeated first, each kv head next to itself, so head chunk j of the queries meets
  the kv head its query heads read.

Both all-to-alls are ``torch.distributed.all_to_all_single`` in an autograd function (:class:`AllToAll`) whose
backward is the same all-to-all of the gradients: they reach the ranks that own the tokens. :class:`SumOverGroup`
is the sum all-reduce whose backward sums the gradients the same way (the workers' gather of predictions). The plain single-rank attention is the reference
(``tests/ops/test_sequence_parallel.py`` compares the two, forward and backward, on gloo).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


def heads_per_rank(num_heads: int, num_kv_heads: int, sp: int) -> str | None:
    """Why ``sp`` ranks cannot split these heads (None when they can): the query heads must divide evenly, and the
    kv heads either divide evenly or divide ``sp`` (then each is repeated)."""
    if num_heads % sp:
        return f"the model's {num_heads} attention heads do not divide into {sp} equal parts"
    if num_kv_heads % sp and sp % num_kv_heads:
        return f"the model's {num_kv_heads} key/value heads neither divide into {sp} equal parts nor divide {sp}"
    return None


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits over dim 0 (chunk j of every rank goes to rank j); its own backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous too: the collective writes its chunks as flat memory
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # a gradient may arrive strided; empty_like would copy its strides
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)  # chunk i of rank j's gradient back to rank i
        return out, None


class SumOverGroup(torch.autograd.Function):
    """The sum of ``x`` over the ranks of ``group`` on each of them; the backward sums the ranks' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(s, N, D) this rank's tokens, all heads -> (S, N / sp, D) every token, this rank's heads. Collective."""
    sp = dist.get_world_size(group)
    s, n, d = x.shape
    send = x.reshape(s, sp, n // sp, d).transpose(0, 1).contiguous()  # (sp, s, N/sp, D): chunk j goes to rank j
    return AllToAll.apply(send, group).reshape(sp * s, n // sp, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(S, N / sp, D) every token, this rank's heads -> (s, N, D) this rank's tokens, all heads. Collective."""
    sp = dist.get_world_size(group)
    total, h, d = x.shape
    send = x.reshape(sp, total // sp, h, d).contiguous()  # token chunk j goes back to rank j
    received = AllToAll.apply(send, group)  # (sp, s, N/sp, D): rank i's heads
    return received.transpose(0, 1).reshape(total // sp, sp * h, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``attend`` over the whole sequence for this rank's heads, from and back to this rank's tokens.

    q (s, Nq, D), k/v (s, Nkv, D) -> (s, Nq, D). ``attend`` takes (S, Nq/sp, D), (S, Nkv'/sp, D) x 2 and reads the
    packing (cu_seqlens over all S tokens) itself. Collective over ``group``.
    """
    sp = dist.get_world_size(group)
    reason = heads_per_rank(q.shape[1], k.shape[1], sp)
    if reason is not None:
        raise ValueError(f"ulysses_sequence_parallel_size={sp}: {reason}")
    if k.shape[1] % sp:  # fewer kv heads than ranks: kv head i serves query chunks i*r .. i*r + r - 1
        repeat = sp // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = attend(seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group))
    return heads_to_seq(out, group)
