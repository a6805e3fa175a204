"""Tiled MLP (``model.tiled_mlp``): the MLP's outputs and gradients unchanged, its intermediates one tile at a
time, and the actor's, reference's and critic's layers wrapped as configured."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from grpo_npu.workers.tiled_mlp import TILED, tile_mlps, tiled_forward

from .helpers import make_cfg, make_worker
from .test_actor import _actor_grads, _ppo_batch

HIDDEN, INTERMEDIATE = 8, 40


def _mlp(seed: int = 0) -> Qwen2MLP:
    torch.manual_seed(seed)
    return Qwen2MLP(Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act="silu"))


def _grads(mlp, x, forward):
    x = x.clone().requires_grad_(True)
    out = forward(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {"x": x.grad} | {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("shards", [1, 3, 4, 64])  # 64 > the 26 rows: one row per tile
def test_outputs_and_gradients_equal_the_untiled_mlp(shards):
    mlp = _mlp()
    x = torch.randn(2, 13, HIDDEN)
    want_out, want = _grads(mlp, x, mlp.forward)
    got_out, got = _grads(mlp, x, lambda t: tiled_forward(mlp.forward, shards, t))
    torch.testing.assert_close(got_out, want_out, atol=1e-6, rtol=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(tiled_forward(mlp.forward, shards, x), want_out, atol=1e-6, rtol=1e-5)


class _LargestIntermediate(TorchDispatchMode):
    """The most elements of any tensor an op returns whose last dimension is the intermediate size."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == INTERMEDIATE:
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("grad", [True, False])
def test_intermediates_exist_one_tile_at_a_time(grad):
    mlp = _mlp()
    x = torch.randn(4, 16, HIDDEN, requires_grad=grad)  # 64 rows
    for shards, rows in ((1, 64), (4, 16), (8, 8)):
        with _LargestIntermediate() as seen, torch.set_grad_enabled(grad):
            out = tiled_forward(mlp.forward, shards, x)
            if grad:
                out.sum().backward()
        assert seen.most == rows * INTERMEDIATE, shards


def _saved_intermediates(forward, x) -> int:
    """Elements of intermediate-sized tensors autograd keeps from the forward pass for backward."""
    kept = []

    def pack(t):
        if t.dim() and t.shape[-1] == INTERMEDIATE:
            kept.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(x)
    return sum(kept)


def test_forward_keeps_no_intermediate_for_backward():
    mlp = _mlp()
    x = torch.randn(4, 16, HIDDEN, requires_grad=True)
    assert _saved_intermediates(mlp.forward, x) >= 2 * 64 * INTERMEDIATE  # silu's input and the product's factors
    assert _saved_intermediates(lambda t: tiled_forward(mlp.forward, 4, t), x) == 0


def test_wrapping_is_idempotent_and_refuses_what_it_cannot_tile():
    layer = torch.nn.Module()
    layer.mlp = _mlp()
    assert tile_mlps([layer], 4, "k") == 1
    wrapped = layer.mlp.forward
    tile_mlps([layer], 4, "k")
    assert layer.mlp.forward is wrapped and getattr(layer.mlp, TILED) == 4
    with pytest.raises(ValueError, match=r"^k.num_shards=0 must be >= 1$"):
        tile_mlps([layer], 0, "k")
    with pytest.raises(ValueError, match=r"^k.enabled=True: decoder layer 0 \(Linear\) has no mlp module"):
        tile_mlps([torch.nn.Linear(2, 2)], 2, "k")



@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("variant", [(), ("actor_rollout_ref.model.enable_gradient_checkpointing=True",),
                                     ("actor_rollout_ref.model.use_remove_padding=True",),
                                     ("actor_rollout_ref.model.use_fused_kernels=True",),  # around grpo_npu's MLP
                                     ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")],
                         ids=["padded", "checkpointed", "packed", "fused", "lora"])
def test_actor_gradients_equal_with_and_without_tiles(tiny_model_path, variant):
    if any("lora" in v for v in variant):
        pytest.importorskip("peft")
    batch = _ppo_batch(tiny_model_path, seed=4)
    plain = _actor_grads(make_worker(make_cfg(tiny_model_path, *variant)), batch)
    worker = make_worker(make_cfg(tiny_model_path, *variant, "actor_rollout_ref.model.tiled_mlp.enabled=True",
                                  "actor_rollout_ref.model.tiled_mlp.num_shards=3"))
    assert all(getattr(layer.mlp, TILED) == 3 for layer in worker.actor.module.hf.model.layers)
    tiled = _actor_grads(worker, batch)
    assert plain and tiled.keys() == plain.keys()
    for name, g in plain.items():
        torch.testing.assert_close(tiled[name], g, atol=2e-6, rtol=1e-4, msg=name)


@pytest.mark.usefixtures("process_group")
def test_reference_follows_the_actors_block_and_the_critic_its_own(tiny_model_path):
    worker = make_worker(make_cfg(tiny_model_path, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=True",
                                  "actor_rollout_ref.model.tiled_mlp.enabled=True",
                                  "critic.model.tiled_mlp.enabled=True", "critic.model.tiled_mlp.num_shards=2"))
    for module, shards in ((worker.actor.module, 4), (worker.ref.module, 4), (worker.critic.module, 2)):
        assert all(getattr(layer.mlp, TILED) == shards for layer in module.hf.model.layers)
    plain = make_worker(make_cfg(tiny_model_path, "algorithm.adv_estimator=gae"))
    assert not any(hasattr(layer.mlp, TILED) for layer in plain.critic.module.hf.model.layers)
