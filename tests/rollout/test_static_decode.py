"""The static-cache decode loop against transformers ``generate`` on the same model, prompts and seed.

``generate`` is the reference: the loop must draw the same tokens (same processors, same RNG draws, with
``generate``'s ``torch.multinomial`` swapped for the loop's :func:`sample_tokens`), give the same processed
log-probs, stop the same rows at eos, and leave the choice to ``generate`` for what it does not cover.
:func:`sample_tokens` itself is checked against the probabilities it samples from. The CUDA test checks the
captured graph replays the eager step token for token.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_npu.rollout import SamplingConfig, hf_rollout
from grpo_npu.rollout.hf_rollout import HFRollout
from grpo_npu.rollout.static_decode import StaticKV, process_logits, sample_tokens, unsupported

from tests.rollout.conftest import multinomial_as_the_static_loop

SAMPLINGS = {
    "greedy": SamplingConfig(n=2, do_sample=False, max_new_tokens=12, return_logprobs=True),
    "temperature": SamplingConfig(n=3, temperature=0.7, max_new_tokens=12, seed=7, return_logprobs=True),
    "top_k": SamplingConfig(n=3, temperature=0.9, top_k=5, max_new_tokens=12, seed=8, return_logprobs=True),
    "top_p": SamplingConfig(n=3, temperature=1.0, top_p=0.8, max_new_tokens=12, seed=9, return_logprobs=True),
    "all": SamplingConfig(n=2, temperature=1.3, top_k=20, top_p=0.9, max_new_tokens=12, seed=10, return_logprobs=True),
}


def both_paths(model, tokenizer, ids, mask, sampling, monkeypatch):
    """(static loop output, generate output) of one HFRollout on ``model``; asserts which path each took.
    ``generate`` samples with the loop's sampler (torch.multinomial swapped), so seeded draws must agree."""
    rollout = HFRollout(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    calls = []
    real = hf_rollout.static_generate
    monkeypatch.setattr(hf_rollout, "static_generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    static = rollout.generate(ids, mask, sampling)
    assert calls == [1]
    with monkeypatch.context() as m:
        m.setattr(hf_rollout, "unsupported", lambda model: "forced for the test")
        m.setattr(torch, "multinomial", multinomial_as_the_static_loop)
        reference = rollout.generate(ids, mask, sampling)
    assert calls == [1]
    return static, reference


def assert_same(static, reference):
    assert torch.equal(static.response_ids, reference.response_ids)
    assert torch.equal(static.response_mask, reference.response_mask)
    assert static.stop_reason == reference.stop_reason
    if reference.logprobs is not None:
        torch.testing.assert_close(static.logprobs, reference.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_same_tokens_and_logprobs_as_generate(name, tiny_hf, tiny_tokenizer, prompt_batch, monkeypatch):
    ids, mask = prompt_batch
    static, reference = both_paths(tiny_hf, tiny_tokenizer, ids, mask, SAMPLINGS[name], monkeypatch)
    assert_same(static, reference)
    if name != "greedy":
        assert not torch.equal(static.response_ids[0], static.response_ids[1])  # it did sample


def test_rows_stop_at_eos_as_in_generate(tiny_hf, tiny_tokenizer, prompt_batch, ref, monkeypatch):
    eos = tiny_tokenizer.eos_token_id
    model = copy.deepcopy(tiny_hf)
    model.load_state_dict(ref.eos_heavy_weights(tiny_hf, eos))
    ids, mask = prompt_batch
    sampling = SamplingConfig(n=8, max_new_tokens=16, seed=0, return_logprobs=True)
    batch_rows = []  # rows of every forward the loop runs: the prefill's, then each decode step's
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        static, reference = both_paths(model, tiny_tokenizer, ids, mask, sampling, monkeypatch)
    finally:
        handle.remove()
    assert_same(static, reference)
    assert {"stop", "length"} <= set(static.stop_reason)
    # the loop's forwards come first (both_paths runs it before generate): one prefill of the B prompts,
    # then decode steps over all B*8 rows until at most half run, fewer rows after (stopped rows left)
    rows = ids.shape[0] * 8
    steps = batch_rows[: 1 + static.response_ids.shape[1] - 1]
    assert steps[0] == ids.shape[0] and steps[1] == rows
    assert steps[-1] < rows and steps[1:] == sorted(steps[1:], reverse=True)
    ref.check_stop_contract(static, eos=eos, pad=tiny_tokenizer.pad_token_id, max_new_tokens=16, rows=ids.shape[0] * 8)


def _random_model(tiny_model_path, model_type: str, **extra):
    """A random model of another architecture on the tiny kit's vocabulary (GQA, head_dim 32)."""
    base = AutoConfig.from_pretrained(tiny_model_path)
    config = AutoConfig.for_model(model_type, vocab_size=base.vocab_size, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  pad_token_id=base.pad_token_id, eos_token_id=base.eos_token_id,
                                  tie_word_embeddings=False, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_other_architectures_match_generate(model_type, tiny_model_path, tiny_tokenizer, prompt_batch, monkeypatch):
    model = _random_model(tiny_model_path, model_type)
    ids, mask = prompt_batch
    for sampling in (SAMPLINGS["greedy"], SAMPLINGS["all"]):
        assert_same(*both_paths(model, tiny_tokenizer, ids, mask, sampling, monkeypatch))


def test_what_the_loop_does_not_cover_goes_to_generate(tiny_model_path, tiny_hf, tiny_tokenizer, prompt_batch,
                                                      monkeypatch):
    assert unsupported(tiny_hf) is None
    sliding = _random_model(tiny_model_path, "mistral", sliding_window=8)
    assert "sliding" in unsupported(sliding)
    eager = copy.deepcopy(tiny_hf)
    eager.set_attn_implementation("eager")
    calls = []
    monkeypatch.setattr(hf_rollout, "static_generate", lambda *a, **k: calls.append(1))
    ids, mask = prompt_batch
    for model in (sliding, eager):
        rollout = HFRollout(model, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
        out = rollout.generate(ids, mask, SamplingConfig(do_sample=False, max_new_tokens=4))
        assert out.response_ids.shape == (ids.shape[0], 4)
    assert calls == []


def test_sample_tokens_draws_each_token_with_its_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])  # (2, 5)
    draws = 40_000
    torch.manual_seed(0)
    tokens = torch.stack([sample_tokens(probs) for _ in range(draws)])  # (draws, 2)
    assert tokens.dtype == torch.long
    freq = torch.bincount(tokens[:, 0], minlength=5).double() / draws
    sigma = (probs[0].double() * (1 - probs[0].double()) / draws).sqrt()
    assert ((freq - probs[0].double()).abs() <= 5 * sigma + 1e-12).all(), freq  # 5 sigma: a wrong rule fails
    assert freq[4] == 0  # a zero-probability token is never drawn
    assert (tokens[:, 1] == 4).all()
    with pytest.MonkeyPatch.context() as m:  # U = 0, the edge of torch.rand: the certain token still wins
        m.setattr(torch, "rand_like", torch.zeros_like)
        assert sample_tokens(probs).tolist()[1] == 4
    torch.manual_seed(1)
    again = sample_tokens(probs[:1].expand(64, 5))
    torch.manual_seed(1)
    assert torch.equal(again, sample_tokens(probs[:1].expand(64, 5)))  # the global generator decides


def test_a_row_draws_the_same_token_with_or_without_the_rows_that_left():
    probs = torch.softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(1)), dim=-1)
    torch.manual_seed(3)
    full = sample_tokens(probs)
    rows = torch.tensor([1, 4, 5])
    torch.manual_seed(3)
    assert torch.equal(sample_tokens(probs[rows], rows, 6), full[rows])
    after = torch.rand(2)  # the generator moved by one draw per (row, token) of all 6 rows, as for `full`
    torch.manual_seed(3)
    assert torch.equal(torch.rand(6 * 40 + 2)[-2:], after)


def test_static_kv_repeats_and_selects_rows():
    cache = StaticKV(length=4)
    cache.positions = torch.arange(2)
    k = torch.randn(2, 1, 2, 3)
    cache.update(k, -k, 0)
    cache.repeat_rows(3)  # prompt i -> rows 3i .. 3i+2
    assert cache.keys[0].shape == (6, 1, 4, 3) and torch.equal(cache.keys[0][4, :, :2], k[1])
    cache.select_rows(torch.tensor([0, 5]))
    assert torch.equal(cache.keys[0][:, :, :2], k) and torch.equal(cache.values[0][:, :, :2], -k)


def test_static_kv_writes_at_the_given_slots():
    cache = StaticKV(length=6)
    cache.positions = torch.arange(3)
    k = torch.randn(2, 2, 3, 4)
    keys, values = cache.update(k, -k, 0)
    assert keys.shape == (2, 2, 6, 4) and torch.equal(keys[:, :, :3], k) and keys[:, :, 3:].eq(0).all()
    cache.visible = 3  # the prefill sees the prompt's slots only
    keys, _ = cache.update(k, -k, 0)
    assert keys.shape == (2, 2, 3, 4) and torch.equal(keys, k)
    cache.visible, cache.positions = 6, torch.tensor([4])
    step = torch.randn(2, 2, 1, 4)
    keys, values = cache.update(step, -step, 0)
    assert torch.equal(keys[:, :, 4:5], step) and torch.equal(values[:, :, 4:5], -step) and keys[:, :, 3].eq(0).all()


def test_processors_match_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    s = SamplingConfig(temperature=0.8, top_k=10, top_p=0.7)
    want = TopPLogitsWarper(0.7)(None, TopKLogitsWarper(10)(None, TemperatureLogitsWarper(0.8)(None, logits)))
    assert torch.equal(process_logits(logits, s), want)
    assert torch.equal(process_logits(logits, SamplingConfig(do_sample=False)), logits)


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager_steps(tiny_model_path, tiny_tokenizer, prompt_batch, monkeypatch):
    """bf16 on CUDA: the captured step replays the eager step token for token, and the capture happened."""
    from grpo_npu.rollout import static_decode

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).cuda().eval()
    ids, mask = prompt_batch
    graphs = []
    real_release = static_decode._DecodeStep.release

    def recording(step):
        graphs.append(step.replay is not None and not step.capture_failed)
        real_release(step)

    monkeypatch.setattr(static_decode._DecodeStep, "release", recording)
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=24, seed=3, return_logprobs=True)
    rollout = HFRollout(model, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    replayed = rollout.generate(ids, mask, sampling)
    monkeypatch.setattr(hf_rollout, "static_generate",
                        lambda *a, **k: static_decode.static_generate(*a, **{**k, "graphs": None}))
    eager = rollout.generate(ids, mask, sampling)
    assert graphs == [True, False]
    assert torch.equal(replayed.response_ids, eager.response_ids)
    torch.testing.assert_close(replayed.logprobs, eager.logprobs, atol=1e-5, rtol=0)


def test_prefill_mask_covers_the_prompt_only(tiny_hf, tiny_tokenizer, prompt_batch):
    """The prefill's mask is (B, 1, P, P) as generate's, not (B, 1, P, P + T): memory of long responses; and
    the prefill runs once per prompt (B rows), the decode steps over its n samples (B * n rows)."""
    shapes = []
    handle = tiny_hf.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["attention_mask"].shape)), with_kwargs=True)
    try:
        ids, mask = prompt_batch
        rollout = HFRollout(tiny_hf, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
        rollout.generate(ids, mask, SamplingConfig(n=2, do_sample=False, max_new_tokens=5, ignore_eos=True))
    finally:
        handle.remove()
    rows, width = ids.shape[0] * 2, int(mask.sum(dim=1).max())
    assert shapes[0] == (ids.shape[0], 1, width, width)
    assert shapes[1:] == [(rows, 1, 1, width + 5)] * 4


@pytest.mark.parametrize("device, sampling", [("cpu", "all"), pytest.param("cuda", "greedy", marks=pytest.mark.cuda)])
def test_the_ops_attention_decodes_through_the_static_loop(device, sampling, tiny_hf, tiny_model_path, tiny_tokenizer,
                                                           prompt_batch, monkeypatch):
    """The grpo_npu attention (patched in for packed-row or shared-prompt training) is swapped for the decode
    attention during generation, so the static loop runs; same tokens as the plain model; the patch is back
    afterwards. On CPU the op runs its reference; on CUDA (bf16) its backend is ``cuda`` (torch's flash varlen
    kernel, for packed rows only), where until 661392f it fell back to ``generate`` (5x slower generation at the
    0.5B shape on an H100)."""
    from grpo_npu.ops import attention as attention_op
    from grpo_npu.ops import patch_model

    plain = (tiny_hf if device == "cpu"
             else AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).cuda().eval())
    patched = copy.deepcopy(plain)
    patch_model(patched, ops=("attention",))
    assert patched.config._attn_implementation == "grpo_npu"
    if device == "cuda" and attention_op.BACKEND.pick(next(patched.parameters())) != "cuda":
        pytest.skip("this torch has no flash varlen kernel: the op runs its reference, covered on CPU")
    calls = []
    real = hf_rollout.static_generate
    monkeypatch.setattr(hf_rollout, "static_generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask = prompt_batch
    config = SAMPLINGS[sampling]
    rollout = HFRollout(patched, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    out = rollout.generate(ids, mask, config)
    reference = HFRollout(plain, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    assert_same(out, reference.generate(ids, mask, config))
    assert calls == [1, 1] and patched.config._attn_implementation == "grpo_npu"
