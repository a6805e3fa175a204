"""The one update loop of every trained module: the actor's PPO/GRPO update, the critic's value update, SFT.

Per rank and update: ``epochs`` x mini-batches x micro-batches. Each worker supplies only its loss
for one micro-batch (a :data:`MicroLossFn`); this module does the rest, the same way for all three:

- micro-batches of a fixed row count or packed to a token budget, the same number on every rank
  (:func:`grpo_npu.workers.micro_batch.plan_micro_batches`);
- accumulation: each micro-batch loss is normalised by the GLOBAL token/sequence counts of its
  mini-batch (all micro-batches on all ranks) and scaled by the world size before backward, because
  FSDP averages gradients over ranks; the summed micro-batch gradients then equal the gradient of
  the whole mini-batch loss, whatever the micro-batching and the number of ranks;
- the global gradient norm, clipping to ``grad_clip``, and a skipped step when the norm is not finite;
- one optimizer step per mini-batch, one scheduler step per update;
- parameters and optimizer state on the device for the update only (``param_offload`` /
  ``optimizer_offload``); with ``offload_activations`` the tensors autograd saves between a micro-batch's
  forward and its backward wait in (pinned) host memory (:func:`offloaded_activations`);
- metric sums and maxima accumulated on the device and reduced across ranks once per update.

Every collective here carries float32 (metrics) or int64 (counts): HCCL has no float64 all-reduce,
and one code path serves every device.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from grpo_npu.algo import losses
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import FSDPConfig, OptimConfig
from grpo_npu.device import Device
from grpo_npu.workers import fsdp
from grpo_npu.workers.micro_batch import plan_micro_batches, trim_padding
from grpo_npu.workers.optim import build_optimizer, build_scheduler, optimizer_device, optimizer_kwargs

log = logging.getLogger(__name__)


@dataclass
class MicroLoss:
    """A worker's loss on one micro-batch and the metric parts it contributes."""

    loss: torch.Tensor  # 0-d: this micro-batch's share of the mini-batch loss (global normalisation)
    sums: dict[str, torch.Tensor]  # 0-d parts, summed over micro-batches, mini-batches and ranks
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)  # 0-d parts, maximum over the same


# (trimmed micro-batch on the device, agg_loss keyword arguments num_tokens / num_seqs / horizon of its
# mini-batch) -> MicroLoss. The metric names a function returns must not depend on the rank.
MicroLossFn = Callable[[RolloutBatch, dict], MicroLoss]
# A batch -> its (B, T) loss mask: the tokens the losses count (the response mask less any rows left out).
LossTokensFn = Callable[[RolloutBatch], torch.Tensor]


