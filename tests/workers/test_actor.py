"""The FSDP2 actor in one process (a world-size-1 gloo group): log-probs, gradients, update invariances.

References are written here with the plain transformers model: full logits, a float64 log-softmax,
the PPO loss spelled out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from grpo_npu.workers import fsdp, fsdp_gather

from .helpers import full_weights, make_batch, make_cfg, make_worker, max_abs_diff

pytestmark = pytest.mark.usefixtures("process_group")

# fp32 forward passes of the same model that differ only in summation order / packing.
LOGP_ATOL = 1e-5


def _reference_logp(model_path: str, batch, temperature: float = 1.0, grad: bool = False):
    """(logp (B, T), entropy (B, T), model) from the plain HF model with full float64 log-softmax."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager")
    p = batch.prompt_ids.shape[1]
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits  # (B, L, V)
        z = logits[:, p - 1 : -1].double() / temperature  # (B, T, V): position P+j-1 predicts token j
        logsm = torch.log_softmax(z, dim=-1)
        logp = logsm.gather(-1, batch.response_ids[..., None])[..., 0]
        entropy = -(logsm.exp() * logsm).sum(-1)
    mask = batch.response_mask.bool()
    return logp * mask, entropy * mask, model


@pytest.mark.parametrize("remove_padding,fused", [(False, False), (True, False), (True, True)])
def test_log_probs_and_entropy_match_full_softmax(tiny_model_path, remove_padding, fused):
    """fused: grpo_npu.ops.patch_model (reference backends on CPU); packed batches always take its varlen attention."""
    cfg = make_cfg(tiny_model_path, f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
                   f"actor_rollout_ref.model.use_fused_kernels={fused}", "actor_rollout_ref.rollout.temperature=0.7")
    worker = make_worker(cfg)
    assert (worker.actor.module.hf.config._attn_implementation == "grpo_npu") == (fused or remove_padding)
    batch = make_batch(seed=0)
    ref_logp, ref_entropy, _ = _reference_logp(tiny_model_path, batch, temperature=0.7)
    logp, entropy = worker.actor.log_probs(batch, micro_size=3, max_tokens=None, with_entropy=True)
    assert logp.dtype == torch.float32 and logp.shape == batch.response_ids.shape
    torch.testing.assert_close(logp.double(), ref_logp, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=LOGP_ATOL, rtol=0)
    assert bool((logp[~batch.response_mask.bool()] == 0).all())


def test_remove_padding_equals_padded_and_micro_batching_is_invisible(tiny_model_path):
    worker = make_worker(make_cfg(tiny_model_path))
    batch = make_batch(seed=4)
    actor = worker.actor
    results = {}
    for remove_padding in (False, True):
        actor.remove_padding = remove_padding
        for name, kwargs in {"8x1": dict(micro_size=8, max_tokens=None), "1x8": dict(micro_size=1, max_tokens=None),
                             "dynamic": dict(micro_size=None, max_tokens=20)}.items():
            results[(remove_padding, name)] = actor.log_probs(batch, with_entropy=False, **kwargs)[0]
    base = results[(False, "8x1")]
    for key, logp in results.items():
        torch.testing.assert_close(logp, base, atol=LOGP_ATOL, rtol=0, msg=f"{key} differs from padded 8x1")


def _ppo_batch(model_path, seed=0):
    """A batch with old log-probs from the initial policy and per-response advantages."""
    batch = make_batch(seed=seed)
    old_logp, _, _ = _reference_logp(model_path, batch)
    return batch.replace(old_logp=old_logp.float())


def _actor_grads(worker, batch) -> dict[str, torch.Tensor]:
    worker.actor.module.train()
    worker.actor.loop.backward_mini_batch(batch, worker.actor.micro_loss)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in worker.actor.module.hf.named_parameters() if p.grad is not None}  # LoRA: the adapters
    worker.actor.loop.optimizer.zero_grad(set_to_none=True)
    return grads


