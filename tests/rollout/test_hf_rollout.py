"""The transformers backend against slow, padding-free references computed here."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_npu.rollout import SamplingConfig
from grpo_npu.rollout import hf_rollout
from grpo_npu.rollout.hf_rollout import HFRollout


@pytest.fixture(scope="module")
def rollout(tiny_hf, tiny_tokenizer):
    return HFRollout(tiny_hf, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])


@torch.no_grad()
def greedy_reference(model, prompt_ids, prompt_mask, max_new_tokens, eos):
    """One prompt at a time, no cache, no padding: argmax until eos or the limit."""
    rows = []
    for ids, mask in zip(prompt_ids, prompt_mask):
        seq = ids[mask.bool()].tolist()
        out = []
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([seq + out])).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
        rows.append(out)
    return rows


def test_greedy_matches_reference_loop(rollout, tiny_hf, prompt_batch, tiny_tokenizer, ref):
    ids, mask = prompt_batch
    out = rollout.generate(ids, mask, SamplingConfig(do_sample=False, max_new_tokens=10, return_logprobs=True))
    expected = greedy_reference(tiny_hf, ids, mask, 10, tiny_tokenizer.eos_token_id)
    got = [out.response_ids[i, : int(out.response_mask[i].sum())].tolist() for i in range(len(expected))]
    assert got == expected
    want_logp = ref.logp(tiny_hf, ids, mask, out.response_ids, out.response_mask, temperature=1.0)
    torch.testing.assert_close(out.logprobs * out.response_mask, want_logp, atol=1e-4, rtol=0)


def test_greedy_n_repeats_rows_per_prompt(rollout, prompt_batch):
    ids, mask = prompt_batch
    out = rollout.generate(ids, mask, SamplingConfig(n=2, do_sample=False, max_new_tokens=6))
    single = rollout.generate(ids, mask, SamplingConfig(n=1, do_sample=False, max_new_tokens=6))
    torch.testing.assert_close(out.response_ids, single.response_ids.repeat_interleave(2, dim=0))


def test_sampled_logprobs_are_temperature_scaled_and_rows_grouped_by_prompt(rollout, tiny_hf, prompt_batch, ref):
    ids, mask = prompt_batch
    n, temperature = 3, 0.7
    out = rollout.generate(ids, mask, SamplingConfig(n=n, temperature=temperature, max_new_tokens=8, seed=11,
                                                     return_logprobs=True))
    assert out.response_ids.shape[0] == ids.shape[0] * n
    # Rows i*n..i*n+n-1 must continue prompt i: the reference scores each row against prompt row // n.
    want = ref.logp(tiny_hf, ids, mask, out.response_ids, out.response_mask, temperature=temperature, n=n)
    torch.testing.assert_close(out.logprobs * out.response_mask, want, atol=1e-4, rtol=0)
    untempered = ref.logp(tiny_hf, ids, mask, out.response_ids, out.response_mask, temperature=1.0, n=n)
    assert (out.logprobs - untempered).abs()[out.response_mask.bool()].mean() > 1e-2


def test_top_k_logprobs_are_renormalised_over_the_kept_tokens(rollout, tiny_hf, prompt_batch):
    ids, mask = prompt_batch
    k, temperature = 5, 0.9
    out = rollout.generate(ids[:1], mask[:1], SamplingConfig(temperature=temperature, top_k=k, max_new_tokens=5,
                                                             seed=3, return_logprobs=True))
    prompt = ids[0][mask[0].bool()]
    response = out.response_ids[0, : int(out.response_mask[0].sum())]
    with torch.no_grad():
        logits = tiny_hf(torch.cat([prompt, response])[None]).logits[0] / temperature
    for t, token in enumerate(response.tolist()):
        row = logits[len(prompt) + t - 1]
        kept = torch.full_like(row, float("-inf"))
        top = row.topk(k).indices
        kept[top] = row[top]
        assert token in top.tolist()
        torch.testing.assert_close(out.logprobs[0, t], torch.log_softmax(kept, -1)[token], atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone(rollout, prompt_batch):
    ids, mask = prompt_batch
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    before = torch.get_rng_state()
    a = rollout.generate(ids, mask, sampling)
    assert torch.equal(torch.get_rng_state(), before)
    b = rollout.generate(ids, mask, sampling)
    c = rollout.generate(ids, mask, SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=6))
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert not torch.equal(a.response_ids[0], a.response_ids[1])  # two samples of one prompt differ


def test_stop_at_eos_and_at_length(tiny_hf, prompt_batch, tiny_tokenizer, ref):
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    model = copy.deepcopy(tiny_hf)
    model.load_state_dict(ref.eos_heavy_weights(tiny_hf, eos))
    rollout = HFRollout(model, pad_token_id=pad, eos_token_ids=[eos])
    ids, mask = prompt_batch
    out = rollout.generate(ids, mask, SamplingConfig(n=8, max_new_tokens=16, seed=0))
    ref.check_stop_contract(out, eos=eos, pad=pad, max_new_tokens=16, rows=ids.shape[0] * 8)
    lengths = out.response_mask.sum(1)
    assert {"stop", "length"} <= set(out.stop_reason)
    assert len(set(lengths[torch.tensor([r == "stop" for r in out.stop_reason])].tolist())) > 3

    full = rollout.generate(ids, mask, SamplingConfig(n=8, max_new_tokens=16, seed=0, ignore_eos=True))
    assert full.response_mask.eq(1).all() and full.response_ids.shape[1] == 16
    assert set(full.stop_reason) == {"length"}
    assert full.response_ids.eq(eos).any()  # eos was sampled and generation went on


def test_update_weights_sleep_and_wake_are_no_ops(rollout, tiny_hf, prompt_batch):
    ids, mask = prompt_batch
    sampling = SamplingConfig(do_sample=False, max_new_tokens=4)
    before = rollout.generate(ids, mask, sampling)

    def weights():
        raise AssertionError("the hf rollout must not consume the weight iterator")
        yield  # pragma: no cover

    rollout.wake_up(["weights"])
    rollout.update_weights(weights())
    rollout.reset_prefix_cache()
    rollout.wake_up(["kv_cache"])
    after = rollout.generate(ids, mask, sampling)
    rollout.sleep()
    assert torch.equal(before.response_ids, after.response_ids)


def test_training_mode_is_restored(tiny_hf, tiny_tokenizer, prompt_batch):
    model = copy.deepcopy(tiny_hf).train()
    rollout = HFRollout(model, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    ids, mask = prompt_batch
    rollout.generate(ids, mask, SamplingConfig(do_sample=False, max_new_tokens=2))
    assert model.training


def test_bad_prompts_are_refused(rollout, prompt_batch):
    ids, mask = prompt_batch
    with pytest.raises(ValueError, match="not left-padded"):
        rollout.generate(ids, mask.flip(1), SamplingConfig(max_new_tokens=2))
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] are empty"):
        rollout.generate(ids, empty, SamplingConfig(max_new_tokens=2))


def test_unused_left_padding_is_not_generated_over(rollout, prompt_batch, monkeypatch):
    """Prompts padded to data.max_prompt_length: generate sees only the longest prompt's columns, same tokens."""
    ids, mask = prompt_batch
    pad = 24
    wide_ids = torch.cat([torch.zeros(ids.shape[0], pad, dtype=ids.dtype), ids], dim=1)  # (B, pad + P)
    wide_mask = torch.cat([torch.zeros(mask.shape[0], pad, dtype=mask.dtype), mask], dim=1)
    widths = []
    real = hf_rollout.static_generate

    def recording(model, ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(hf_rollout, "static_generate", recording)
    sampling = SamplingConfig(do_sample=False, max_new_tokens=6)
    narrow, wide = rollout.generate(ids, mask, sampling), rollout.generate(wide_ids, wide_mask, sampling)
    longest = int(mask.sum(dim=1).max())
    assert widths == [longest, longest]
    assert torch.equal(narrow.response_ids, wide.response_ids)
