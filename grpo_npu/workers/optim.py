"""The optimizer and the learning-rate schedule (``*.optim.*`` keys): linear warmup, then constant or cosine.

The optimizer is verl's: the class ``optim.optimizer`` of the module ``optim.optimizer_impl`` (default
torch.optim.AdamW), given lr and weight_decay, betas when its name contains adam or ademamix, eps when set,
then ``override_optimizer_config`` on top. The parameters are FSDP2 shards (DTensors): an optimizer that
works elementwise (AdamW, Adam, SGD, ...) updates them as it would the full tensors.

The schedule is a multiplier of the peak ``lr`` as a function of the optimizer step s (0-based):
- warmup (s < W): s / W, so the first step of a warmed-up run uses lr 0, as in verl / transformers;
- constant: 1;
- cosine: min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(2 pi num_cycles p)),
  p = (s - W) / (S - W) clamped to [0, 1], S = total steps (num_cycles 0.5: one decay to the floor);
  with ``zero_indexed_step=False`` s counts from 1 (warmup included), as verl's cosine schedule does then.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any, Iterable

import torch

from grpo_npu.config import OptimConfig
from grpo_npu.errors import UserError
from grpo_npu.workers.names import OPTIM_IMPLS, WARMUP_STYLES

# Devices whose fused AdamW kernel torch itself ships (torch_npu's fused AdamW is not among the ops docs/npu.md lists: NPU gets foreach).
FUSED_DEVICES = ("cpu", "cuda")
# The torch.optim classes optim.impl=auto steps fused where FUSED_DEVICES allow (the others: foreach).
AUTO_FUSED = ("AdamW", "Adam")


def optimizer_class(optim: OptimConfig, where: str = "optim") -> type:
    """The class ``optim.optimizer`` of the module ``optim.optimizer_impl``; a one-line error naming the keys."""
    try:
        module = importlib.import_module(optim.optimizer_impl)
    except Exception as exc:  # not installed, or a package that fails on this machine (e.g. a GPU-only build)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{where}.optimizer_impl={optim.optimizer_impl}: cannot import it ({first}); install the "
                         "package or name a module that defines the optimizer") from None
    cls = getattr(module, optim.optimizer, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        found = sorted(n for n, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, torch.optim.Optimizer) and not n.startswith("_"))
        raise ValueError(f"{where}.optimizer={optim.optimizer}: {optim.optimizer_impl} has no torch.optim.Optimizer "
                         f"of that name (it has: {', '.join(found) or 'none'})")
    return cls


def optimizer_kwargs(cls: type, optim: OptimConfig, device_type: str | None, where: str = "optim") -> dict[str, Any]:
    """The keyword arguments ``cls`` is built with; ``device_type`` None leaves out the step implementation
    (the hyperparameters alone, e.g. to restore them on resume). Every name is checked against ``cls``."""
    kwargs: dict[str, Any] = {"lr": optim.lr, "weight_decay": optim.weight_decay}
    name = optim.optimizer.lower()
    if "adam" in name or "ademamix" in name:  # verl's rule for passing betas
        kwargs["betas"] = tuple(optim.betas)
    if optim.eps is not None:
        kwargs["eps"] = optim.eps
    if device_type is not None:
        kwargs.update(_step_impl(cls, optim, device_type, where))
    kwargs.update(optim.override_optimizer_config or {})
    params = _init_parameters(cls)
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in kwargs:
            if key not in params:
                source = (f"{where}.override_optimizer_config.{key}" if key in (optim.override_optimizer_config or {})
                          else f"{where}.{'impl' if key in ('fused', 'foreach') else key}")
                raise ValueError(f"{source}: {cls.__module__}.{cls.__name__} takes no argument {key!r} (it takes: "
                                 f"{', '.join(n for n in params if n not in ('self', 'params'))})")
    return kwargs


def _init_parameters(cls: type) -> Any:
    """The parameters of ``cls.__init__``, None where Python cannot see them (a compiled extension's class)."""
    try:
        return inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None


def _step_impl(cls: type, optim: OptimConfig, device_type: str, where: str) -> dict[str, bool]:
    """``optim.impl`` as the fused / foreach arguments of a torch.optim class; nothing for other classes at auto."""
    impl = resolve_impl(optim.impl, device_type)
    params = _init_parameters(cls) or {}
    if optim.impl == "auto":
        if not cls.__module__.startswith("torch.optim"):
            return {}
        if cls.__name__ not in AUTO_FUSED and impl == "fused":
            impl = "foreach"
        if impl == "foreach" and "foreach" not in params:
            return {}
    wanted = "fused" if impl == "fused" else "foreach"
    if wanted not in params:
        raise ValueError(f"{where}.impl={optim.impl}: {cls.__module__}.{cls.__name__} has no {wanted!r} argument; "
                         "use impl=auto")
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def check_optimizers(cfg, *, use_critic: bool) -> None:
    """The actor's (and critic's) optimizer, checked before workers start as far as the device does not matter:
    the class imports and takes every argument it would be given (impl's fused / foreach included); a one-line
    UserError naming the key otherwise."""
    roles = {"actor_rollout_ref.actor.optim": cfg.actor_rollout_ref.actor.optim}
    if use_critic:
        roles["critic.optim"] = cfg.critic.optim
    for where, optim in roles.items():
        try:
            optimizer_kwargs(optimizer_class(optim, where), optim, "cpu", where)
        except ValueError as exc:
            raise UserError(str(exc)) from None


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig, *, device_type: str) -> torch.optim.Optimizer:
    """The ``*.optim`` optimizer over the trainable ``params`` (sharded DTensors are fine, see the module docstring).

    ``optim.impl``: auto = fused AdamW / Adam where torch ships the kernel for ``device_type`` (the device
    the update runs on), else foreach where the class has it. The fused step reads and writes each
    parameter, gradient and moment once; torch's CPU default, the per-tensor loop, makes about ten passes
    (measured 0.2-0.3 s against 0.9-2.4 s per step for 494M fp32 parameters on this project's 2-core CPU).
    All three give the same update up to rounding.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    cls = optimizer_class(optim)
    return cls(params, **optimizer_kwargs(cls, optim, device_type))


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
    step: int, *, total_steps: int, warmup: int, style: str, min_lr_ratio: float, num_cycles: float,
    zero_indexed_step: bool = True,
) -> float:
    """The factor applied to the peak lr at optimizer step ``step`` (see the module docstring)."""
    if style == "cosine" and not zero_indexed_step:
        step += 1
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
                             num_cycles=optim.num_cycles, zero_indexed_step=optim.zero_indexed_step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
