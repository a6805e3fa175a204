"""The direct weight sync on an engine whose LM head is its own layer, with a padded vocabulary.

Its own module: one vLLM engine at a time per process, and the tied engine of test_vllm_weight_sync.py
is module-scoped. Vocabulary 1050: vLLM pads the embedding and the head to 1088 rows, which the sync
must leave out of the actor's (1050, H) tensors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from grpo_npu.config import RolloutConfig  # noqa: E402
from grpo_npu.device import Device  # noqa: E402
from grpo_npu.rollout import SamplingConfig, build_rollout  # noqa: E402
from grpo_npu.rollout.hf_rollout import HFRollout  # noqa: E402
from tests.rollout.test_vllm_weight_sync import KERNEL_ATOL, PERTURB, _kernel_errors  # noqa: E402

pytestmark = pytest.mark.vllm

VOCAB = 1050  # not a multiple of vLLM's 64-row vocabulary padding
LOGP_ATOL = 1e-4  # fp32 engine vs fp32 transformers (see test_vllm_rollout.py)


@pytest.fixture(scope="module")
def untied_path(tiny_model_path, tmp_path_factory):
    """The tiny kit's tokenizer with an untied, padded-vocabulary config (weights come from the sync)."""
    from transformers import AutoConfig, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-untied")
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.tie_word_embeddings, config.vocab_size = False, VOCAB
    config.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def actor(untied_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(5)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(untied_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(untied_path, tiny_tokenizer):
    cfg = RolloutConfig(name="vllm", load_format="dummy", tensor_model_parallel_size=1, max_num_seqs=16,
                        dtype="float32", max_num_batched_tokens=1024,
                        engine_kwargs={"vllm": {"kv_cache_memory_bytes": 128 * 1024**2}})
    rollout = build_rollout(cfg, device=Device("cpu"), model_path=untied_path, prompt_length=64, response_length=16,
                            pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    yield rollout
    rollout.close()


def test_untied_head_and_padded_vocabulary_follow_the_actor(engine, actor, tiny_tokenizer, prompt_batch, ref):
    state = {k: v.clone() for k, v in actor.state_dict().items()}
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert not engine.tied_embeddings
    sampling = SamplingConfig(do_sample=False, max_new_tokens=8, return_logprobs=True)
    hf = HFRollout(actor, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    for seed in (None, 4):  # the actor's weights, then moved ones: two syncs in a row
        weights = state if seed is None else ref.perturbed_weights(actor, scale=PERTURB, seed=seed)
        engine.update_weights(weights.items())
        assert engine.sync_path == "direct"
        errors = _kernel_errors(engine, weights)
        assert "lm_head" in errors and max(errors.values()) < KERNEL_ATOL, errors
        actor.load_state_dict(weights)
        out, want = engine.generate(*prompt_batch, sampling), hf.generate(*prompt_batch, sampling)
        assert torch.equal(out.response_ids, want.response_ids)
        torch.testing.assert_close(out.logprobs, want.logprobs, atol=LOGP_ATOL, rtol=0)
    actor.load_state_dict(state)