def test_gradients_match_plain_model_through_chunked_logprobs(tiny_model_path):
    """Token-mean PPO loss at ratio 1: grad = -sum(A * dlogp) / tokens, checked on every parameter,
    for the padded path, the packed path and gradient checkpointing."""
    batch = _ppo_batch(tiny_model_path, seed=1)
    ref_logp, _, model = _reference_logp(tiny_model_path, batch, grad=True)
    mask = batch.response_mask.bool()
    loss = -(batch.advantages.double() * ref_logp)[mask].sum() / mask.sum()
    loss.backward()
    expected = {n: p.grad.float() for n, p in model.named_parameters()}

    variants = {
        "padded": (),
        "checkpointed": ("actor_rollout_ref.model.enable_gradient_checkpointing=True",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"),
        "packed": ("actor_rollout_ref.model.use_remove_padding=True",),
        "packed+checkpointed+micro1": ("actor_rollout_ref.model.use_remove_padding=True",
                                      "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"),
        # every linear layer's forward and backward through oneDNN (where torch has it)
        "onednn+checkpointed": ("actor_rollout_ref.model.use_onednn_linear=True",
                                "actor_rollout_ref.model.enable_gradient_checkpointing=True"),
    }
    for name, overrides in variants.items():
        worker = make_worker(make_cfg(tiny_model_path, *overrides))
        assert worker.actor.module.hf.is_gradient_checkpointing == ("checkpointed" in name)
        assert ("forward" in worker.actor.module.hf.model.layers[0].mlp.up_proj.__dict__) == ("onednn" in name)
        grads = _actor_grads(worker, batch)
        assert grads.keys() == expected.keys()
        for n, g in grads.items():
            torch.testing.assert_close(g, expected[n], atol=2e-6, rtol=1e-4, msg=f"{name}: grad of {n}")


def test_update_is_invariant_to_micro_batching(tiny_model_path):
    """One optimizer step: micro-batches 8x1 == 1x8 == token-budget packing, padded or packed (loss, metrics, weights)."""
    batch = _ppo_batch(tiny_model_path, seed=2)
    initial = None
    runs = {}
    for name, overrides in {
        "8x1": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",),
        "1x8": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",),
        "dynamic": ("actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24"),
        "dynamic+packed": ("actor_rollout_ref.actor.use_dynamic_bsz=True",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24",
                           "actor_rollout_ref.model.use_remove_padding=True"),
    }.items():
        worker = make_worker(make_cfg(tiny_model_path, *overrides, "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"))
        if initial is None:
            initial = full_weights(worker.actor.module.hf)
        metrics = worker.update_actor(batch)
        runs[name] = (metrics, full_weights(worker.actor.module.hf))
    base_metrics, base_weights = runs["8x1"]
    assert max_abs_diff(base_weights, initial) > 1e-4  # the step moved the weights
    assert base_metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # old_logp is the current policy
    for name, (metrics, weights) in runs.items():
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
            assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-5, abs=1e-7), f"{name}: {key}"
        # SGD-like first step (optim.eps=1): weight differences ~ lr x gradient rounding.
        assert max_abs_diff(weights, base_weights) < 1e-7, name


