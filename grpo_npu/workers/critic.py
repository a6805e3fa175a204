"""The PPO critic: a value head on the policy checkpoint (``critic.model.path``), FSDP2-sharded.

The value model is transformers' ``AutoModelForTokenClassification`` with one label (a fresh linear
``score`` head on the decoder, no dropout). Like the actor's log-probs, the value of response token
j is read from the hidden state at position P + j - 1 (the state before the token is emitted), and
only the N valid response positions go through the head. The update mirrors the actor's:
mini-batches x micro-batches, the clipped value loss from :mod:`grpo_npu.algo.losses` with global
token counts, gradient clipping, a non-finite norm skipping the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_npu.algo import losses
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import CriticConfig, Derived
from grpo_npu.device import Device
from grpo_npu.workers import fsdp
from grpo_npu.workers.actor import (
    ModelInputs,
    ResponseModel,
    optimizer_on,
    build_inputs,
    clip_and_step,
    forward_in_micro_batches,
    mini_batches,
    params_on,
    plan_micro_batches,
    scatter_valid,
    step_scheduler,
)
from grpo_npu.workers.micro_batch import trim_padding
from grpo_npu.workers.optim import build_optimizer, build_scheduler, optimizer_device

_SUM_KEYS = ("vf_loss", "vf_clipfrac", "vpred_mean", "tokens")


class ValueHead(ResponseModel):
    """forward -> values (b, T) fp32 at the valid response positions (0 elsewhere)."""

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        h = self.hidden_at_predictions(inputs)  # (N, H)
        values = self.hf.score(h)[:, 0].float()  # (N,)
        return scatter_valid(values, inputs.response_valid)


class Critic:
    """Sharded value model + AdamW + schedule: ``compute_values`` and ``update``."""

    def __init__(self, module: ValueHead, dev: Device, cfg: CriticConfig, derived: Derived, *,
                 default_agg_mode: str, default_epochs: int, default_dynamic_bsz: bool, total_steps: int, seed: int):
        self.module = module
        self.dev = dev
        self.cfg = cfg
        self.derived = derived
        self.remove_padding = cfg.model.use_remove_padding
        self.agg_mode = cfg.loss_agg_mode or default_agg_mode
        self.epochs = cfg.ppo_epochs or default_epochs
        self.dynamic_bsz = cfg.use_dynamic_bsz if cfg.use_dynamic_bsz is not None else default_dynamic_bsz
        self.param_offload = cfg.model.fsdp_config.param_offload
        self.params = [p for p in module.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = build_optimizer(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                         impl=o.impl, device_type=optimizer_device(dev, cfg.model.fsdp_config))
        self.scheduler = build_scheduler(
            self.optimizer, total_steps=o.total_training_steps if o.total_training_steps > 0 else total_steps,
            lr_warmup_steps=o.lr_warmup_steps, lr_warmup_steps_ratio=o.lr_warmup_steps_ratio,
            warmup_style=o.warmup_style, min_lr_ratio=o.min_lr_ratio, num_cycles=o.num_cycles,
        )
        self.shuffle = torch.Generator().manual_seed(seed) if cfg.shuffle else None
        if self.param_offload and dev.is_accelerator:
            fsdp.move_model(module, "cpu")

    def forward(self, micro: RolloutBatch) -> torch.Tensor:
        return self.module(build_inputs(micro.to(self.dev.torch_device()), self.remove_padding))

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """(B, T) float32 values of this rank's rows, on the host. Collective."""
        cfg = self.cfg
        self.module.eval()
        size = cfg.forward_micro_batch_size_per_gpu or self.derived.critic_micro_batch_per_rank
        budget = cfg.forward_max_token_len_per_gpu or cfg.ppo_max_token_len_per_gpu
        groups = plan_micro_batches(batch, size=size, max_tokens=budget if self.dynamic_bsz else None, dev=self.dev)
        with params_on(self.module, self.dev, self.param_offload):
            (values,) = forward_in_micro_batches(self.forward, batch, groups, batch.response_ids.shape[1])
            fsdp.reshard_all(self.module)
        return values

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Value-loss epochs over mini-batches; needs values (the old ones) and returns. Collective."""
        if batch.values is None or batch.returns is None:
            raise ValueError("update_critic: the batch needs values and returns")
        dev = self.dev
        self.module.train()
        lr = self.optimizer.param_groups[0]["lr"]
        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=dev.torch_device())
        grad_norms, skipped = [], 0
        with params_on(self.module, dev, self.param_offload), \
                optimizer_on(self.optimizer, dev, self.cfg.model.fsdp_config.optimizer_offload):
            for _ in range(self.epochs):
                for rows in mini_batches(len(batch), self.derived.critic_mini_batch_responses_per_rank, self.shuffle):
                    sums += self.backward_mini_batch(batch.select(rows))
                    norm, stepped = clip_and_step(self.params, self.optimizer, self.cfg.grad_clip)
                    grad_norms.append(norm)
                    skipped += int(not stepped)
        step_scheduler(self.scheduler)
        fsdp.all_reduce(sums)
        total = dict(zip(_SUM_KEYS, sums.tolist()))
        steps, tokens = max(len(grad_norms), 1), max(total["tokens"], 1.0)
        return {
            "critic/vf_loss": total["vf_loss"] / steps,
            "critic/vf_clipfrac": total["vf_clipfrac"] / tokens,
            "critic/vpred_mean": total["vpred_mean"] / tokens,
            "critic/grad_norm": sum(grad_norms) / steps,
            "critic/lr": lr,
            "critic/skipped_steps": float(skipped),
        }

    def backward_mini_batch(self, mini: RolloutBatch) -> torch.Tensor:
        """Forward/backward every micro-batch of one mini-batch (no step); returns local metric sums. Collective."""
        cfg, dev = self.cfg, self.dev
        num_tokens, num_seqs = losses.agg_counts(mini.response_mask)
        counts = fsdp.all_reduce(torch.stack([num_tokens, num_seqs]).to(dev.torch_device()))
        agg = dict(num_tokens=counts[0], num_seqs=counts[1], horizon=self.derived.response_length)
        groups = plan_micro_batches(mini, size=self.derived.critic_micro_batch_per_rank,
                                    max_tokens=cfg.ppo_max_token_len_per_gpu if self.dynamic_bsz else None, dev=dev)
        scale = dist.get_world_size()  # FSDP averages gradients over ranks; the losses are global sums
        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=dev.torch_device())
        for rows in groups:
            micro = trim_padding(mini.select(rows)).to(dev.torch_device())
            values = self.forward(micro)
            loss, m = losses.value_loss(values, micro.values, micro.returns, micro.response_mask,
                                        clip_range=cfg.cliprange_value, agg_mode=self.agg_mode, **agg)
            (loss * scale).backward()
            n = micro.response_mask.bool().sum()
            sums += torch.stack([loss.detach().double(), m["vf_clipfrac"].double() * n,
                                 m["vpred_mean"].double() * n, n.double()])
        return sums

    def state_extra(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(),
                "shuffle": self.shuffle.get_state() if self.shuffle is not None else None}

    def load_extra(self, extra: dict) -> None:
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.shuffle is not None and extra.get("shuffle") is not None:
            self.shuffle.set_state(extra["shuffle"])
