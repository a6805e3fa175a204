"""Peak dense matmul FLOP/s and memory bandwidth of the devices a run may use, and the CPU's, measured.

Accelerators are looked up by the device module's ``get_device_name()`` string
(:meth:`grpo_npu.device.Device.device_name`; passed in: this module never touches a device). Sources:

NVIDIA -- the product datasheets. Their tensor-core rates are printed "with sparsity"; the dense rate
used here is half. fp32 is the non-tensor FP32 rate: torch keeps fp32 matmuls off TF32 unless
``torch.backends.cuda.matmul.allow_tf32`` is set.
    H100 SXM / PCIe / NVL -- "NVIDIA H100 Tensor Core GPU" datasheet: BF16/FP16 1,979 / 1,513 / 1,671
        TFLOPS (sparse); FP32 67 / 51 / 60 TFLOPS; memory bandwidth 3.35 / 2.0 / 3.9 TB/s.
    H200 SXM / NVL -- "NVIDIA H200 Tensor Core GPU" datasheet: BF16/FP16 1,979 / 1,671 TFLOPS (sparse);
        FP32 67 / 60 TFLOPS; 4.8 TB/s both.
    A100 SXM / PCIe -- "NVIDIA A100 Tensor Core GPU" datasheet: BF16/FP16 312 TFLOPS dense (624 sparse),
        FP32 19.5 TFLOPS; bandwidth 80GB SXM 2,039 GB/s, 80GB PCIe 1,935 GB/s, 40GB (both) 1,555 GB/s.

Ascend 910B -- Huawei publishes no per-variant chip datasheet. The compute peak is derived from CANN's
own platform description (``<arch>-linux/data/platform_config/Ascend910B<k>.ini``, CANN 8.1.RC1):
cube cores x a 16x16x16 multiply-add cube per cycle x 2 FLOPs x ``cube_freq``:
    910B1 24 cores at 1850 MHz = 363.7 TFLOP/s    910B2 24 at 1800 = 353.9
    910B3 20 cores at 1800 MHz = 294.9 TFLOP/s    910B4 20 at 1500 = 245.8
for fp16 and bf16 alike. CANN lists no fp32 cube rate; a 32-bit cube fractal holds half as many values
(16x8x16), so fp32 is taken as half the fp16 rate -- an upper bound. Memory bandwidth: 1.6 TB/s, the
"up to 1.6 TB/s" HBM figure of Huawei's Atlas A2 product pages, for every variant (CANN gives none; for
the 32 GB 910B4 it is an upper bound). Only these four exact names match: a variant such as
``Ascend910B4-1`` or ``Ascend910B2C`` is unknown rather than guessed; pass a :class:`DeviceSpec`.

CPU -- no table: :func:`measured_cpu_matmul_flops` times one large matmul and
:func:`measured_cpu_bandwidth` one copy past the last-level cache, once per process
(:func:`cpu_bandwidth_probe` measures it anew: a shared host's bandwidth moves within seconds, so the
trainer re-probes between steps). All ranks of a CPU run share one machine, so its peak is not
multiplied by the world size (``ranks_share_device``).
"""

from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

from grpo_npu.ops.linear import mm_nt  # oneDNN's fp32 product, the one the CPU training path uses
from grpo_npu.perf.flops import dtype_name

_T = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """One device's physical limits."""

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)  # dense matmul FLOP/s per dtype ('fp32', 'bf16', 'fp16')
    bandwidth: float  # memory bytes/s
    source: str  # where the numbers come from
    ranks_share_device: bool = False  # True: every rank runs on this one device (CPU), peaks do not add up

    def peak(self, dtype: str | torch.dtype) -> float:
        name = dtype_name(dtype)
        if name not in self.peak_flops:
            raise ValueError(f"{self.name}: no peak for dtype {name}; known: {', '.join(self.peak_flops)}")
        return self.peak_flops[name]

    def summary(self) -> str:
        """One line: the matmul peak per dtype, the bandwidth and their source (logged where floors are used)."""
        unit, scale = ("TFLOP/s", _T) if max(self.peak_flops.values()) >= _T else ("GFLOP/s", 1e9)
        peaks = " / ".join(f"{name} {flops / scale:.4g}" for name, flops in sorted(self.peak_flops.items()))
        return f"{self.name}: matmul peak {peaks} {unit}, memory bandwidth {self.bandwidth / 1e9:.4g} GB/s ({self.source})"

    def devices(self, world_size: int) -> int:
        """How many of these devices ``world_size`` ranks run on."""
        return 1 if self.ranks_share_device else world_size


def _nvidia(name: str, fp32_t: float, sparse_tensor_t: float, tb_per_s: float, datasheet: str) -> DeviceSpec:
    dense = sparse_tensor_t / 2 * _T
    return DeviceSpec(name, {"fp32": fp32_t * _T, "bf16": dense, "fp16": dense}, tb_per_s * _T,
                      f"NVIDIA {datasheet} Tensor Core GPU datasheet (dense = sparse / 2)")