@dataclass(frozen=True)
class UpdateStats:
    """One update's reduced metrics, equal on every rank."""

    sums: dict[str, float]  # MicroLoss.sums over the whole update and all ranks
    maxes: dict[str, float]  # MicroLoss.maxes likewise
    tokens: int  # valid response tokens the losses saw (all ranks, mini-batches and epochs)
    steps: int  # optimizer steps attempted: mini-batches x epochs
    grad_norm: float  # mean over those steps of the global gradient norm before clipping
    skipped: int  # steps skipped for a non-finite gradient norm
    lr: float  # the learning rate of these steps

    def per_step(self, key: str) -> float:
        """A summed mini-batch loss as the mean over optimizer steps."""
        return self.sums[key] / max(self.steps, 1)

    def per_token(self, key: str) -> float:
        """A token-weighted sum as the mean over valid tokens."""
        return self.sums[key] / max(self.tokens, 1)

    def optimizer_metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>/grad_norm``, ``<prefix>/lr`` and ``<prefix>/skipped_steps``."""
        return {f"{prefix}/grad_norm": self.grad_norm, f"{prefix}/lr": self.lr,
                f"{prefix}/skipped_steps": float(self.skipped)}


class UpdateLoop:
    """A sharded module's optimizer, LR schedule, mini-batch shuffle and update loop.

    ``micro_size`` / ``max_tokens`` plan the micro-batches (``max_tokens`` set: dynamic batch size);
    ``horizon`` is the ``agg_loss`` horizon (data.max_response_length); ``shuffle_seed`` None keeps
    mini-batches in row order.
    """

    def __init__(self, module: nn.Module, dev: Device, optim: OptimConfig, fsdp_cfg: FSDPConfig, *, grad_clip: float,
                 total_steps: int, micro_size: int | None, max_tokens: int | None, horizon: int | None,
                 shuffle_seed: int | None, offload_activations: bool = False):
        self.module = module
        self.dev = dev
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, optim, device_type=optimizer_device(dev, fsdp_cfg))
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps=total_steps)
        self.optim = optim
        self.shuffle = torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
        self.grad_clip = grad_clip
        self.param_offload = fsdp_cfg.param_offload
        self.optimizer_offload = fsdp_cfg.optimizer_offload
        # one gradient reduction per optimizer step (unwrapped: nothing to reduce)
        self.defer_grad_sync = fsdp_cfg.use_no_sync_for_gradient_accumulation and isinstance(module, fsdp.FSDPModule)
        self.micro_size = micro_size
        self.max_tokens = max_tokens
        self.horizon = horizon
        self.offload_activations = offload_activations

    def run(self, batch: RolloutBatch, loss_fn: MicroLossFn, *, epochs: int, mini_batch_size: int,
            shuffle: bool = True, loss_tokens: LossTokensFn | None = None) -> UpdateStats:
        """``epochs`` passes over mini-batches of this rank's rows, one optimizer step each; one scheduler
        step. ``shuffle`` False keeps row order even with a shuffle seed; ``loss_tokens`` (default:
        ``batch.loss_tokens()``) gives the tokens the losses count, for the global normalisation. Collective."""
        self.module.train()
        lr = self.optimizer.param_groups[0]["lr"]
        totals = _Totals()
        grad_norms, skipped = [], 0
        order = self.shuffle if shuffle else None
        with params_on(self.module, self.dev, self.param_offload), \
                optimizer_on(self.optimizer, self.dev, self.optimizer_offload):
            for _ in range(epochs):
                for rows in mini_batches(len(batch), mini_batch_size, order):
                    self.backward_mini_batch(batch.select(rows), loss_fn, totals, loss_tokens)
                    norm, stepped = clip_and_step(self.params, self.optimizer, self.grad_clip)
                    grad_norms.append(norm)
                    skipped += int(not stepped)
        step_scheduler(self.scheduler)
        sums, maxes, tokens = totals.reduce()
        steps = len(grad_norms)
        return UpdateStats(sums=sums, maxes=maxes, tokens=tokens, steps=steps,
                           grad_norm=sum(grad_norms) / max(steps, 1), skipped=skipped, lr=lr)

    def backward_mini_batch(self, mini: RolloutBatch, loss_fn: MicroLossFn, totals: _Totals | None = None,
                            loss_tokens: LossTokensFn | None = None) -> None:
        """Forward/backward every micro-batch of one mini-batch, accumulating gradients (no step). Collective.

        ``totals`` collects the metric parts and the global token count (None: gradients only); the counts
        are of ``loss_tokens(mini)`` (default: ``mini.loss_tokens()``).
        """
        device = self.dev.torch_device()
        num_tokens, num_seqs = global_counts(mini.loss_tokens() if loss_tokens is None else loss_tokens(mini), device)
        agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, horizon=self.horizon)
        groups = plan_micro_batches(mini, size=self.micro_size, max_tokens=self.max_tokens, dev=self.dev)
        scale = dist.get_world_size()  # FSDP averages gradients over ranks; the losses are global sums
        for i, rows in enumerate(groups):
            if self.defer_grad_sync:  # FSDP2 accumulates unsharded gradients until the last micro-batch's backward
                self.module.set_requires_gradient_sync(i == len(groups) - 1)
            with offloaded_activations(self.offload_activations, self.dev):
                out = loss_fn(trim_padding(mini.select(rows)).to(device), agg)
                (out.loss * scale).backward()
            if totals is not None:
                totals.add(out)
        if self.defer_grad_sync:
            self.module.set_requires_gradient_sync(True)
        if totals is not None:
            totals.tokens += num_tokens

    def state_extra(self) -> dict:
        """The scheduler and shuffle state a checkpoint keeps beside the weights and optimizer."""
        return {"scheduler": self.scheduler.state_dict(),
                "shuffle": self.shuffle.get_state() if self.shuffle is not None else None}

    def load_extra(self, extra: dict) -> None:
        """Restore the schedule position and shuffle state; this run's ``*.optim`` settings win.

        The checkpoint's optimizer state carries the peak lr and the other hyperparameters it was written with,
        and the scheduler its peak lr; a resume with changed settings honours the new ones (the trainer warns,
        listing them). The schedule's shape (warmup, style, span) always comes from this run's config.
        """
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.shuffle is not None and extra.get("shuffle") is not None:
            self.shuffle.set_state(extra["shuffle"])
        o = self.optim
        self.scheduler.base_lrs = [o.lr] * len(self.optimizer.param_groups)
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        hyper = optimizer_kwargs(type(self.optimizer), o, None)
        for group in self.optimizer.param_groups:
            group.update({k: v for k, v in hyper.items() if k in group}, lr=o.lr * factor, initial_lr=o.lr)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class _Totals:
    """Running metric sums and maxima (float32) and the token count (int64), on the device."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}
        self.tokens: torch.Tensor | int = 0

    def add(self, out: MicroLoss) -> None:
        for key, value in out.sums.items():
            value = value.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        for key, value in out.maxes.items():
            value = value.detach().float()
            self.maxes[key] = torch.maximum(self.maxes[key], value) if key in self.maxes else value

    def reduce(self) -> tuple[dict[str, float], dict[str, float], int]:
        """(sums, maxima, tokens) over all ranks: one float32 collective per kind; the token count is global already."""
        out = []
        for values, op in ((self.sums, "sum"), (self.maxes, "max")):
            if not values:
                out.append({})
                continue
            packed = fsdp.all_reduce(torch.stack(list(values.values())), op)  # (k,) float32
            out.append(dict(zip(values, packed.tolist())))
        return out[0], out[1], int(self.tokens)


