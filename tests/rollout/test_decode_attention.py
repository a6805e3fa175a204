"""The decode-step GQA attention against transformers' sdpa path (which copies the KV cache to Nq heads)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import grpo_npu.rollout.hf_rollout as hf_rollout
from grpo_npu.rollout import SamplingConfig
from grpo_npu.rollout.decode_attention import ATTN_IMPLEMENTATION, decode_attention, decode_attention_forward
from grpo_npu.rollout.hf_rollout import HFRollout

from tests.rollout.conftest import multinomial_as_the_static_loop


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("batch,heads,kv_heads,keys,dim", [(3, 4, 2, 7, 8), (2, 14, 2, 5, 16), (1, 6, 3, 1, 4)])
@pytest.mark.parametrize("masked", [True, False])
def test_decode_step_equals_sdpa_with_repeated_kv(batch, heads, kv_heads, keys, dim, masked):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(batch * 100 + heads)
    q = torch.randn(batch, heads, 1, dim, generator=g)  # (B, Nq, 1, D)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g) for _ in range(2))  # (B, Nkv, S, D)
    mask = None
    if masked:  # left padding: row b has b masked keys (at least one key stays)
        mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
        for b in range(batch):
            mask[b, ..., : min(b, keys - 1)] = False
    layer = _Layer(heads // kv_heads)
    want, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=dim ** -0.5)
    got, _ = decode_attention_forward(layer, q, k, v, mask, scaling=dim ** -0.5)
    assert got.shape == want.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # The reference written out: query head h reads KV head h // G.
    rep_k, rep_v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = (q @ rep_k.transpose(-1, -2)) * dim ** -0.5  # (B, Nq, 1, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(got, (scores.softmax(-1) @ rep_v).transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_prefill_goes_to_sdpa_unchanged():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    layer = _Layer(2)
    torch.testing.assert_close(decode_attention_forward(layer, q, k, v, None)[0],
                               sdpa_attention_forward(layer, q, k, v, None)[0], atol=0, rtol=0)


def test_switch_only_for_sdpa_and_restored(tiny_hf):
    assert tiny_hf.config._attn_implementation == "sdpa"
    with decode_attention(tiny_hf) as on:
        assert on and tiny_hf.config._attn_implementation == ATTN_IMPLEMENTATION
    assert tiny_hf.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), decode_attention(tiny_hf):
        raise RuntimeError("generation failed")
    assert tiny_hf.config._attn_implementation == "sdpa"
    tiny_hf.set_attn_implementation("eager")
    try:
        with decode_attention(tiny_hf) as on:
            assert not on and tiny_hf.config._attn_implementation == "eager"
    finally:
        tiny_hf.set_attn_implementation("sdpa")


def test_ops_attention_switched_on_its_reference_path_only(tiny_hf, monkeypatch):
    """The ``grpo_npu`` attention (patched in for packed rows and prompt sharing) is switched wherever it runs its
    PyTorch reference (CPU, CUDA: a packed-rows run on CUDA decoded through ``generate``, 6x slower at 1024
    tokens on an H100, and again 5x slower at the 0.5B shape once the ``cuda`` backend existed); where its NPU
    kernel serves the model's tensors it stays."""
    from grpo_npu.ops import attention as attention_op
    from grpo_npu.ops.patch import ATTN_IMPLEMENTATION as OPS, _register_attention

    _register_attention()
    tiny_hf.set_attn_implementation(OPS)
    try:
        with decode_attention(tiny_hf) as on:
            assert on and tiny_hf.config._attn_implementation == ATTN_IMPLEMENTATION
        assert tiny_hf.config._attn_implementation == OPS
        monkeypatch.setattr(attention_op.BACKEND, "pick", lambda x: "cuda")  # flash varlen for packed rows only
        with decode_attention(tiny_hf) as on:
            assert on and tiny_hf.config._attn_implementation == ATTN_IMPLEMENTATION
        monkeypatch.setattr(attention_op.BACKEND, "pick", lambda x: "npu")
        with decode_attention(tiny_hf) as on:
            assert not on and tiny_hf.config._attn_implementation == OPS
    finally:
        tiny_hf.set_attn_implementation("sdpa")


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(temperature=1.0, seed=7), dict(temperature=0.7, seed=3, top_p=0.9)],
                         ids=["greedy", "seeded", "seeded_top_p"])
def test_generate_same_tokens_and_logprobs_as_sdpa(tiny_hf, tiny_tokenizer, prompt_batch, monkeypatch, sampling):
    """The tiny model is GQA (4 heads, 2 KV heads); prompts are left-padded to different lengths. Without the
    decode attention the rollout calls ``generate``, here sampling as the static loop does."""
    assert tiny_hf.config.num_key_value_heads < tiny_hf.config.num_attention_heads
    ids, mask = prompt_batch
    rollout = HFRollout(tiny_hf, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    config = SamplingConfig(n=3, max_new_tokens=24, return_logprobs=True, **sampling)
    fast = rollout.generate(ids, mask, config)
    monkeypatch.setattr(hf_rollout, "decode_attention", lambda model: contextlib.nullcontext(False))
    monkeypatch.setattr(torch, "multinomial", multinomial_as_the_static_loop)
    plain = rollout.generate(ids, mask, config)
    assert torch.equal(fast.response_ids, plain.response_ids)
    assert torch.equal(fast.response_mask, plain.response_mask)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=0)


def test_generate_through_the_actor_wrapper_uses_decode_attention(tiny_hf, tiny_tokenizer, prompt_batch, monkeypatch):
    """The actor's module (workers.response_model) wraps the transformers model as ``.hf``: the switch reaches it."""
    import grpo_npu.rollout.decode_attention as da

    class Wrapper(torch.nn.Module):
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def generate(self, *args, **kwargs):
            return self.hf.generate(*args, **kwargs)

    calls = []
    forward = da.decode_attention_forward
    monkeypatch.setattr(da, "decode_attention_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    monkeypatch.setattr(da, "_registered", False)  # registers the counting function
    ids, mask = prompt_batch
    try:
        rollout = HFRollout(Wrapper(tiny_hf), pad_token_id=tiny_tokenizer.pad_token_id,
                            eos_token_ids=[tiny_tokenizer.eos_token_id])
        rollout.generate(ids, mask, SamplingConfig(do_sample=False, max_new_tokens=4, ignore_eos=True))
    finally:
        monkeypatch.undo()
        da._registered = False  # re-register the real function on the next use
    layers = tiny_hf.config.num_hidden_layers
    assert len(calls) == 4 * layers  # prefill + 3 decoding steps, every layer
    assert tiny_hf.config._attn_implementation == "sdpa"
