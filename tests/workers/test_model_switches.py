"""The device-aware model switches: None (auto) resolves per device kind, an explicit value always wins.

model.use_fused_kernels: on for NPU and CUDA; model.share_prompt_prefix, model.use_onednn_linear and
model.lora.merge: on for CPU (docs/lora.md for the last;
docs/performance.md, "Defaults tried for the CLI": the default job learns as well with them; on CUDA
share_prompt_prefix doubled the 0.5B-shape update, and oneDNN's matmul is a CPU kernel).
"""

from __future__ import annotations

import operator

import pytest
import torch

from grpo_npu.config import load_config
from grpo_npu.device import Device
from grpo_npu.workers.response_model import (engine_dtype_of, fused_kernels_on, lora_merge_on, onednn_linear_on,
                                             share_prompt_prefix_on)

from .helpers import make_batch, make_cfg, make_worker

AUTO_ON = {fused_kernels_on: ("npu", "cuda"), share_prompt_prefix_on: ("cpu",), lora_merge_on: ("cpu",)}
KEYS = {fused_kernels_on: "use_fused_kernels", share_prompt_prefix_on: "share_prompt_prefix",
        lora_merge_on: "lora.merge"}
# what a switch needs to be accepted at all (lora.merge=True: LoRA with the vLLM rollout)
NEEDS = {lora_merge_on: ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.name=vllm")}


def _model(*needs: str, **values):
    base = ["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *needs]
    return load_config(base + [f"actor_rollout_ref.model.{k}={v}" for k, v in values.items()]).actor_rollout_ref.model


@pytest.mark.parametrize("switch", list(AUTO_ON), ids=lambda f: f.__name__)
@pytest.mark.parametrize("kind", ["cpu", "cuda", "npu"], ids=lambda k: f"kind_{k}")  # not the hardware marks
def test_auto_is_on_for_one_device_kind_and_explicit_values_win(switch, kind):
    key, needs = KEYS[switch], NEEDS.get(switch, ())
    assert operator.attrgetter(key)(_model(*needs)) is None  # the schema default is auto
    assert switch(_model(*needs), Device(kind)) is (kind in AUTO_ON[switch])
    for value in (True, False):
        assert switch(_model(*needs, **{key: value}), Device(kind)) is value


@pytest.mark.parametrize("kind", ["cpu", "cuda", "npu"], ids=lambda k: f"kind_{k}")
def test_onednn_linear_is_auto_on_for_fp32_cpu_runs_and_an_explicit_true_elsewhere_is_refused(kind):
    fp32, mixed = [torch.float32, torch.float32], [torch.float32, torch.bfloat16]
    assert _model().use_onednn_linear is None  # the schema default is auto
    assert onednn_linear_on(_model(), Device(kind), fp32) is (kind == "cpu")
    assert onednn_linear_on(_model(), Device(kind), mixed) is False  # a bf16 model: oneDNN's op is fp32 only
    assert onednn_linear_on(_model(use_onednn_linear=False), Device(kind), fp32) is False
    for dtypes in (fp32, mixed):
        if kind == "cpu" and dtypes is fp32:
            assert onednn_linear_on(_model(use_onednn_linear=True), Device(kind), dtypes) is True
            continue
        names = "bfloat16/float32" if dtypes is mixed else "float32"  # sorted
        want = rf"^actor_rollout_ref.model.use_onednn_linear=True: .* computes in {names} on {kind}; leave it null"
        with pytest.raises(ValueError, match=want):
            onednn_linear_on(_model(use_onednn_linear=True), Device(kind), dtypes)


@pytest.mark.parametrize("bf16_host", [True, False])
def test_generation_dtype_is_the_engines_for_vllm_and_the_actors_compute_dtype_for_hf(monkeypatch, bf16_host):
    monkeypatch.setattr("grpo_npu.device.cpu_has_bf16_dot_products", lambda: bf16_host)
    base = ["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    vllm = load_config(base + ["actor_rollout_ref.rollout.name=vllm"]).actor_rollout_ref
    hf = load_config(base + ["actor_rollout_ref.rollout.name=hf"]).actor_rollout_ref
    assert engine_dtype_of(vllm, Device("cpu")) == (torch.bfloat16 if bf16_host else torch.float32)
    assert engine_dtype_of(hf, Device("cpu")) == torch.float32  # the actor trains in fp32 on CPU
    assert engine_dtype_of(vllm, Device("cuda")) == engine_dtype_of(hf, Device("cuda")) == torch.bfloat16
    pinned = load_config(base + ["actor_rollout_ref.rollout.dtype=float32"]).actor_rollout_ref
    assert engine_dtype_of(pinned, Device("cpu")) == engine_dtype_of(pinned, Device("cuda")) == torch.float32


@pytest.mark.usefixtures("process_group")
def test_cpu_worker_defaults_to_shared_prefix_and_onednn_and_false_turns_them_off(tiny_model_path):
    """The worker acts on the resolved values: auto on CPU patches the linear layers and packs shared
    prompts for the actor and the reference, explicit False leaves both alone; log-probs agree."""
    logps = {}
    for value in ("null", "False"):  # make_cfg pins both off for the other worker tests: null is the schema default
        worker = make_worker(make_cfg(tiny_model_path, "actor_rollout_ref.actor.use_kl_loss=True",
                                      f"actor_rollout_ref.model.share_prompt_prefix={value}",
                                      f"actor_rollout_ref.model.use_onednn_linear={value}"))
        on = value == "null"
        for policy in (worker.actor, worker.ref):
            assert policy.share_prefix is on
            assert policy.module.onednn_linear is on
            assert ("forward" in policy.module.hf.model.layers[0].mlp.up_proj.__dict__) is on
        logps[value] = worker.actor.log_probs(make_batch(seed=0), micro_size=8, max_tokens=None, with_entropy=False)[0]
    torch.testing.assert_close(logps["null"], logps["False"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("explicit", [None, True, False])
def test_reshard_after_forward_auto_keeps_the_gathered_copy_only_for_a_one_rank_full_update(explicit):
    from grpo_npu.workers.response_model import reshard_after_forward_on

    keys = [] if explicit is None else [f"actor_rollout_ref.actor.fsdp_config.reshard_after_forward={explicit}"]
    cfg = load_config(["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                       *keys]).actor_rollout_ref.actor.fsdp_config
    assert cfg.reshard_after_forward is explicit  # None (auto) is the schema default
    one_rank = dict(shard_ranks=1, trainable=True, lora=False, cpu_offload=False)
    cases = {"one rank, trained": one_rank, "two ranks": {**one_rank, "shard_ranks": 2},
             "forward only (reference)": {**one_rank, "trainable": False}, "LoRA": {**one_rank, "lora": True},
             "CPUOffloadPolicy": {**one_rank, "cpu_offload": True}}
    for name, case in cases.items():
        want = explicit if explicit is not None else name != "one rank, trained"
        assert reshard_after_forward_on(cfg, **case) is want, name


@pytest.mark.parametrize("world_size, keys, want", [
    (1, [], False), (2, [], True), (2, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=1"], False),  # HSDP, 1-rank shards
    (1, ["actor_rollout_ref.model.lora_rank=8"], True), (1, ["actor_rollout_ref.actor.fsdp_config.reshard_after_forward=true"], True),
    (2, ["actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"], False),
    (1, ["actor_rollout_ref.actor.fsdp_config.offload_policy=true"], False)])  # no CPUOffloadPolicy on a CPU run
def test_the_memory_plan_resolves_the_actors_resharding_from_the_config(world_size, keys, want):
    from grpo_npu.workers.response_model import actor_reshard_after_forward

    cfg = load_config(["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                       *keys]).actor_rollout_ref
    assert actor_reshard_after_forward(cfg, Device("cpu"), world_size) is want
    if "offload_policy" in " ".join(keys):
        assert actor_reshard_after_forward(cfg, Device("cuda"), world_size) is True  # CPUOffloadPolicy from a device


def test_shard_group_size_follows_fsdp_size():
    """build_mesh's shard dimension, which the resolution above reads from the config: all ranks for -1."""
    from grpo_npu.workers.fsdp import shard_group_size

    assert [shard_group_size(8, size) for size in (-1, 8, 4, 1)] == [8, 8, 4, 1]
    for bad in (3, 0, -2, 16):
        with pytest.raises(ValueError, match="fsdp_size"):
            shard_group_size(8, bad)


@pytest.mark.usefixtures("process_group")
def test_one_cpu_rank_wraps_nothing_by_default_and_wrapped_keeps_the_actors_gathered_layers(tiny_model_path):
    """Read back from the built modules: with the defaults one CPU rank builds the actor and the reference without
    FSDP2; wrapped (forward_prefetch asks for FSDP2), the actor's decoder layers keep their gathered parameters from
    forward to backward on one rank and the reference's are freed after forward."""
    from grpo_npu.workers import fsdp, fsdp_gather

    from grpo_npu.workers.response_model import actor_fsdp_wrap_on, actor_reshard_after_forward

    cfg = make_cfg(tiny_model_path, "actor_rollout_ref.actor.use_kl_loss=True")
    worker = make_worker(cfg)
    assert fsdp.fsdp_units(worker.actor.module) == fsdp.fsdp_units(worker.ref.module) == []
    assert actor_fsdp_wrap_on(cfg.actor_rollout_ref, worker.dev, world_size=1) is False  # the memory plan's

    cfg = make_cfg(tiny_model_path, "actor_rollout_ref.actor.use_kl_loss=True",
                   *(f"actor_rollout_ref.{role}.fsdp_config.forward_prefetch=True" for role in ("actor", "ref")))
    worker = make_worker(cfg)
    for policy, reshards in ((worker.actor, False), (worker.ref, True)):
        layers = fsdp.decoder_layers(policy.module.hf)
        groups = [g for layer in layers for g in fsdp_gather._param_groups(layer._get_fsdp_state())]
        assert groups and all(g._reshard_after_forward is reshards for g in groups)
    assert actor_fsdp_wrap_on(cfg.actor_rollout_ref, worker.dev, world_size=1) is True
    assert actor_reshard_after_forward(cfg.actor_rollout_ref, worker.dev, world_size=1) is False  # the memory plan's


@pytest.mark.parametrize("change, wrapped", [
    ({}, False), ({"world_size": 2}, True), ({"kind": "cuda"}, True), ({"compute": torch.bfloat16}, True),
    ({"reshard_after_forward": False}, True), ({"reshard_after_forward": True}, True),
    ({"forward_prefetch": True}, True)])
def test_fsdp_wraps_unless_one_cpu_rank_without_mixed_precision_or_fsdp_keys(change, wrapped):
    from grpo_npu.config import FSDPConfig
    from grpo_npu.workers.response_model import fsdp_wrap_on

    fsdp_cfg = FSDPConfig(reshard_after_forward=change.get("reshard_after_forward"),
                          forward_prefetch=change.get("forward_prefetch", False))
    got = fsdp_wrap_on(fsdp_cfg, Device(change.get("kind", "cpu")), world_size=change.get("world_size", 1),
                       compute_dtype=change.get("compute", torch.float32), master_dtype=torch.float32)
    assert got is wrapped
