"""The per-step sleep/wake contract, checked call by call against recording fakes (no engine needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_npu.device import Device, MemoryStats
from grpo_npu.rollout import MemoryLedger, SamplingConfig, run_rollout_step
from grpo_npu.rollout.base import GenerationOutput, Rollout

# The documented order (npu_reference.md section 4), as the fakes below spell each call.
CONTRACT = [
    "expandable_segments:False",
    "empty_cache",
    "wake_up(weights)",
    "update_weights",
    "reset_prefix_cache",
    "free",
    "empty_cache",
    "wake_up(kv_cache)",
    "generate",
    "sleep(level)",
    "empty_cache",
    "expandable_segments:True",
]


class RecordingDevice:
    """Records allocator calls; memory_stats is read by the ledger and not part of the contract."""

    kind = "npu"
    alloc_conf_env = "PYTORCH_NPU_ALLOC_CONF"

    def __init__(self, calls: list[str]):
        self.calls = calls
        self.allocated = 0

    def set_expandable_segments(self, enabled: bool) -> bool:
        self.calls.append(f"expandable_segments:{enabled}")
        return True

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(self.allocated, self.allocated, 0, 0, 10 * 1024**3, 16 * 1024**3, 0)

    def env_has_expandable_segments(self) -> bool:
        return False

    def get_rng_state(self):
        return None

    def engine_dtype(self, name: str) -> torch.dtype:
        return Device(self.kind).engine_dtype(name)

    def set_rng_state(self, state) -> None:
        pass


class RecordingRollout(Rollout):
    def __init__(self, calls: list[str], fail: bool = False):
        self.calls, self.fail = calls, fail

    def generate(self, prompt_ids, prompt_mask, sampling):
        self.calls.append("generate")
        if self.fail:
            raise RuntimeError("generation failed")
        return GenerationOutput(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), None, ["length"])

    def update_weights(self, named_tensors):
        assert len(list(named_tensors)) == 2
        self.calls.append("update_weights")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self):
        self.calls.append("sleep(level)")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags)})")


def _weights():
    return iter([("a", torch.zeros(2)), ("b", torch.ones(2))])


def _prompts():
    return torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]])


def test_step_runs_the_documented_order():
    calls: list[str] = []
    out = run_rollout_step(RecordingRollout(calls), RecordingDevice(calls), _weights(), *_prompts(),
                           SamplingConfig(max_new_tokens=1), free_weights=lambda: calls.append("free"))
    assert calls == CONTRACT
    assert out.metrics["rollout/weight_sync_s"] >= 0


def test_remax_baselines_are_generated_in_the_same_wake():
    """The greedy baseline pass runs right after the sampled one, before the engine sleeps: one sync per step."""
    calls: list[str] = []
    greedy = SamplingConfig(n=1, do_sample=False, max_new_tokens=1)
    out = run_rollout_step(RecordingRollout(calls), RecordingDevice(calls), _weights(), *_prompts(),
                           SamplingConfig(max_new_tokens=1), free_weights=lambda: calls.append("free"), baseline=greedy)
    at = CONTRACT.index("generate")
    assert calls == CONTRACT[: at + 1] + ["generate"] + CONTRACT[at + 1:]
    assert isinstance(out.baseline, GenerationOutput) and out.baseline.baseline is None


@pytest.mark.parametrize("logprobs", [False, True])
def test_the_baseline_pass_is_greedy_and_asks_for_what_the_training_pass_asks(logprobs):
    from grpo_npu.config import load_config
    from grpo_npu.rollout import baseline_sampling, training_sampling

    cfg = load_config(["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                       f"actor_rollout_ref.rollout.calculate_log_probs={logprobs}"]).actor_rollout_ref.rollout
    greedy = baseline_sampling(cfg, 16)
    assert (greedy.n, greedy.do_sample, greedy.max_new_tokens) == (1, False, 16)
    assert greedy.return_logprobs is training_sampling(cfg, 16).return_logprobs is logprobs


def test_step_sleeps_even_when_generation_fails():
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="generation failed"):
        run_rollout_step(RecordingRollout(calls, fail=True), RecordingDevice(calls), _weights(), *_prompts(),
                         SamplingConfig(max_new_tokens=1), free_weights=lambda: calls.append("free"))
    assert calls == CONTRACT


def test_step_reports_memory_metrics_per_cycle():
    calls: list[str] = []
    device = RecordingDevice(calls)
    ledger = MemoryLedger(device)
    out = run_rollout_step(RecordingRollout(calls), device, _weights(), *_prompts(), SamplingConfig(max_new_tokens=1),
                           ledger=ledger)
    expected = {f"rollout/mem_{kind}_gb_{when}" for kind in ("allocated", "reserved", "free")
                for when in ("before_wake", "after_wake", "before_sleep", "after_sleep")}
    assert expected <= set(out.metrics)
    assert out.metrics["rollout/mem_free_gb_after_sleep"] == pytest.approx(10.0)


# ------------------------------------------------------------------------------------------------
# The vLLM backend's translation of the same step, against a recording fake vllm.LLM
# ------------------------------------------------------------------------------------------------
class FakeWorker:
    """A vLLM worker with the >= 0.11 reload API, recording what it was given."""

    def __init__(self, calls: list[str]):
        self.calls = calls
        self.loaded: list[str] = []
        self.model_runner = SimpleNamespace(reload_weights=self._runner_reload)

    def _runner_reload(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        raise AssertionError("the worker's reload_weights is the entry point")

    def reload_weights(self, *args, **kwargs):
        assert kwargs["is_checkpoint_format"] is True
        self.loaded += [name for name, _ in kwargs["weights_iterator"]]
        self.calls.append("update_weights")


class FakeLLM:
    """Records the calls VLLMRollout makes, spelled as in CONTRACT."""

    def __init__(self, calls: list[str]):
        self.calls = calls
        self.worker = FakeWorker(calls)
        self.sleep_levels: list[int] = []

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags)})")

    def sleep(self, level):
        self.sleep_levels.append(level)
        self.calls.append("sleep(level)")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def collective_rpc(self, method, args=()):
        return [method(self.worker, *args)]

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append("generate")
        completion = SimpleNamespace(index=0, token_ids=[7, 2], finish_reason="stop", logprobs=None)
        return [SimpleNamespace(outputs=[completion]) for _ in prompts]


@pytest.mark.vllm
@pytest.mark.parametrize("level", [1, 2])
def test_vllm_backend_translates_the_step_into_engine_calls(level):
    pytest.importorskip("vllm")
    from grpo_npu.rollout.vllm_rollout import VLLMRollout

    calls: list[str] = []
    llm = FakeLLM(calls)
    rollout = VLLMRollout(llm, pad_token_id=0, eos_token_ids=[2], sleep_level=level, sleeps=True)
    rollout.sleep()  # as build_vllm_rollout leaves it
    calls.clear()
    out = run_rollout_step(rollout, RecordingDevice(calls), _weights(), *_prompts(), SamplingConfig(max_new_tokens=4),
                           free_weights=lambda: calls.append("free"))
    assert calls == CONTRACT
    assert llm.sleep_levels == [level, level]
    assert llm.worker.loaded == ["a", "b"]
    assert out.response_ids.tolist() == [[7, 2]] and out.stop_reason == ["stop"]


@pytest.mark.vllm
def test_vllm_backend_without_sleep_mode_skips_only_sleep_and_wake():
    pytest.importorskip("vllm")
    from grpo_npu.rollout.vllm_rollout import VLLMRollout

    calls: list[str] = []
    rollout = VLLMRollout(FakeLLM(calls), pad_token_id=0, eos_token_ids=[2], sleep_level=2, sleeps=False)
    run_rollout_step(rollout, RecordingDevice(calls), _weights(), *_prompts(), SamplingConfig(max_new_tokens=4),
                     free_weights=lambda: calls.append("free"))
    assert calls == [c for c in CONTRACT if not c.startswith(("wake_up", "sleep"))]


@pytest.mark.vllm
def test_vllm_backend_refuses_an_empty_weight_stream():
    pytest.importorskip("vllm")
    from grpo_npu.rollout.vllm_rollout import VLLMRollout

    rollout = VLLMRollout(FakeLLM([]), pad_token_id=0, eos_token_ids=[2], sleep_level=1, sleeps=True)
    with pytest.raises(ValueError, match="no tensors"):
        rollout.update_weights(iter([]))


def test_old_workers_without_the_reload_api_load_into_the_model():
    from grpo_npu.rollout.vllm_weights import load_weights_on_worker, supports_weight_reload

    loaded = []
    model = SimpleNamespace(load_weights=lambda it: loaded.extend(name for name, _ in it))
    old = SimpleNamespace(reload_weights=lambda: None,  # vLLM < 0.11: reload from disk, no arguments
                          model_runner=SimpleNamespace(reload_weights=lambda: None, model=model))
    assert not supports_weight_reload(old)
    assert load_weights_on_worker(old, _weights()) == 2 and loaded == ["a", "b"]
    assert supports_weight_reload(FakeWorker([]))


@pytest.mark.vllm
def test_vllm_backend_refuses_weights_or_generation_while_asleep():
    pytest.importorskip("vllm")
    from grpo_npu.rollout.vllm_rollout import VLLMRollout

    calls: list[str] = []
    rollout = VLLMRollout(FakeLLM(calls), pad_token_id=0, eos_token_ids=[2], sleep_level=1, sleeps=True)
    rollout.sleep()
    with pytest.raises(RuntimeError, match=r"wake_up\(\['weights'\]\) first"):
        rollout.update_weights(_weights())
    rollout.wake_up(["weights"])
    rollout.update_weights(_weights())
    with pytest.raises(RuntimeError, match=r"sleeps \(\['kv_cache'\]\)"):
        rollout.generate(*_prompts(), SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="unknown tags"):
        rollout.wake_up(["optimizer"])
    rollout.wake_up()  # None: whatever still sleeps
    rollout.wake_up(["kv_cache"])  # already awake: no engine call
    assert calls == ["sleep(level)", "wake_up(weights)", "update_weights", "wake_up(kv_cache)"]
    assert not rollout.asleep


def test_only_the_rotary_reload_warning_is_hidden():
    import logging

    from grpo_npu.rollout.vllm_weights import _BenignReloadWarnings

    def record(layer):
        return logging.LogRecord("x", logging.WARNING, "f", 1, "%s: Failed to load weights", (layer,), None)

    keep = _BenignReloadWarnings().filter
    assert not keep(record("RotaryEmbedding"))
    assert not keep(record("YaRNScalingRotaryEmbedding"))
    assert keep(record("ParallelLMHead"))
