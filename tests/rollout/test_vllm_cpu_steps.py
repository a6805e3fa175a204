"""A vllm-cpu engine's prefill and decode steps, timed in its model runner (grpo_npu.rollout.vllm_cpu_steps)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from grpo_npu.rollout import vllm_cpu_steps


class FakeRunner:
    """execute_model / sample_tokens as vLLM's model runner: None from execute_model when sampling follows."""

    def __init__(self, samples_later: bool = True):
        self.samples_later = samples_later

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        time.sleep(0.002 * scheduler_output.total_num_scheduled_tokens)
        return None if self.samples_later else "output"

    def sample_tokens(self, grammar_output):
        time.sleep(0.001)
        return "output"


def _step(runner, tokens_per_request: dict):
    out = SimpleNamespace(total_num_scheduled_tokens=sum(tokens_per_request.values()),
                          num_scheduled_tokens=tokens_per_request)
    if runner.execute_model(out) is None:
        runner.sample_tokens(None)


@pytest.mark.parametrize("samples_later", [True, False])
def test_steps_that_compute_a_prompt_are_prefill_and_the_rest_decode(samples_later):
    worker = SimpleNamespace(model_runner=FakeRunner(samples_later))
    assert vllm_cpu_steps.install(worker)
    runner = worker.model_runner
    _step(runner, {"a": 5, "b": 3, "a-child": 1})  # two prompts (a child of a cached prompt computes 1 token)
    for _ in range(4):
        _step(runner, {"a": 1, "b": 1, "a-child": 1})
    _step(runner, {})  # nothing scheduled: no step
    sums = vllm_cpu_steps.take(worker)
    assert sums["rollout/prefill_steps"] == 1 and sums["rollout/decode_steps"] == 4
    assert sums["rollout/prefill_s"] >= 0.018 and sums["rollout/decode_s"] >= 4 * 0.006  # the sleeps, at least
    assert sums["rollout/decode_s"] < 4 * 0.006 + 0.5
    assert set(vllm_cpu_steps.take(worker).values()) == {0}  # taken: counting starts again
    assert vllm_cpu_steps.take(SimpleNamespace(model_runner=object())) is None  # not installed
    assert not vllm_cpu_steps.install(SimpleNamespace())  # no model runner


@pytest.mark.vllm
def test_an_engine_reports_one_prefill_step_and_a_decode_step_per_further_token(
        tiny_model_path, tiny_tokenizer, prompt_batch, ref):
    pytest.importorskip("vllm")
    from grpo_npu.rollout import SamplingConfig

    engine = ref.tiny_vllm_engine(tiny_model_path, tiny_tokenizer)
    try:
        sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=9, ignore_eos=True, seed=1)
        for _ in range(2):  # the second call counts its own steps only
            start = time.perf_counter()
            out = engine.generate(*prompt_batch, sampling)
            wall = time.perf_counter() - start
            metrics = out.metrics
            assert metrics["rollout/prefill_steps"] == 1 and metrics["rollout/decode_steps"] == 8  # tokens 2..9
            assert 0 < metrics["rollout/prefill_s"] and 0 < metrics["rollout/decode_s"]
            assert metrics["rollout/prefill_s"] + metrics["rollout/decode_s"] < wall
    finally:
        engine.close()
