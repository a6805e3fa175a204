"""LoRA on the FSDP2 actor (actor_rollout_ref.model.lora_rank > 0), in one process.

References are written here with the plain transformers model and PEFT's own code: the base model's
log-probs, PEFT's merge_and_unload of the exported adapter directory, and the hand-written merge
W + alpha / r x B A.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_npu.workers import fsdp, lora

from .helpers import full_weights, make_batch, make_cfg, make_worker, max_abs_diff
from .test_actor import LOGP_ATOL, _reference_logp

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("process_group")

RANK, ALPHA = 8, 32
LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # all-linear on Qwen2


def _trained(worker, seed: int):
    """One actor update on a batch whose old log-probs are the actor's own (so the step is not trivial)."""
    batch = make_batch(seed=seed)
    old, _, _ = worker.compute_log_prob(batch)
    worker.update_actor(batch.replace(old_logp=old, ref_logp=worker.compute_ref_log_prob(batch)
                                      if worker.ref is not None else None))
    return batch


def test_only_adapters_train_and_the_reference_is_the_base_model(tiny_model_path, monkeypatch):
    from grpo_npu.workers import hybrid

    builds = []
    real = hybrid.build_sharded
    monkeypatch.setattr(hybrid, "build_sharded", lambda *a, **kw: builds.append(kw["trainable"]) or real(*a, **kw))
    worker = make_worker(make_cfg(tiny_model_path, *LORA, "actor_rollout_ref.actor.use_kl_loss=True"))
    assert builds == [True]  # no second model for the reference
    assert isinstance(worker.ref, lora.BasePolicy) and worker.ref.module is worker.actor.module
    hf = worker.actor.module.hf
    assert hf.is_gradient_checkpointing
    trainable = [n for n, p in hf.named_parameters() if p.requires_grad]
    layers = len(hf.model.layers)
    assert sorted(trainable) == sorted(f"model.layers.{i}.{blk}.{t}.lora_{ab}.default.weight"
                                       for i in range(layers) for t in TARGETS
                                       for blk in (["self_attn"] if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                                                   else ["mlp"]) for ab in "AB")
    optimized = {id(p) for g in worker.actor.loop.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in hf.parameters() if p.requires_grad}
    base_before = {n: w for n, w in full_weights(hf).items() if ".lora_" not in n}

    batch = make_batch(seed=3)
    expected, _, _ = _reference_logp(tiny_model_path, batch)  # the checkpoint, no adapters
    actor_0, _, _ = worker.compute_log_prob(batch)
    torch.testing.assert_close(actor_0, expected.float(), atol=LOGP_ATOL, rtol=0)  # B = 0: adapted == base at start
    for seed in (4, 5):
        _trained(worker, seed)
    actor_2, _, _ = worker.compute_log_prob(batch)
    assert (actor_2 - actor_0).abs().max() > 1e-3  # the adapters moved the policy
    ref_2 = worker.compute_ref_log_prob(batch)
    torch.testing.assert_close(ref_2, expected.float(), atol=LOGP_ATOL, rtol=0)  # ...and the reference did not
    assert all(layer.merged is False and not layer.disable_adapters for layer in lora.lora_layers(hf))  # re-enabled
    after = full_weights(hf)
    assert max_abs_diff({n: after[n] for n in base_before}, base_before) == 0.0  # the base is frozen, bit for bit


def test_target_and_exclude_modules(tiny_model_path):
    worker = make_worker(make_cfg(tiny_model_path, *LORA, "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
                                  "actor_rollout_ref.model.exclude_modules=.*layers\\.0\\..*"))
    adapted = {n.rsplit(".lora_", 1)[0] for n, p in worker.actor.module.hf.named_parameters() if p.requires_grad}
    layers = len(worker.actor.module.hf.model.layers)
    assert adapted == {f"model.layers.{i}.self_attn.{t}" for i in range(1, layers) for t in ("q_proj", "v_proj")}


