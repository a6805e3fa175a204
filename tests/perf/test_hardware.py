"""Device table lookups by get_device_name() strings, the table's figures, and the measured CPU."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.perf import hardware as H

T = 1e12


@pytest.mark.parametrize("name, spec", [
    ("NVIDIA H100 80GB HBM3", H.H100_SXM),
    ("NVIDIA H100 PCIe", H.H100_PCIE),
    ("NVIDIA H100 NVL", H.H100_NVL),
    ("NVIDIA H200", H.H200_SXM),
    ("NVIDIA H200 NVL", H.H200_NVL),
    ("NVIDIA A100-SXM4-80GB", H.A100_SXM_80GB),
    ("NVIDIA A100-SXM4-40GB", H.A100_SXM_40GB),
    ("NVIDIA A100-PCIE-40GB", H.A100_PCIE_40GB),
    ("NVIDIA A100 80GB PCIe", H.A100_PCIE_80GB),
    ("Ascend910B1", H.ASCEND_910B["1"]),
    ("Ascend910B2", H.ASCEND_910B["2"]),
    ("Ascend 910B3", H.ASCEND_910B["3"]),
    ("ascend910b4", H.ASCEND_910B["4"]),
])
def test_lookup_by_device_name(name, spec):
    assert H.lookup_device(name) is spec


@pytest.mark.parametrize("name", ["Ascend910B4-1", "Ascend910B2C", "Ascend910_9392", "NVIDIA GH200 480GB",
                                  "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", "NVIDIA H800", ""])
def test_unknown_devices_are_not_guessed(name):
    assert H.lookup_device(name) is None


@pytest.mark.parametrize("spec, fp32, bf16, tb_per_s", [
    (H.H100_SXM, 67, 989.5, 3.35),  # datasheet: 1,979 TFLOPS bf16 with sparsity
    (H.H100_PCIE, 51, 756.5, 2.0),
    (H.H200_SXM, 67, 989.5, 4.8),
    (H.A100_SXM_80GB, 19.5, 312, 2.039),
    (H.A100_PCIE_40GB, 19.5, 312, 1.555),
    (H.ASCEND_910B["1"], 181.86, 363.72, 1.6),  # 24 cube cores x 8192 FLOP/cycle x 1.85 GHz
    (H.ASCEND_910B["2"], 176.95, 353.89, 1.6),
    (H.ASCEND_910B["3"], 147.46, 294.91, 1.6),
    (H.ASCEND_910B["4"], 122.88, 245.76, 1.6),
])
def test_table_figures(spec, fp32, bf16, tb_per_s):
    assert spec.peak("float32") == pytest.approx(fp32 * T, rel=1e-4)
    assert spec.peak(torch.bfloat16) == pytest.approx(bf16 * T, rel=1e-4)
    assert spec.peak("fp16") == spec.peak("bf16")
    assert spec.bandwidth == pytest.approx(tb_per_s * T)
    assert spec.devices(8) == 8 and spec.source


def test_every_table_entry_is_reachable_by_name():
    names = {"NVIDIA H100 SXM": "NVIDIA H100 80GB HBM3", "NVIDIA H200 SXM": "NVIDIA H200"}
    for spec in H.KNOWN_DEVICES:
        assert H.lookup_device(names.get(spec.name, spec.name)) is spec, spec.name


def test_unknown_dtype_names_the_known_ones():
    with pytest.raises(ValueError, match=r"dtype 'fp8'"):
        H.H100_SXM.peak("fp8")
    cpu = H.DeviceSpec("CPU", {"fp32": 1e11}, 1e10, "test", ranks_share_device=True)
    with pytest.raises(ValueError, match=r"CPU: no peak for dtype bf16; known: fp32"):
        cpu.peak("bfloat16")
    assert cpu.devices(4) == 1


def test_summary_names_every_peak_the_bandwidth_and_the_source():
    assert H.H100_SXM.summary() == (
        "NVIDIA H100 SXM: matmul peak bf16 989.5 / fp16 989.5 / fp32 67 TFLOP/s, memory bandwidth 3350 GB/s "
        "(NVIDIA H100 Tensor Core GPU datasheet (dense = sparse / 2))")
    cpu = H.DeviceSpec("CPU (2 threads)", {"fp32": 215.4e9, "bf16": 438e9}, 47.73e9, "measured")
    assert cpu.summary() == "CPU (2 threads): matmul peak bf16 438 / fp32 215.4 GFLOP/s, memory bandwidth 47.73 GB/s (measured)"


def test_cpu_is_measured_once_per_process():
    H.measured_cpu_matmul_flops.cache_clear()
    H.measured_cpu_bandwidth.cache_clear()
    spec = H.device_spec("cpu", "ignored on cpu", dtypes=[torch.float32, "fp32"])
    assert set(spec.peak_flops) == {"fp32"} and spec.ranks_share_device
    assert spec.peak("fp32") > 1e8 and spec.bandwidth > 1e8  # any real machine; no speed is asserted
    again = H.cpu_device_spec(["float32"])
    assert again.peak_flops == spec.peak_flops and again.bandwidth == spec.bandwidth
    assert H.measured_cpu_matmul_flops.cache_info().misses == 1
    assert H.measured_cpu_bandwidth.cache_info().misses == 1


def test_device_spec_uses_the_table_off_cpu():
    assert H.device_spec("cuda", "NVIDIA H100 PCIe") is H.H100_PCIE
    assert H.device_spec("npu", "Ascend910B3") is H.ASCEND_910B["3"]
    assert H.device_spec("npu", "Ascend910B9") is None


def _fake_sysfs(root, caches):
    """cpu -> [(level, size, shared_cpu_list)] as the kernel lays them out under /sys/devices/system/cpu."""
    for cpu, entries in caches.items():
        for i, (level, size, shared) in enumerate(entries):
            d = root / f"cpu{cpu}" / "cache" / f"index{i}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "size").write_text(f"{size}\n")
            (d / "shared_cpu_list").write_text(f"{shared}\n")


@pytest.mark.parametrize("shared, expected_mib", [("0-1", 32), (None, 64)])
def test_the_last_level_cache_counts_each_shared_cache_once(tmp_path, monkeypatch, shared, expected_mib):
    monkeypatch.setattr(H.os, "sched_getaffinity", lambda pid: {0, 1})
    _fake_sysfs(tmp_path, {cpu: [(1, "48K", str(cpu)), (2, "1024K", str(cpu)), (3, "32768K", shared or str(cpu))]
                           for cpu in (0, 1)})
    assert H.last_level_cache_bytes(str(tmp_path)) == expected_mib * 2**20


def test_the_bandwidth_probe_copies_8x_the_last_level_cache_within_256_mib_and_1_gib(tmp_path, monkeypatch):
    monkeypatch.setattr(H.os, "sched_getaffinity", lambda pid: {0})
    assert H.last_level_cache_bytes(str(tmp_path)) == 0  # no cache entries: unknown
    monkeypatch.setattr(H, "last_level_cache_bytes", lambda: 0)
    assert H.cpu_copy_bytes() == 256 * 2**20
    monkeypatch.setattr(H, "last_level_cache_bytes", lambda: 32 * 2**20)  # this project's host
    assert H.cpu_copy_bytes() == 256 * 2**20
    monkeypatch.setattr(H, "last_level_cache_bytes", lambda: 96 * 2**20)
    assert H.cpu_copy_bytes() == 768 * 2**20
    monkeypatch.setattr(H, "last_level_cache_bytes", lambda: 512 * 2**20)  # e.g. 2 sockets of 8 CCDs of 32 MiB
    assert H.cpu_copy_bytes() == 2**30
