"""Gradient checkpointing recomputes every decoder layer but the last (response_model.keep_last_layer_activations).

The gradients it gives are checked against a plain model in test_actor.py (the "checkpointed" variants).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpo_npu.workers.response_model import keep_last_layer_activations

from .helpers import make_batch, make_cfg, make_worker

pytestmark = pytest.mark.usefixtures("process_group")


@pytest.mark.parametrize("checkpointing", [True, False])
def test_each_layer_runs_forward_once_plus_its_recompute(tiny_model_path, checkpointing):
    worker = make_worker(make_cfg(tiny_model_path, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                                  f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}"))
    layers = list(worker.actor.module.hf.model.layers)
    assert [layer.gradient_checkpointing for layer in layers] == [checkpointing] * (len(layers) - 1) + [False]
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):  # counted in forward itself: torch runs no module hooks in a recompute
        def counted(*args, _forward=layer.mlp.forward, _i=i, **kwargs):
            calls[_i] += 1
            return _forward(*args, **kwargs)
        layer.mlp.forward = counted
    batch = make_batch(seed=3)
    batch = batch.replace(old_logp=torch.zeros(batch.response_mask.shape))
    worker.actor.module.train()
    worker.actor.loop.backward_mini_batch(batch, worker.actor.micro_loss)  # one micro-batch of 8 rows
    # one forward each, and a recompute in backward for every checkpointed layer: never the last one
    assert calls == [2 if checkpointing else 1] * (len(layers) - 1) + [1]


def test_layers_without_the_checkpointing_switch_are_left_alone():
    plain = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert keep_last_layer_activations(plain) is False
    assert keep_last_layer_activations([]) is False
    assert not any(hasattr(layer, "gradient_checkpointing") for layer in plain)
