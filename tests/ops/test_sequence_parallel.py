"""Ulysses attention on four gloo ranks == the plain attention of the whole packed sequence on one, forward and
backward, for kv heads that the ranks split (4) and fewer kv heads than ranks (2 and 1: each repeated next to
itself, so that every rank's query heads meet their own kv head); heads the ranks cannot split are refused in one
line."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_npu.ops.attention import attention, cu_seqlens_from_lengths
from grpo_npu.ops.sequence_parallel import heads_per_rank

from ..spawn import run_ranks

WORLD_SIZE = 4
KV_HEADS = (4, 2, 1)  # for 8 query heads
TIMEOUT_S = 120
LENGTHS = (5, 9, 2)  # three packed sequences, 16 tokens: 4 per rank, sequences split between ranks


def _inputs(num_kv_heads: int):
    g = torch.Generator().manual_seed(num_kv_heads)
    total = sum(LENGTHS)
    q = torch.randn(total, 8, 8, generator=g)  # (S, Nq, D)
    k, v = (torch.randn(total, num_kv_heads, 8, generator=g) for _ in range(2))
    grad = torch.randn(total, 8, 8, generator=g)
    return q, k, v, grad


def _attend(q, k, v):
    return attention(q, k, v, causal=True, cu_seqlens=cu_seqlens_from_lengths(LENGTHS), scale=8 ** -0.5)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from grpo_npu.ops.sequence_parallel import ulysses_attention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        results = {}
        for num_kv_heads in KV_HEADS:
            q, k, v, grad = _inputs(num_kv_heads)
            s = q.shape[0] // WORLD_SIZE
            mine = slice(rank * s, (rank + 1) * s)
            ql, kl, vl = (t[mine].clone().requires_grad_() for t in (q, k, v))
            out = ulysses_attention(ql, kl, vl, dist.group.WORLD, _attend)
            out.backward(grad[mine])
            results[num_kv_heads] = (out.detach(), ql.grad, kl.grad, vl.grad)
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out_dir, f"rank{rank}.pt"))


def test_ulysses_attention_equals_whole_sequence_attention(tmp_path):
    from grpo_npu.workers.fsdp import free_port

    run_ranks(_rank_main, (free_port(), str(tmp_path)), WORLD_SIZE, TIMEOUT_S, f"the {WORLD_SIZE}-rank attention")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    for num_kv_heads in KV_HEADS:
        q, k, v, grad = _inputs(num_kv_heads)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = _attend(q, k, v)
        out.backward(grad)
        for i, want in enumerate((out.detach(), q.grad, k.grad, v.grad)):
            got = torch.cat([r[num_kv_heads][i] for r in ranks])  # each rank's own tokens, in rank order
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"kv heads {num_kv_heads}, output {i}")


def test_heads_the_ranks_cannot_split_are_named():
    assert heads_per_rank(4, 2, 2) is None and heads_per_rank(4, 1, 2) is None and heads_per_rank(14, 2, 2) is None
    assert heads_per_rank(14, 2, 4) == "the model's 14 attention heads do not divide into 4 equal parts"
    assert heads_per_rank(12, 3, 2) == "the model's 3 key/value heads neither divide into 2 equal parts nor divide 2"
