"""FLOP counts against torch.utils.flop_counter.FlopCounterMode on tiny random models (fp32, CPU).

FlopCounterMode counts matrix products only (mm, addmm, bmm, attention kernels), which is exactly what
:mod:`grpo_npu.perf.flops` counts, so the two are compared like with like. The models run eager
attention: FlopCounterMode has no formula for the CPU SDPA kernel, and eager computes the full L x L
score square and masks it, so whole-sequence forwards are compared with ``causal=False``. The causal
count (the model's work) is checked by decoding token by token through a KV cache, where every product
is exactly one query against its context.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from grpo_npu.perf.flops import ModelShape, decode_flops, decode_step_bytes, forward_flops, train_flops
from grpo_npu.workers.response_model import keep_last_layer_activations

TOLERANCE = 0.05  # the bound; the counts agree exactly today
VOCAB = 128
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, attn_implementation="eager")
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # GQA 4:2, qkv biases, tied embeddings
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),  # head_dim != hidden / heads
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
}


def tiny_model(family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**_COMMON, **extra)
    return model_cls(config).float(), ModelShape.from_hf_config(config)


def counted(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def assert_close(measured: int, ours: float) -> None:
    assert measured > 0
    assert abs(ours - measured) <= TOLERANCE * measured, f"ours {ours:.6g} vs FlopCounterMode {measured}"


def prompts(lengths: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]


LENGTHS = [32, 11]  # packed sequences: each attends only within itself, so each runs on its own


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_matches_flop_counter(family):
    model, shape = tiny_model(family)
    model.eval()
    ids = prompts(LENGTHS)

    def run():
        with torch.no_grad():
            for x in ids:
                model(x)

    ours = forward_flops(shape, LENGTHS, causal=False)
    # Every term is large enough here that leaving it out would break the 5% bound.
    assert min(ours.attention, ours.head, ours.linear) > TOLERANCE * ours.total
    assert_close(counted(run), ours.total)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_backward_matches_flop_counter(family, checkpointing):
    model, shape = tiny_model(family)
    model.train()  # HF checkpoints layers only in training mode
    if checkpointing:  # as the trainer does it (workers/response_model.py): every layer but the last
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert keep_last_layer_activations(list(model.model.layers))
    ids = prompts(LENGTHS)

    def run():
        for x in ids:
            model(x, use_cache=False).logits.sum().backward()

    ours = train_flops(shape, LENGTHS, causal=False, recompute=checkpointing)
    assert_close(counted(run), ours.total)
    if checkpointing:  # the recompute is a visible share of the total, so the bound can see it
        assert ours.total - train_flops(shape, LENGTHS, causal=False).total > TOLERANCE * ours.total


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_through_kv_cache_matches_decode_and_causal_counts(family):
    model, shape = tiny_model(family)
    model.eval()
    (ids,) = prompts([24])
    cache, total = DynamicCache(), 0
    with torch.no_grad():
        for i in range(ids.shape[1]):
            step = {}

            def run():
                step["out"] = model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)

            flops = counted(run)
            cache = step["out"].past_key_values
            assert_close(flops, decode_flops(shape, [i + 1]).total)  # one new token, i + 1 keys
            total += flops
    assert_close(total, forward_flops(shape, [ids.shape[1]], causal=True).total)


def test_batched_decode_counts_each_row_with_its_context():
    model, shape = tiny_model("qwen2")
    model.eval()
    contexts = [3, 17]  # two rows at different lengths; each is decoded with its own cache
    measured = 0
    with torch.no_grad():
        for ids in prompts(contexts):
            cache = DynamicCache()
            model(ids[:, :-1], past_key_values=cache, use_cache=True)
            measured += counted(lambda: model(ids[:, -1:], past_key_values=cache, use_cache=True))
    assert_close(measured, decode_flops(shape, contexts).total)


def test_head_tokens_and_value_head():
    model, shape = tiny_model("llama")
    critic = ModelShape.from_hf_config(model.config, value_head=True)
    assert (critic.head_width, critic.tied_embeddings) == (1, False)
    full = forward_flops(shape, [10, 6])
    scored = forward_flops(shape, [10, 6], head_tokens=4)
    assert scored.layers == full.layers and scored.head == full.head * 4 / 16
    with pytest.raises(ValueError, match=r"head_tokens=17 must be in \[0, 16\]"):
        forward_flops(shape, [10, 6], head_tokens=17)


def test_weights_and_kv_bytes_match_the_model():
    for family in FAMILIES:
        model, shape = tiny_model(family)
        matmul = sum(p.numel() for name, p in model.named_parameters()
                     if p.dim() == 2 and "embed_tokens" not in name)  # the projections and an untied lm_head
        tied_head = shape.hidden * VOCAB if shape.tied_embeddings else 0
        assert shape.read_weights == matmul + tied_head, family
        cfg = model.config
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * shape.head_dim * 2  # K and V, bf16
        assert shape.kv_bytes_per_token("bfloat16") == per_token
        assert decode_step_bytes(shape, keys=5, dtype=torch.bfloat16) == 2 * shape.read_weights + 5 * per_token


def test_unknown_model_type_names_the_known_ones():
    class Config:
        model_type = "qwen2_moe"

    with pytest.raises(ValueError, match=r"model_type 'qwen2_moe'.*qwen2, qwen3, llama"):
        ModelShape.from_hf_config(Config())