def test_merged_weights_adapter_export_and_merged_export(tiny_model_path, tmp_path):
    """What the engines get (merged, base names) == PEFT's merge of the exported adapter == the HF export, and a
    from_pretrained model of those weights gives the actor's log-probs (what a synced engine computes)."""
    worker = make_worker(make_cfg(tiny_model_path, *LORA))
    batch = _trained(worker, seed=6)
    hf = worker.actor.module.hf
    merged = {n: t.clone() for n, t in lora.iter_merged_state_dict(hf)}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert sorted(merged) == sorted(base.state_dict())  # the base model's names, lm_head.weight (tied) included
    assert sorted(lora.merged_names(hf)) == sorted(merged)  # the canary's bisection names, read without a gather

    # the merge written out by hand: W + alpha / r x B A
    live = full_weights(hf)
    name = "model.layers.1.mlp.down_proj"
    by_hand = live[f"{name}.base_layer.weight"] + ALPHA / RANK * (
        live[f"{name}.lora_B.default.weight"] @ live[f"{name}.lora_A.default.weight"])
    torch.testing.assert_close(merged[f"{name}.weight"], by_hand, atol=0, rtol=0)
    assert (merged[f"{name}.weight"] - base.state_dict()[f"{name}.weight"]).abs().max() > 0  # trained B != 0

    # the PEFT adapter directory, loaded and merged by PEFT itself
    lora.export_adapter(hf, str(tmp_path / "adapter"))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == RANK
    peft_merged = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    for n, t in merged.items():
        torch.testing.assert_close(t, peft_merged[n], atol=1e-6, rtol=1e-5, msg=n)

    # HF export of a LoRA actor: the merged weights, loadable without PEFT, same log-probs as the actor
    worker.export_hf(str(tmp_path / "hf"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert max_abs_diff(reloaded.state_dict(), merged) == 0.0
    expected, _, _ = _reference_logp(str(tmp_path / "hf"), batch)
    actor, _, _ = worker.compute_log_prob(batch)
    torch.testing.assert_close(actor, expected.float(), atol=LOGP_ATOL, rtol=0)


def test_rollout_weights_are_merged_and_hf_rollout_uses_the_adapters(tiny_model_path):
    from grpo_npu.rollout.base import SamplingConfig

    worker = make_worker(make_cfg(tiny_model_path, *LORA), with_rollout=True)
    _trained(worker, seed=7)
    synced = dict(worker.rollout_weights())
    assert not any(".lora_" in n or ".base_layer" in n for n in synced)
    assert max_abs_diff({n: t.float() for n, t in synced.items()},
                        {n: t for n, t in lora.iter_merged_state_dict(worker.actor.module.hf)}) == 0.0
    # greedy generation from the adapted module == greedy generation of the merged model
    batch = make_batch(seed=8)
    sampling = SamplingConfig(n=1, temperature=0.0, do_sample=False, max_new_tokens=6, ignore_eos=True)
    out = worker.generate(batch.prompt_ids, batch.prompt_mask, sampling)
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    merged.load_state_dict(synced, strict=False)
    gen = merged.generate(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, max_new_tokens=6,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out.response_ids[:, : gen.shape[1] - batch.prompt_ids.shape[1]],
                       gen[:, batch.prompt_ids.shape[1]:])


def test_lora_checkpoint_resume_equals_uninterrupted(tiny_model_path, tmp_path):
    cfg = make_cfg(tiny_model_path, *LORA, "actor_rollout_ref.actor.optim.warmup_style=cosine",
                   "actor_rollout_ref.actor.optim.lr_warmup_steps=1",
                   "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    a = make_worker(cfg)
    _trained(a, seed=9)
    a.save_checkpoint(str(tmp_path), step=1)
    assert (tmp_path / "actor" / lora.ADAPTER_DIR / lora.ADAPTER_FILE).is_file()
    assert (tmp_path / "actor" / "huggingface" / "model.safetensors").is_file()  # hf_model: merged weights
    batch = make_batch(seed=10)
    old, _, _ = a.compute_log_prob(batch)
    m_a = a.update_actor(batch.replace(old_logp=old))
    b = make_worker(cfg)
    assert b.load_checkpoint(str(tmp_path)) == 1
    old_b, _, _ = b.compute_log_prob(batch)
    assert torch.equal(old_b, old)
    m_b = b.update_actor(batch.replace(old_logp=old_b))
    assert m_b["actor/lr"] == m_a["actor/lr"] > 0 and m_b["actor/pg_loss"] == m_a["actor/pg_loss"]
    assert max_abs_diff(full_weights(a.actor.module.hf), full_weights(b.actor.module.hf)) == 0.0
    assert len(a.actor.loop.optimizer.state) == len(b.actor.loop.optimizer.state) == len(a.actor.loop.params)


def test_full_fine_tuning_is_unchanged_by_lora_rank_zero(tiny_model_path):
    worker = make_worker(make_cfg(tiny_model_path, "actor_rollout_ref.model.lora_rank=0"))
    assert worker.lora is None and not lora.lora_layers(worker.actor.module)
    assert all(p.requires_grad for p in worker.actor.module.parameters())
    names = [n for n, _ in fsdp.iter_full_state_dict(worker.actor.module.hf)]
    assert [n for n, _ in worker.rollout_weights()] == names


def test_starting_from_a_saved_adapter_and_loading_through_shared_memory(tiny_model_path, tmp_path, monkeypatch):
    """verl's model.lora_adapter_path: a new actor built on an exported adapter computes what the trained actor does,
    its reference is still the base model, and its settings come from the adapter's config; model.use_shm loads the
    same model from a copy in shared memory."""
    from grpo_npu import io
    from grpo_npu.workers import hybrid

    trained = make_worker(make_cfg(tiny_model_path, *LORA, "actor_rollout_ref.actor.use_kl_loss=True"))
    batch = _trained(trained, seed=9)
    lora.export_adapter(trained.actor.module.hf, str(tmp_path / "adapter"))
    shm_root = tmp_path / "shm"  # stands for /dev/shm/grpo_npu-models
    monkeypatch.setattr(hybrid, "shm_copy", lambda path: io.shm_copy(path, root=str(shm_root)))
    keys = (f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.model.use_shm=True",
            "actor_rollout_ref.actor.use_kl_loss=True")
    started = make_worker(make_cfg(tiny_model_path, *keys))
    assert started.model_path.startswith(str(shm_root)) and started.lora.rank == RANK and started.lora.alpha == ALPHA
    torch.testing.assert_close(started.compute_log_prob(batch)[0], trained.compute_log_prob(batch)[0], atol=0, rtol=0)
    torch.testing.assert_close(started.compute_ref_log_prob(batch), trained.compute_ref_log_prob(batch), atol=0, rtol=0)
    assert io.shm_copy(tiny_model_path, root=str(shm_root)) == started.model_path  # one copy per source directory
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.model\.lora_rank=4, but the adapter in "
                                         r"actor_rollout_ref\.model\.lora_adapter_path=.* has 8; leave lora_rank unset"):
        make_worker(make_cfg(tiny_model_path, *keys, "actor_rollout_ref.model.lora_rank=4"))
    with pytest.raises(ValueError, match=r"lora_adapter_path=.*: expected a PEFT adapter directory"):
        make_worker(make_cfg(tiny_model_path, f"actor_rollout_ref.model.lora_adapter_path={tmp_path}"))
