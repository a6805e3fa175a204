"""The PPO critic: a value head on the policy checkpoint (``critic.model.path``), FSDP2-sharded.

The value model is transformers' ``AutoModelForTokenClassification`` with one label (a fresh linear
``score`` head on the decoder, no dropout). Like the actor's log-probs, the value of response token
j is read from the hidden state at position P + j - 1 (the state before the token is emitted), and
only the N valid response positions go through the head. The update is the shared
:class:`~grpo_npu.workers.update_loop.UpdateLoop` with the clipped value loss of
:mod:`grpo_npu.algo.losses` as its micro-batch loss.
"""

from __future__ import annotations

import torch

from grpo_npu.algo import losses
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import CriticConfig, Derived
from grpo_npu.device import Device
from grpo_npu.workers import fsdp
from grpo_npu.workers.micro_batch import forward_in_micro_batches
from grpo_npu.workers.model_inputs import ModelInputs, build_inputs, scatter_valid
from grpo_npu.workers.response_model import ResponseModel
from grpo_npu.workers.update_loop import MicroLoss, UpdateLoop, params_on


class ValueHead(ResponseModel):
    """forward -> values (b, T) fp32 at the valid response positions (0 elsewhere)."""

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        h, _, gather = self.hidden_at_predictions(inputs)  # (n, H)
        (values,) = gather(self.hf.score(h)[:, 0].float())  # (N,)
        return scatter_valid(values, inputs.response_valid)


class Critic:
    """Sharded value model + its update loop: ``compute_values`` and ``update``."""

    def __init__(self, module: ValueHead, dev: Device, cfg: CriticConfig, derived: Derived, *,
                 default_agg_mode: str, total_steps: int, seed: int):
        self.module = module
        self.dev = dev
        self.cfg = cfg
        self.derived = derived
        self.remove_padding = cfg.model.use_remove_padding
        self.agg_mode = cfg.loss_agg_mode or default_agg_mode
        self.epochs = derived.critic_ppo_epochs
        self.dynamic_bsz = derived.critic_use_dynamic_bsz
        self.param_offload = cfg.model.fsdp_config.param_offload
        self.loop = UpdateLoop(
            module, dev, cfg.optim, cfg.model.fsdp_config, grad_clip=cfg.grad_clip, total_steps=total_steps,
            micro_size=derived.critic_micro_batch_per_rank,
            max_tokens=derived.critic_max_token_len if self.dynamic_bsz else None,
            horizon=derived.critic_agg_horizon, shuffle_seed=seed if cfg.shuffle else None,
            offload_activations=cfg.model.enable_activation_offload and dev.is_accelerator,  # host memory already on CPU
        )
        if self.param_offload and dev.is_accelerator:
            fsdp.move_model(module, "cpu")

    def forward(self, micro: RolloutBatch) -> torch.Tensor:
        return self.module(build_inputs(micro.to(self.dev.torch_device()), self.remove_padding))

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """(B, T) float32 values of this rank's rows, on the host. Collective."""
        self.module.eval()
        d = self.derived
        with params_on(self.module, self.dev, self.param_offload):
            (values,) = forward_in_micro_batches(self.forward, batch, size=d.values_micro_batch_per_rank,
                                                 max_tokens=d.values_max_token_len if self.dynamic_bsz else None,
                                                 dev=self.dev)
            fsdp.reshard_all(self.module)
        return values

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Value-loss epochs over mini-batches; needs values (the old ones) and returns. Collective."""
        if batch.values is None or batch.returns is None:
            raise ValueError("update_critic: the batch needs values and returns")
        stats = self.loop.run(batch, self.micro_loss, epochs=self.epochs,
                              mini_batch_size=self.derived.critic_mini_batch_responses_per_rank)
        return {
            "critic/vf_loss": stats.per_step("vf_loss"),
            "critic/vf_clipfrac": stats.per_token("vf_clipfrac"),
            "critic/vpred_mean": stats.per_token("vpred_mean"),
            **stats.optimizer_metrics("critic"),
        }

    def micro_loss(self, micro: RolloutBatch, agg: dict) -> MicroLoss:
        """Clipped value loss of one micro-batch (global normalisation by ``agg``); token-weighted metric sums."""
        values = self.forward(micro)  # (b, T)
        loss, m = losses.value_loss(values, micro.values, micro.returns, micro.loss_tokens(),
                                    clip_range=self.cfg.cliprange_value, agg_mode=self.agg_mode, **agg)
        n = micro.loss_tokens().bool().sum()
        sums = {"vf_loss": loss, "vf_clipfrac": m["vf_clipfrac"] * n, "vpred_mean": m["vpred_mean"] * n}
        return MicroLoss(loss, sums)
