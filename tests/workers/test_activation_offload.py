"""Activation offload (verl's model.enable_activation_offload): the saved tensors go through
``torch.autograd.graph.save_on_cpu`` during each micro-batch's forward and backward, and the update is the same
as without it. On CPU the key is accepted and nothing is copied (the activations already live in host memory);
the test forces the switch on to run the offloading path here."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.workers import update_loop

from .helpers import full_weights, make_batch, make_cfg, make_worker, max_abs_diff

pytestmark = pytest.mark.usefixtures("process_group")

KEYS = ("actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.model.use_remove_padding=True",
        "algorithm.adv_estimator=gae", "critic.model.use_remove_padding=True", "critic.ppo_micro_batch_size_per_gpu=4")
OFFLOAD = ("actor_rollout_ref.model.enable_activation_offload=True", "critic.model.enable_activation_offload=True")


def _update(worker, monkeypatch) -> tuple[dict, int]:
    saved = []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):  # the real hooks, counting what they pack
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook if hasattr(self, "pack_hook") else None
            if pack is not None:
                def counting(tensor):
                    saved.append(tensor.numel())
                    return pack(tensor)
                self.pack_hook = counting

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    batch = make_batch(seed=43)
    mask = batch.response_mask
    old, _, _ = worker.compute_log_prob(batch)
    values = worker.compute_values(batch)
    train = batch.replace(old_logp=old, values=values, returns=(torch.linspace(-1, 1, mask.shape[1]) * mask).contiguous())
    metrics = {**worker.update_actor(train), **worker.update_critic(train)}
    return metrics, len(saved)


def test_offloaded_update_equals_the_plain_one(tiny_model_path, monkeypatch):
    plain = make_worker(make_cfg(tiny_model_path, *KEYS))
    offloaded = make_worker(make_cfg(tiny_model_path, *KEYS, *OFFLOAD))
    # on CPU the switch stays off: the activations already live in host memory
    assert not offloaded.actor.loop.offload_activations and not offloaded.critic.loop.offload_activations
    offloaded.actor.loop.offload_activations = offloaded.critic.loop.offload_activations = True  # run the path here
    want, none_saved = _update(plain, monkeypatch)
    got, saved = _update(offloaded, monkeypatch)
    assert none_saved == 0 and saved > 0  # the hooks saw the checkpointed layers' inputs and the loss's tensors
    assert got.keys() == want.keys()
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-8), key
    assert max_abs_diff(full_weights(offloaded.actor.module), full_weights(plain.actor.module)) < 1e-6
