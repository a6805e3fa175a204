"""The SFT step on the actor's update loop: token-mean NLL of the response tokens, blind to micro-batching."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_npu.sft import sft_step

from .helpers import full_weights, make_batch, make_cfg, make_worker, max_abs_diff

pytestmark = pytest.mark.usefixtures("process_group")


def _reference_nll(model_path: str, batch) -> float:
    """Token-mean NLL of the valid response tokens under the plain HF model, float64 log-softmax."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager")
    p = batch.prompt_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits  # (B, L, V)
    logp = torch.log_softmax(logits[:, p - 1 : -1].double(), -1).gather(-1, batch.response_ids[..., None])[..., 0]
    mask = batch.response_mask.bool()  # (B, T)
    return float(-logp[mask].sum() / mask.sum())


def test_sft_step_is_token_mean_nll_and_invariant_to_micro_batching(tiny_model_path):
    batch = make_batch(seed=50)
    runs = {}
    for name, overrides in {
        "8x1": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",),
        "1x8": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",),
        "dynamic+packed": ("actor_rollout_ref.actor.use_dynamic_bsz=True",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",
                           "actor_rollout_ref.model.use_remove_padding=True"),
    }.items():
        worker = make_worker(make_cfg(tiny_model_path, *overrides))
        before = full_weights(worker.actor.module.hf)
        metrics = sft_step(worker.actor, batch)
        runs[name] = (metrics, full_weights(worker.actor.module.hf))
        assert max_abs_diff(runs[name][1], before) > 1e-4, name  # the step moved the weights
    base, base_weights = runs["8x1"]
    assert list(base) == ["train/loss", "train/grad_norm", "train/lr", "train/skipped_steps"]
    assert base["train/loss"] == pytest.approx(_reference_nll(tiny_model_path, batch), rel=1e-5)
    assert base["train/lr"] == pytest.approx(0.01) and base["train/skipped_steps"] == 0
    for name, (metrics, weights) in runs.items():
        for key in ("train/loss", "train/grad_norm"):
            assert metrics[key] == pytest.approx(base[key], rel=1e-5), f"{name}: {key}"
        # SGD-like first step (optim.eps=1): weight differences ~ lr x gradient rounding.
        assert max_abs_diff(weights, base_weights) < 1e-7, name
