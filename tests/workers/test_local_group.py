"""LocalGroup + HybridWorker end to end in this process: generate with the colocated rollout, then the
log-probs of what was generated agree with the engine's own, and worker errors name rank and method."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.batch import RolloutBatch
from grpo_npu.rollout import training_sampling
from grpo_npu.workers import LocalGroup, WorkerError
from grpo_npu.workers.hybrid import HybridWorker

from .helpers import make_batch, make_cfg


def test_generate_then_log_probs_agree_with_engine(tiny_model_path):
    cfg = make_cfg(tiny_model_path, "actor_rollout_ref.rollout.calculate_log_probs=True")
    with LocalGroup(HybridWorker, device_kind="cpu", args=(cfg,)) as group:
        assert group.call("init_model", 10) == [{"actor": True, "ref": False, "critic": False, "rollout": True}]
        prompts = make_batch(seed=20, rows=4)
        sampling = training_sampling(cfg.actor_rollout_ref.rollout, response_length=6, seed=3)
        (out,) = group.call("generate", prompts.prompt_ids, prompts.prompt_mask, sampling)
        assert out.response_ids.shape[0] == 8 and out.response_ids.shape[1] <= 6
        batch = RolloutBatch(prompts.prompt_ids.repeat_interleave(2, 0), prompts.prompt_mask.repeat_interleave(2, 0),
                             out.response_ids, out.response_mask)
        (logp, metrics, _), = group.chunk_and_call("compute_log_prob", batch)
        mask = batch.response_mask.bool()
        torch.testing.assert_close(logp[mask], out.logprobs[mask].float(), atol=1e-4, rtol=0)
        assert metrics["actor/entropy"] > 0

        with pytest.raises(WorkerError, match=r"rank 0 failed in compute_values\(\)(.|\n)*no critic") as info:
            group.call("compute_values", batch)
        assert info.value.rank == 0 and info.value.method == "compute_values"
        with pytest.raises(WorkerError, match="no public method"):
            group.call("_need", "actor")


# LoRA (workers/lora.py): the engine gets the merged weights W + alpha / r x B A under the base names
LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=64")


@pytest.mark.vllm
@pytest.mark.parametrize("lora", [(), LORA], ids=["full", "lora"])
def test_vllm_engine_receives_the_actors_weights(tiny_model_path, lora):
    """The engine starts from random (dummy) weights: only a working sync from the FSDP actor, tied
    lm_head included, makes its sampled-token log-probs equal the actor's -- before and after an update."""
    pytest.importorskip("vllm")
    if lora:
        pytest.importorskip("peft")
    cfg = make_cfg(tiny_model_path, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.calculate_log_probs=True",
                   "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.load_format=dummy", "actor_rollout_ref.rollout.max_num_seqs=16",
                   "actor_rollout_ref.rollout.max_num_batched_tokens=256", "actor_rollout_ref.actor.optim.lr=0.1", *lora)
    prompts = make_batch(seed=21, rows=4)
    with LocalGroup(HybridWorker, device_kind="cpu", args=(cfg,)) as group:
        group.call("init_model", 10)
        for step in range(2):
            sampling = training_sampling(cfg.actor_rollout_ref.rollout, response_length=6, seed=step)
            (out,) = group.call("generate", prompts.prompt_ids, prompts.prompt_mask, sampling)
            batch = RolloutBatch(prompts.prompt_ids.repeat_interleave(2, 0), prompts.prompt_mask.repeat_interleave(2, 0),
                                 out.response_ids, out.response_mask)
            (logp, _, _), = group.chunk_and_call("compute_log_prob", batch)
            mask = batch.response_mask.bool()
            torch.testing.assert_close(logp[mask], out.logprobs[mask].float(), atol=1e-4, rtol=0)
            advantages = torch.linspace(-1, 1, 8)[:, None] * batch.response_mask
            (metrics,) = group.chunk_and_call("update_actor", batch.replace(old_logp=logp, advantages=advantages))
            (moved, _, _), = group.chunk_and_call("compute_log_prob", batch)
            assert float((moved - logp)[mask].abs().max()) > 1e-2  # so a stale engine would fail the next check
