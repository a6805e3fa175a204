"""SwiGLU and the gated MLP built on it: ``torch_npu.npu_swiglu`` on Ascend.

``swiglu(x)`` splits the last dim in two halves (a, b) and returns ``silu(a) * b``: the FIRST half
is gated, which is the order the NPU kernel uses. The MLP form (Qwen2/Qwen3/Llama) is
``down(swiglu(cat(gate(x), up(x))))``. The projections stay separate matmuls on purpose: a
concatenated (2I, H) weight would be a fresh tensor saved for backward in every layer, which under
FSDP keeps an unsharded weight copy alive and costs more than the transient (tokens, I) outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo_npu.ops import dispatch

BACKEND = dispatch.register(dispatch.OpBackend("swiglu"))


def set_backend(name: str | None) -> None:
    """Force 'npu' | 'reference' for swiglu (None: automatic)."""
    BACKEND.set(name)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half, over the last dim."""
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """(..., 2*I) -> (..., I): silu(x[..., :I]) * x[..., I:]."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: last dim must be even (gate and up halves), got {x.shape[-1]}")
    if BACKEND.pick(x) == "npu":
        return dispatch.torch_npu().npu_swiglu(x.contiguous(), -1)  # the kernel needs contiguous input
    return swiglu_reference(x)


def gated_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x (..., H), gate/up weights (I, H), down weight (H, I)."""
    if gate_weight.shape != up_weight.shape:
        raise ValueError(f"gated_mlp: gate {tuple(gate_weight.shape)} and up {tuple(up_weight.shape)} differ")
    gate_up = torch.cat((F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)), dim=-1)  # (..., 2I)
    return F.linear(swiglu(gate_up), down_weight, down_bias)