def offloaded_activations(on: bool, dev: Device):
    """Activation offload (verl's ``model.enable_activation_offload``): while on, every tensor autograd saves for
    the backward is copied to host memory when saved and back when the backward reads it
    (``torch.autograd.graph.save_on_cpu``). Under gradient checkpointing those are each layer's inputs and the last
    layer's and the loss's tensors; the recomputed layers keep theirs on the device for their own backward only.
    The device then holds one layer's activations at a time instead of one per layer, for the price of a copy out
    and back of each saved tensor (into pinned host memory on an accelerator: ``device_type``, the device kind, picks
    the torch device module whose pinning the copies use). Gradients are unchanged."""
    if not on:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=dev.is_accelerator, device_type=dev.kind)


def global_counts(mask: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, num_seqs) of a (B, T) response mask summed over ranks: 0-d int64 on ``device``. Collective."""
    num_tokens, num_seqs = losses.agg_counts(mask)
    counts = fsdp.all_reduce(torch.stack([num_tokens, num_seqs]).to(device))  # (2,) int64
    return counts[0], counts[1]


def clip_and_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[float, bool]:
    """Global grad norm (collective), clip to ``max_norm``, step; a non-finite norm skips the step.

    Returns (grad norm before clipping, whether the optimizer stepped). Gradients are cleared either way.
    """
    norm = float(fsdp.grad_norm(params).item())  # one host sync per mini-batch, never per micro-batch
    stepped = math.isfinite(norm)
    if stepped:
        if max_norm > 0 and norm > max_norm:
            fsdp.scale_grads(params, max_norm / (norm + 1e-6))
        optimizer.step()
    else:
        log.warning("non-finite gradient norm %s: optimizer step skipped", norm)
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One schedule step per training step, also when every optimizer step was skipped (no torch warning)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()


def mini_batches(num_rows: int, size: int, shuffle: torch.Generator | None) -> Iterator[list[int]]:
    """Row groups of ``size`` (the last may be smaller), optionally in a shuffled order."""
    order = torch.randperm(num_rows, generator=shuffle).tolist() if shuffle is not None else list(range(num_rows))
    for s in range(0, num_rows, size):
        yield order[s : s + size]


def params_on(module: nn.Module, dev: Device, offload: bool):
    """Parameters on the device for the duration of a phase, back on the host after it (param_offload)."""
    return _on_device(functools.partial(fsdp.move_model, module), dev, offload)


def optimizer_on(optimizer: torch.optim.Optimizer, dev: Device, offload: bool):
    """Optimizer state on the device for an update, on the host after it (optimizer_offload)."""
    return _on_device(functools.partial(fsdp.move_optimizer_state, optimizer), dev, offload)


@contextmanager
def _on_device(move: Callable[[torch.device | str], None], dev: Device, offload: bool) -> Iterator[None]:
    """``move`` to the accelerator for the block and back to the host after it, when ``offload`` is on."""
    offloaded = offload and dev.is_accelerator  # on the host the state never leaves
    if offloaded:
        move(dev.torch_device())
    try:
        yield
    finally:
        if offloaded:
            move("cpu")
            dev.empty_cache()