def _ascend(variant: str, cube_cores: int, cube_mhz: int) -> DeviceSpec:
    half = cube_cores * 16 * 16 * 16 * 2 * cube_mhz * 1e6
    return DeviceSpec(f"Ascend 910{variant}", {"fp32": half / 2, "bf16": half, "fp16": half}, 1.6 * _T,
                      f"CANN 8.1.RC1 platform_config/Ascend910{variant}.ini (cube cores x 16^3 x 2 x cube_freq); "
                      "1.6 TB/s: Huawei Atlas A2 product pages")


H100_SXM = _nvidia("NVIDIA H100 SXM", 67, 1979, 3.35, "H100")
H100_PCIE = _nvidia("NVIDIA H100 PCIe", 51, 1513, 2.0, "H100")
H100_NVL = _nvidia("NVIDIA H100 NVL", 60, 1671, 3.9, "H100")
H200_SXM = _nvidia("NVIDIA H200 SXM", 67, 1979, 4.8, "H200")
H200_NVL = _nvidia("NVIDIA H200 NVL", 60, 1671, 4.8, "H200")
A100_SXM_80GB = _nvidia("NVIDIA A100 SXM 80GB", 19.5, 624, 2.039, "A100")
A100_SXM_40GB = _nvidia("NVIDIA A100 SXM 40GB", 19.5, 624, 1.555, "A100")
A100_PCIE_80GB = _nvidia("NVIDIA A100 PCIe 80GB", 19.5, 624, 1.935, "A100")
A100_PCIE_40GB = _nvidia("NVIDIA A100 PCIe 40GB", 19.5, 624, 1.555, "A100")
ASCEND_910B = {"1": _ascend("B1", 24, 1850), "2": _ascend("B2", 24, 1800),
               "3": _ascend("B3", 20, 1800), "4": _ascend("B4", 20, 1500)}
KNOWN_DEVICES = (H100_SXM, H100_PCIE, H100_NVL, H200_SXM, H200_NVL, A100_SXM_80GB, A100_SXM_40GB,
                 A100_PCIE_80GB, A100_PCIE_40GB, *ASCEND_910B.values())


def lookup_device(name: str) -> DeviceSpec | None:
    """The table entry for a ``get_device_name()`` string, or None when the device is not in the table.

    Examples: 'NVIDIA H100 80GB HBM3' (SXM), 'NVIDIA H100 PCIe', 'NVIDIA H200', 'NVIDIA A100-SXM4-40GB',
    'NVIDIA A100 80GB PCIe', 'Ascend910B3'.
    """
    key = re.sub(r"[\s_\-]", "", name).upper()
    ascend = re.fullmatch(r"(?:HUAWEI)?ASCEND910B([1-4])", key)
    if ascend:
        return ASCEND_910B[ascend.group(1)]
    if "GH200" in key or "GH100" in key:  # Grace Hopper: other memory, not in the table
        return None
    if "H200" in key:
        return H200_NVL if "NVL" in key else H200_SXM
    if "H100" in key:
        return H100_PCIE if "PCIE" in key else H100_NVL if "NVL" in key else H100_SXM
    if "A100" in key:
        big = "80G" in key
        if "PCIE" in key:
            return A100_PCIE_80GB if big else A100_PCIE_40GB
        return A100_SXM_80GB if big else A100_SXM_40GB
    return None


# ------------------------------------------------------------------------------------------------
# CPU, measured
# ------------------------------------------------------------------------------------------------
CPU_MATMUL_SIZE = 2048  # n of the timed n x n @ n x n product: 17 GFLOP, a fraction of a second on 2 cores
# The copy spans at least 8x the last-level caches the process can use, so that it streams from memory: on this
# project's 32 MiB-L3 host, in the trainer's process environment (freed memory kept in the heap), a 64 MiB copy read
# 35-41 GB/s where 256 MiB read 33-35 GB/s in the same seconds -- part of the smaller copy still hit the cache.
CPU_COPY_MIN_BYTES = 256 * 2**20
CPU_COPY_CACHE_MULTIPLE = 8
CPU_COPY_MAX_BYTES = 2**30  # 2 GiB held for a moment on a many-socket server, whose caches may then be 1/8 of it
_SYSFS_CPU = "/sys/devices/system/cpu"