def test_kl_and_entropy_terms_and_metrics(tiny_model_path):
    """pg_loss / kl_loss / entropy metrics equal the hand-computed mini-batch values."""
    cfg = make_cfg(tiny_model_path, "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.5",
                   "actor_rollout_ref.actor.kl_loss_type=mse", "actor_rollout_ref.actor.entropy_coeff=0.01",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    worker = make_worker(cfg)
    batch = _ppo_batch(tiny_model_path, seed=3)
    ref_logp = batch.old_logp - 0.1 * batch.response_mask  # a reference 0.1 nats away on every token
    batch = batch.replace(ref_logp=ref_logp)
    logp, entropy, _ = _reference_logp(tiny_model_path, batch)
    mask = batch.response_mask.bool()
    n = mask.sum()
    expected_pg = float(-(batch.advantages.double())[mask].sum() / n)  # ratio 1
    expected_kl = float((0.5 * (logp - ref_logp.double()) ** 2)[mask].sum() / n)
    expected_entropy = float(entropy[mask].sum() / n)
    metrics = worker.update_actor(batch)
    assert metrics["actor/pg_loss"] == pytest.approx(expected_pg, abs=1e-6)
    assert metrics["actor/kl_loss"] == pytest.approx(expected_kl, rel=1e-4)
    assert metrics["actor/entropy_loss"] == pytest.approx(expected_entropy, rel=1e-5)  # verl's name for it
    assert "actor/entropy" not in metrics  # that one is the old-log-prob pass's (verl's trainer logs it there)
    assert metrics["actor/lr"] == pytest.approx(0.01)
    assert metrics["actor/skipped_steps"] == 0


def test_calculate_entropy_logs_the_updates_entropy_and_leaves_the_loss_alone(tiny_model_path):
    batch = _ppo_batch(tiny_model_path, seed=3)
    _, entropy, _ = _reference_logp(tiny_model_path, batch)
    mask = batch.response_mask.bool()
    runs = {}
    for on in (False, True):
        worker = make_worker(make_cfg(tiny_model_path, f"actor_rollout_ref.actor.calculate_entropy={on}"))
        runs[on] = (worker.update_actor(batch), full_weights(worker.actor.module.hf))
    assert runs[True][0]["actor/entropy_loss"] == pytest.approx(float(entropy[mask].sum() / mask.sum()), rel=1e-5)
    assert "actor/entropy_loss" not in runs[False][0]
    assert runs[True][0]["actor/pg_loss"] == runs[False][0]["actor/pg_loss"]
    assert max_abs_diff(runs[True][1], runs[False][1]) == 0.0


def test_non_finite_gradient_skips_the_step(tiny_model_path):
    worker = make_worker(make_cfg(tiny_model_path))
    batch = _ppo_batch(tiny_model_path, seed=5)
    before = full_weights(worker.actor.module.hf)
    advantages = batch.advantages.clone()
    advantages[0, 0] = float("nan")  # a valid token of row 0
    assert batch.response_mask[0, 0] == 1
    metrics = worker.update_actor(batch.replace(advantages=advantages))
    assert metrics["actor/skipped_steps"] == 1 and math.isnan(metrics["actor/grad_norm"])
    assert max_abs_diff(full_weights(worker.actor.module.hf), before) == 0.0
    assert all(p.grad is None for p in worker.actor.loop.params)
    assert not worker.actor.loop.optimizer.state  # Adam moments were never touched
    metrics = worker.update_actor(batch)  # the next finite step trains normally
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"])
    assert max_abs_diff(full_weights(worker.actor.module.hf), before) > 1e-4


def test_reference_is_built_only_with_a_kl_term(tiny_model_path, monkeypatch):
    from grpo_npu.workers import hybrid

    builds = []
    real = hybrid.build_sharded

    def counting(*args, **kwargs):
        builds.append(kwargs["trainable"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hybrid, "build_sharded", counting)
    worker = make_worker(make_cfg(tiny_model_path))
    assert worker.ref is None and builds == [True]  # the actor only
    with pytest.raises(RuntimeError, match="no ref.*no KL term"):
        worker.compute_ref_log_prob(make_batch())
    for kl_key in ("actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True"):
        builds.clear()
        worker = make_worker(make_cfg(tiny_model_path, kl_key))
        assert worker.ref is not None and builds == [True, False]
        batch = make_batch(seed=6)
        ref = worker.compute_ref_log_prob(batch)
        old, _, _ = worker.compute_log_prob(batch)
        torch.testing.assert_close(ref, old, atol=LOGP_ATOL, rtol=0)  # same checkpoint, same log-probs
        assert not any(p.requires_grad for p in worker.ref.module.parameters())


def test_compute_log_prob_reports_entropy_and_validates(tiny_model_path):
    worker = make_worker(make_cfg(tiny_model_path))
    batch = make_batch(seed=7)
    logp, metrics, _ = worker.compute_log_prob(batch)
    _, entropy, _ = _reference_logp(tiny_model_path, batch)
    mask = batch.response_mask.bool()
    assert metrics["actor/entropy"] == pytest.approx(float(entropy[mask].mean()), rel=1e-5)
    no_prompt = batch.replace(prompt_mask=batch.prompt_mask.clone())
    no_prompt.prompt_mask[2] = 0
    with pytest.raises(ValueError, match="row 2 has no prompt tokens"):
        worker.compute_log_prob(no_prompt)
    holey = batch.replace(response_mask=batch.response_mask.clone())
    holey.response_mask[0, :3] = torch.tensor([1, 0, 1])
    with pytest.raises(ValueError, match=r"row 0: response_mask must be right-padded"):
        worker.compute_log_prob(holey)
    with pytest.raises(ValueError, match="needs advantages"):
        worker.update_actor(batch.replace(advantages=None))


@pytest.mark.parametrize("remove_padding", [False, True])
def test_sum_pi_squared_of_the_old_log_prob_pass_matches_the_full_softmax(tiny_model_path, remove_padding):
    """actor.calculate_sum_pi_squared: the old-log-prob pass also returns sum_v pi(v)^2 of each response token's
    tempered distribution (the plain HF model's, float64, written here), 0 off the mask, and leaves the log-probs and
    actor/entropy as without it; the old log-probs are then never taken from the update."""
    batch = make_batch(seed=9)
    extra = (f"actor_rollout_ref.model.use_remove_padding={remove_padding}", "actor_rollout_ref.rollout.temperature=0.7",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3")
    plain = make_worker(make_cfg(tiny_model_path, *extra))
    logp_0, metrics_0, none = plain.compute_log_prob(batch)
    assert none is None
    worker = make_worker(make_cfg(tiny_model_path, *extra, "actor_rollout_ref.actor.calculate_sum_pi_squared=True"))
    assert not worker.derived.old_logp_from_update
    logp, metrics, sum_sq = worker.compute_log_prob(batch)
    torch.testing.assert_close(logp, logp_0, atol=0, rtol=0)
    assert metrics == metrics_0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="eager")
    p = batch.prompt_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                       use_cache=False).logits[:, p - 1 : -1].double()  # (B, T, V)
    want = torch.softmax(logits / 0.7, dim=-1).square().sum(-1) * batch.response_mask
    torch.testing.assert_close(sum_sq.double(), want, atol=1e-5, rtol=1e-4)


def test_on_policy_update_reuses_its_forward_as_old_log_probs(tiny_model_path):
    """actor.old_log_prob=auto: an update without old_logp equals the separate pass + update (weights and
    every metric, actor/entropy and rollout/logp_diff_* included); recompute refuses a batch without them."""
    from grpo_npu.rollout import logp_diff_metrics

    batch = make_batch(seed=8)
    ref_logp, _, _ = _reference_logp(tiny_model_path, batch)
    mask = batch.response_mask
    noise = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(1))
    batch = batch.replace(ref_logp=(ref_logp - 0.1).float() * mask, rollout_logp=(ref_logp + 0.01 * noise).float() * mask)
    runs = {}
    for mode in ("recompute", "auto"):
        worker = make_worker(make_cfg(tiny_model_path, f"actor_rollout_ref.actor.old_log_prob={mode}",
                                      "actor_rollout_ref.actor.use_kl_loss=True",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3"))
        assert worker.derived.old_logp_from_update == (mode == "auto")
        if mode == "recompute":
            with pytest.raises(ValueError, match="needs old_logp"):
                worker.update_actor(batch)
            old_logp, metrics, _ = worker.compute_log_prob(batch)
            metrics.update(worker.update_actor(batch.replace(old_logp=old_logp)))
            metrics.update(logp_diff_metrics(batch.rollout_logp, old_logp, mask))
        else:
            metrics = worker.update_actor(batch)
        runs[mode] = (metrics, full_weights(worker.actor.module.hf))
    (base, base_weights), (metrics, weights) = runs["recompute"], runs["auto"]
    assert set(metrics) == set(base)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "rollout/logp_diff_mean",
                "rollout/logp_diff_max"):
        assert metrics[key] == pytest.approx(base[key], rel=1e-5), key
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0  # ratio exactly 1
    assert max_abs_diff(weights, base_weights) < 1e-7


def test_state_dict_stream_and_hf_export(tiny_model_path, tmp_path):
    worker = make_worker(make_cfg(tiny_model_path))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    expected = hf.state_dict()
    streamed = dict(fsdp.iter_full_state_dict(worker.actor.module.hf))
    assert list(streamed) == list(expected)  # HF names, lm_head.weight (tied) included
    for name, tensor in streamed.items():
        assert not isinstance(tensor, torch.distributed.tensor.DTensor)
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=name)
    bf16 = dict(fsdp.iter_full_state_dict(worker.actor.module.hf, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    # the tied pair is one tensor however it is cast: the engine's sync copies it once
    assert bf16["lm_head.weight"] is bf16["model.embed_tokens.weight"]
    assert streamed["lm_head.weight"].data_ptr() == streamed["model.embed_tokens.weight"].data_ptr()

    out = tmp_path / "hf"
    worker.update_actor(_ppo_batch(tiny_model_path, seed=8))  # export trained weights, not the checkpoint's
    trained = full_weights(worker.actor.module.hf)
    worker.export_hf(str(out))
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not list(out.glob("*.tmp"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert max_abs_diff({k: v for k, v in reloaded.state_dict().items()}, trained) == 0.0


def test_checkpoint_resume_equals_uninterrupted(tiny_model_path, tmp_path):
    cfg = make_cfg(tiny_model_path, "actor_rollout_ref.actor.optim.warmup_style=cosine",
                   "actor_rollout_ref.actor.optim.lr_warmup_steps=1")
    b1, b2 = _ppo_batch(tiny_model_path, seed=9), _ppo_batch(tiny_model_path, seed=10)
    a = make_worker(cfg)
    a.update_actor(b1)
    a.save_checkpoint(str(tmp_path), step=1)
    m_a = a.update_actor(b2)
    b = make_worker(cfg)
    assert b.load_checkpoint(str(tmp_path)) == 1
    m_b = b.update_actor(b2)
    assert m_b["actor/lr"] == m_a["actor/lr"] > 0  # the scheduler resumed after its warmup step
    assert m_b["actor/pg_loss"] == m_a["actor/pg_loss"]
    assert max_abs_diff(full_weights(a.actor.module.hf), full_weights(b.actor.module.hf)) == 0.0
    assert len(a.actor.loop.optimizer.state) == len(b.actor.loop.optimizer.state) > 0
    with pytest.raises(FileNotFoundError, match="no dcp"):
        b.load_checkpoint(str(tmp_path / "missing"))


@pytest.mark.parametrize("share_prefix", [False, True])  # True: generation through the patched attention
def test_hf_generate_gathers_each_layer_once_and_reshards(tiny_model_path, monkeypatch, share_prefix):
    """The hf rollout through the FSDP actor: same greedy tokens as the plain model, one gather per FSDP unit
    for the whole generate (not one per token), every unit resharded and its reshard setting restored."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from grpo_npu.rollout import SamplingConfig

    gathers, forwards = [], []
    real_unshard, real_pre_forward = FSDPParamGroup.unshard, FSDPParamGroup.pre_forward

    def counting(group, *args, **kwargs):
        if not group.is_unsharded and group._all_gather_result is None:
            gathers.append(group)
        return real_unshard(group, *args, **kwargs)

    def counting_forward(group, *args, **kwargs):
        forwards.append(group)
        return real_pre_forward(group, *args, **kwargs)

    worker = make_worker(make_cfg(tiny_model_path, f"actor_rollout_ref.model.share_prompt_prefix={share_prefix}",
                                  "actor_rollout_ref.rollout.sync_check.enable=False",  # the canary's probe gathers too
                                  # set, so that one CPU rank wraps the actor in FSDP2 (auto does not: fsdp_wrap_on)
                                  "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"),
                         with_rollout=True)
    units = fsdp.fsdp_units(worker.actor.module)
    settings = [fsdp_gather._reshard_setting(m) for m in units]
    hooks = [(list(m._forward_pre_hooks.items()), list(m._forward_hooks.items())) for m in units]
    batch = make_batch(seed=9)
    monkeypatch.setattr(FSDPParamGroup, "unshard", counting)
    monkeypatch.setattr(FSDPParamGroup, "pre_forward", counting_forward)
    out = worker.generate(batch.prompt_ids, batch.prompt_mask, SamplingConfig(do_sample=False, max_new_tokens=6,
                                                                             ignore_eos=True))
    monkeypatch.setattr(FSDPParamGroup, "unshard", real_unshard)
    monkeypatch.setattr(FSDPParamGroup, "pre_forward", real_pre_forward)
    assert len(gathers) == len(units) > 2  # 6 tokens x 4 layers would be 24+ per-forward gathers
    # The static decode loop ran with FSDP's hooks lifted (no per-layer Python per token); on CPU also with
    # the shared-prefix (grpo_npu) attention, which generation swaps for the decode attention.
    assert forwards == []
    assert all(not g.is_unsharded for m in units for g in fsdp_gather._param_groups(m._get_fsdp_state()))
    assert [fsdp_gather._reshard_setting(m) for m in units] == settings
    assert [(list(m._forward_pre_hooks.items()), list(m._forward_hooks.items())) for m in units] == hooks
    assert all(pre for pre, _ in hooks)  # FSDP's hooks were there to lift, and are back, in order

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    want = plain.generate(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, do_sample=False,
                          max_new_tokens=6, min_new_tokens=6, pad_token_id=0, eos_token_id=[])
    assert torch.equal(out.response_ids, want[:, batch.prompt_ids.shape[1]:])


class _Group:
    def __init__(self, info):
        self.post_forward_mesh_info = info


@pytest.mark.parametrize("layout", ["groups", "group", "none"])
def test_reshard_setting_reads_both_fsdp_state_layouts(layout):
    """torch >= 2.12 keeps a list of parameter groups per unit; torch 2.11 (seen on the CUDA image) one
    group or None, and may lack the auto flag: read and restore either without touching the other."""
    from types import SimpleNamespace

    groups = [_Group("a"), _Group("b")]
    state = {"groups": SimpleNamespace(_fsdp_param_groups=groups, _auto_reshard_after_forward=True),
             "group": SimpleNamespace(_fsdp_param_group=groups[0]),
             "none": SimpleNamespace(_fsdp_param_group=None)}[layout]
    unit = SimpleNamespace(_get_fsdp_state=lambda: state)
    setting = fsdp_gather._reshard_setting(unit)
    want = {"groups": (True, ["a", "b"]), "group": (None, ["a"]), "none": (None, [])}[layout]
    assert setting == want
    for g in groups:
        g.post_forward_mesh_info = "changed"
    if layout == "groups":
        state._auto_reshard_after_forward = False
    fsdp_gather._restore_reshard_setting(unit, setting)
    assert [g.post_forward_mesh_info for g in fsdp_gather._param_groups(state)] == want[1]
    assert getattr(state, "_auto_reshard_after_forward", None) == want[0]


def _shared_prompt_batch(seed: int):
    """make_batch with rows 0-3 sharing one prompt (row 3's response empty) and rows 4-5 another."""
    batch = make_batch(seed=seed)
    ids, mask = batch.prompt_ids.clone(), batch.prompt_mask.clone()
    for src, dst in ((0, 1), (0, 2), (0, 3), (4, 5)):
        ids[dst], mask[dst] = ids[src], mask[src]
    return batch.replace(prompt_ids=ids, prompt_mask=mask)


def test_shared_prompt_packing_layout():
    """Each distinct prompt is packed once; every response follows its prompt with positions continuing from it."""
    from grpo_npu.workers.model_inputs import build_inputs

    batch = _shared_prompt_batch(seed=10)
    inputs = build_inputs(batch, remove_padding=False, share_prefix=True)
    prompt_len = batch.prompt_mask.sum(1).tolist()
    distinct = [0, 4, 6, 7]  # rows with a prompt not seen before
    assert inputs.input_ids.shape[1] == sum(prompt_len[r] for r in distinct) + int(batch.response_mask.sum())
    flat_ids, flat_pos = inputs.input_ids[0], inputs.position_ids[0]
    padded = build_inputs(batch, remove_padding=False)
    # the hidden state predicting each response token sits on the same token at the same position
    padded_ids, padded_pos = padded.input_ids.reshape(-1), padded.position_ids.reshape(-1)
    assert torch.equal(flat_ids[inputs.predict_index], padded_ids[padded.predict_index])
    assert torch.equal(flat_pos[inputs.predict_index], padded_pos[padded.predict_index])
    kw = inputs.packed_kwargs
    assert kw["cu_seq_lens_q"][-1] == inputs.input_ids.shape[1] and kw["cu_seq_lens_k"][-1] == len(kw["kv_index"])


@pytest.mark.parametrize("fused", [False, True])
def test_shared_prompt_log_probs_match_full_softmax(tiny_model_path, fused):
    cfg = make_cfg(tiny_model_path, "actor_rollout_ref.model.share_prompt_prefix=True",
                   f"actor_rollout_ref.model.use_fused_kernels={fused}")
    worker = make_worker(cfg)
    assert worker.actor.module.hf.config._attn_implementation == "grpo_npu"
    batch = _shared_prompt_batch(seed=11)
    ref_logp, ref_entropy, _ = _reference_logp(tiny_model_path, batch)
    # groups whole, split over micro-batches, one row each; token-budget packing
    for micro, budget in ((8, None), (3, None), (1, None), (None, 20)):
        logp, entropy = worker.actor.log_probs(batch, micro_size=micro, max_tokens=budget, with_entropy=True)
        torch.testing.assert_close(logp.double(), ref_logp, atol=LOGP_ATOL, rtol=0, msg=f"micro {micro}")
        torch.testing.assert_close(entropy.double(), ref_entropy, atol=LOGP_ATOL, rtol=0, msg=f"micro {micro}")


def test_shared_prompt_update_equals_padded(tiny_model_path):
    """One on-policy update with KL (gradient checkpointing on): shared-prompt packing == padded rows."""
    batch = _shared_prompt_batch(seed=12)
    ref_logp, _, _ = _reference_logp(tiny_model_path, batch)
    batch = batch.replace(ref_logp=(ref_logp - 0.05).float() * batch.response_mask)
    runs = {}
    for share in (False, True):
        worker = make_worker(make_cfg(tiny_model_path, f"actor_rollout_ref.model.share_prompt_prefix={share}",
                                      "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                                      "actor_rollout_ref.actor.use_kl_loss=True",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"))
        runs[share] = (worker.update_actor(batch), full_weights(worker.actor.module.hf))
    (base, base_weights), (metrics, weights) = runs[False], runs[True]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert metrics[key] == pytest.approx(base[key], rel=1e-5, abs=1e-7), key  # kl ~1e-3 from ~1e-6 logp noise
    assert max_abs_diff(weights, base_weights) < 1e-7


def test_loss_scale_factor_is_the_constant_of_seq_mean_token_sum_norm(tiny_model_path):
    """verl's actor.loss_scale_factor: the seq-mean-token-sum-norm loss is divided by it instead of
    data.max_response_length, so its gradient scales by their ratio; other modes ignore the divisor."""
    batch = _ppo_batch(tiny_model_path, seed=3)
    norm = "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"
    plain = make_worker(make_cfg(tiny_model_path, norm))
    scaled = make_worker(make_cfg(tiny_model_path, norm, "actor_rollout_ref.actor.loss_scale_factor=4"))
    horizon = plain.derived.agg_horizon
    assert (horizon, scaled.derived.agg_horizon, scaled.derived.critic_agg_horizon) == (
        plain.derived.response_length, 4, 4)  # the critic follows the actor's, as verl interpolates it
    got, want = _actor_grads(scaled, batch), _actor_grads(plain, batch)
    assert max(float((got[k] - want[k] * horizon / 4).abs().max()) for k in got) < 1e-6
    assert max(float(want[k].abs().max()) for k in want) > 1e-4
