"""Decoder layers through ``torch.compile`` for the training and log-prob passes (``model.compile_layers``).

On an accelerator, an eager decoder layer is some 45 kernel launches forward and twice that backward, each
a few microseconds of GPU work at RL micro-batch sizes: the pass is bound by the host's dispatch, not by the
device (docs/performance.md, "On an H100": at the Qwen2.5-0.5B shape an update of 4 micro-batches of 16 rows
launched 19,000 kernels, 164 ms of GPU time in 0.87 s). Inductor fuses each layer's elementwise work (norms,
rotary, activation, residuals) into a few kernels around the matmuls.

Each layer's ``forward`` is replaced by a :class:`LayerForward`: the compiled function, except inside
:func:`eager_layers`, where the original eager forward runs. The decoding paths (the static-cache loop,
whose CUDA-graph capture must not meet a compilation, and transformers ``generate`` with its KV cache)
run inside :func:`eager_layers` (``grpo_npu.workers.response_model``); everything else (the update with
its gradient-checkpointing recompute, the old-policy and reference log-probs, the critic) runs compiled.
The switch is one process-wide flag, not a context variable: autograd's backward runs on its own threads,
and a checkpointed layer must recompute through the same function its forward ran.

All layers share one compiled function per code object (dynamo caches per code object and guards on
module attributes, not identity), with dynamic shapes from the first call: micro-batches of every length
reuse it. Training, no-grad and frozen-weight passes each compile once: 4 compilations in all, none per length, in
one process on CPU (35 s + 11 s on the tiny model). With the grpo_npu attention op patched in (prompt sharing), its
graph breaks add more: 34 in the CLI's first two steps on CPU, which then ran slower than eager. On an H100 the CLI
benchmark at the 0.5B shape compiled 7 times in its first two steps (161 s) and then stepped in 1.24 s against
1.06 s eager; hence off by default (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Callable, Iterator

import torch
from torch import nn

_eager = False  # True inside eager_layers()


class LayerForward:
    """A decoder layer's forward: compiled, or the original eager one inside :func:`eager_layers`."""

    def __init__(self, eager: Callable):
        self.eager = eager
        self.compiled = torch.compile(eager, dynamic=True)

    def __call__(self, *args, **kwargs):
        if _eager:
            return self.eager(*args, **kwargs)
        # Shared-prompt packing's layout as Python ints: dynamo would guard on them and recompile for every
        # micro-batch. Without it the attention gathers keys by kv_index and attends per segment (same results).
        kwargs.pop("prefix_groups", None)
        return self.compiled(*args, **kwargs)


def compile_layers(layers: list[nn.Module]) -> None:
    """Route each layer's forward through :class:`LayerForward` (idempotent)."""
    for layer in layers:
        if not isinstance(layer.forward, LayerForward):
            layer.forward = LayerForward(layer.forward)


def compiled(layer: nn.Module) -> bool:
    """Whether :func:`compile_layers` wrapped this layer."""
    return isinstance(layer.forward, LayerForward)


@contextlib.contextmanager
def eager_layers() -> Iterator[None]:
    """Every wrapped layer runs its eager forward for the block (decoding); nests."""
    global _eager
    saved, _eager = _eager, True
    try:
        yield
    finally:
        _eager = saved


def missing_compiler(device_kind: str) -> str | None:
    """Why inductor cannot build kernels for ``device_kind`` here, or None: Triton on CUDA; on the host a C++
    compiler (torch's own check)."""
    if device_kind == "cuda":
        return None if importlib.util.find_spec("triton") is not None else "triton is not installed"
    if device_kind == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as e:  # torch raises RuntimeError (or a subclass) naming what it looked for
            return f"no C++ compiler for inductor ({e})"
        return None
    return f"inductor has no backend for device {device_kind!r} in this build"