def best_seconds(fn: Callable[[], object], repeat: int = 3, warmup: int = 1) -> float:
    """Best-of-``repeat`` wall seconds of ``fn()`` after ``warmup`` calls (allocation, thread pools,
    library dispatch): the peak, not the average under noise."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def measured_cpu_matmul_flops(dtype: str = "fp32") -> float:
    """FLOP/s of the best matmul this process has (torch's, and oneDNN's for fp32), with its torch
    threads; timed once per process and dtype."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name(dtype)]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(CPU_MATMUL_SIZE, CPU_MATMUL_SIZE, generator=gen).to(torch_dtype)
    b = torch.randn(CPU_MATMUL_SIZE, CPU_MATMUL_SIZE, generator=gen).to(torch_dtype)
    runs = [lambda: a @ b.t()]
    if torch_dtype == torch.float32:
        runs.append(lambda: mm_nt(a, b, onednn=True))
    seconds = min(best_seconds(run) for run in runs)
    return 2 * CPU_MATMUL_SIZE**3 / seconds


@functools.cache
def last_level_cache_bytes(sysfs: str = _SYSFS_CPU) -> int:
    """Bytes of the last-level caches (each shared cache once) of the CPUs this process may run on; 0 when
    the kernel does not say (no sysfs cache entries). Read once per process and path."""
    caches: dict[str, int] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        base = f"{sysfs}/cpu{cpu}/cache"
        try:
            entries = [e for e in os.listdir(base) if e.startswith("index")]
            found = []
            for entry in entries:
                with open(f"{base}/{entry}/level") as f:
                    level = int(f.read())
                with open(f"{base}/{entry}/size") as f:
                    size = f.read().strip()
                with open(f"{base}/{entry}/shared_cpu_list") as f:
                    shared = f.read().strip()
                found.append((level, shared, size))
        except (OSError, ValueError):
            continue
        if found:
            level, shared, size = max(found)
            number = re.fullmatch(r"(\d+)([KMG]?)", size)
            if number:
                caches[f"{level}:{shared}"] = int(number.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[
                    number.group(2)]
    return sum(caches.values())


def cpu_copy_bytes() -> int:
    """Bytes the bandwidth probe copies: ``CPU_COPY_CACHE_MULTIPLE`` x the last-level caches, at least
    :data:`CPU_COPY_MIN_BYTES` and at most :data:`CPU_COPY_MAX_BYTES`."""
    return min(CPU_COPY_MAX_BYTES, max(CPU_COPY_MIN_BYTES, CPU_COPY_CACHE_MULTIPLE * last_level_cache_bytes()))


CPU_PROBE_COPIES = 4  # cpu_bandwidth_probe: one warm-up copy and best of 3 timed ones
CPU_PROBE_FILL_COPIES = 0.5  # its source's fill: a write of its bytes, half a copy's traffic


def cpu_bandwidth_probe() -> float:
    """Bytes/s of one in-memory copy past the caches (each byte read once and written once), best of 3, now."""
    nbytes = cpu_copy_bytes()
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), repeat=CPU_PROBE_COPIES - 1)


def cpu_probe_seconds(bandwidth: float) -> float:
    """What :func:`cpu_bandwidth_probe` costs at ``bandwidth`` (bytes/s) once its buffers are paged in: its
    copies and its fill. A process's first probe also pages in its buffers (0.2-0.6 s for 2 x 256 MiB, against
    0.05 s warm on this project's host), a cost later probes from the same heap do not pay."""
    return (CPU_PROBE_COPIES + CPU_PROBE_FILL_COPIES) * 2 * cpu_copy_bytes() / bandwidth


@functools.cache
def measured_cpu_bandwidth() -> float:
    """:func:`cpu_bandwidth_probe`, once per process."""
    return cpu_bandwidth_probe()


def cpu_device_spec(dtypes: Iterable[str | torch.dtype] = ("fp32",), bandwidth: float | None = None) -> DeviceSpec:
    """This machine's CPU, its matmul peak measured for each of ``dtypes``; ``bandwidth`` (bytes/s) when the caller
    has just probed it, else the process's :func:`measured_cpu_bandwidth`."""
    names = sorted({dtype_name(d) for d in dtypes})
    return DeviceSpec(f"CPU ({torch.get_num_threads()} threads)",
                      {d: measured_cpu_matmul_flops(d) for d in names},
                      measured_cpu_bandwidth() if bandwidth is None else bandwidth,
                      f"measured: best of a 2048^3 matmul and a {cpu_copy_bytes() >> 20} MiB copy",
                      ranks_share_device=True)


def device_spec(kind: str, name: str, dtypes: Iterable[str | torch.dtype] = ("fp32",)) -> DeviceSpec | None:
    """The spec the trainer uses: measured on ``kind == 'cpu'``, else the table entry for ``name``."""
    if kind == "cpu":
        return cpu_device_spec(dtypes)
    return lookup_device(name)


__all__ = ["DeviceSpec", "KNOWN_DEVICES", "best_seconds", "cpu_bandwidth_probe", "cpu_copy_bytes", "cpu_device_spec",
           "device_spec", "last_level_cache_bytes", "lookup_device", "measured_cpu_bandwidth",
           "measured_cpu_matmul_flops"]
