"""AdamW and the learning-rate schedule (``*.optim.*`` keys): linear warmup, then constant or cosine.

The schedule is a multiplier of the peak ``lr`` as a function of the optimizer step s (0-based):
- warmup (s < W): s / W, so the first step of a warmed-up run uses lr 0, as in verl / transformers;
- constant: 1;
- cosine: min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(2 pi num_cycles p)),
  p = (s - W) / (S - W) clamped to [0, 1], S = total steps (num_cycles 0.5: one decay to the floor).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from grpo_npu.config import OptimConfig
from grpo_npu.workers.names import OPTIM_IMPLS, WARMUP_STYLES

# Devices whose fused AdamW kernel torch itself ships (torch_npu's fused AdamW is not among the ops docs/npu.md lists: NPU gets foreach).
FUSED_DEVICES = ("cpu", "cuda")


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig, *, device_type: str) -> torch.optim.AdamW:
    """AdamW over ``params`` with the ``*.optim`` settings (sharded DTensors are fine: the update is elementwise).

    ``optim.impl``: auto = fused where torch ships the kernel for ``device_type`` (the device the update
    runs on), else foreach. The fused step reads and writes each parameter, gradient and moment once;
    torch's CPU default, the per-tensor loop, makes about ten passes (measured 0.2-0.3 s against 0.9-2.4 s per
    step for 494M fp32 parameters on this project's 2-core CPU). All three give the same update up to rounding.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    impl = resolve_impl(optim.impl, device_type)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                             weight_decay=optim.weight_decay, **kwargs)


def optimizer_device(dev, fsdp_cfg) -> str:
    """The device kind the optimizer step runs on: the host under FSDP2's CPUOffloadPolicy, else ``dev``."""
    return "cpu" if fsdp_cfg.offload_policy else dev.kind


def resolve_impl(impl: str, device_type: str) -> str:
    """``optim.impl`` -> fused | foreach | for_loop for an update on ``device_type``."""
    if impl not in OPTIM_IMPLS:
        raise ValueError(f"optim.impl: unknown value {impl!r}; known: {', '.join(OPTIM_IMPLS)}")
    if impl == "auto":
        return "fused" if device_type in FUSED_DEVICES else "foreach"
    if impl == "fused" and device_type not in FUSED_DEVICES:
        raise ValueError(f"optim.impl=fused: torch has no fused AdamW for device {device_type!r} "
                         f"(fused on: {', '.join(FUSED_DEVICES)}); use optim.impl=foreach or auto")
    return impl


def warmup_steps(total_steps: int, lr_warmup_steps: int, lr_warmup_steps_ratio: float) -> int:
    """``optim.lr_warmup_steps`` when >= 0, else ``lr_warmup_steps_ratio`` x total steps (rounded down)."""
    if lr_warmup_steps >= 0:
        return lr_warmup_steps
    return int(lr_warmup_steps_ratio * max(total_steps, 0))


def lr_multiplier(
    step: int, *, total_steps: int, warmup: int, style: str, min_lr_ratio: float, num_cycles: float
) -> float:
    """The factor applied to the peak lr at optimizer step ``step`` (see the module docstring)."""
    if step < warmup:
        return step / warmup
    if style == "constant":
        return 1.0
    if style == "cosine":
        progress = min(max((step - warmup) / max(1, total_steps - warmup), 0.0), 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress))
    raise ValueError(f"optim.warmup_style: unknown value {style!r}; known: {', '.join(WARMUP_STYLES)}")


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, *,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepping once per training step with the ``*.optim`` schedule.

    The schedule spans ``optim.total_training_steps`` when > 0, else ``total_steps`` (the run's); a
    span <= 0 is only allowed for a constant lr without a warmup ratio.
    """
    span = optim.total_training_steps if optim.total_training_steps > 0 else total_steps
    style = optim.warmup_style
    if style not in WARMUP_STYLES:
        raise ValueError(f"optim.warmup_style: unknown value {style!r}; known: {', '.join(WARMUP_STYLES)}")
    if style == "cosine" and span <= 0:
        raise ValueError("optim.warmup_style=cosine needs the total number of training steps (optim.total_training_steps)")
    if optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio > 0 and span <= 0:
        raise ValueError("optim.lr_warmup_steps_ratio > 0 needs the total number of training steps")
    warmup = warmup_steps(span, optim.lr_warmup_steps, optim.lr_warmup_steps_ratio)

    def multiplier(step: int) -> float:
        return lr_multiplier(step, total_steps=span, warmup=warmup, style=style, min_lr_ratio=optim.min_lr_ratio,
                             num_cycles=optim.num_cycles)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
