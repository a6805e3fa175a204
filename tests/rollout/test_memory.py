"""The memory ledger: metrics per cycle, and the leak warning with its figures."""

from __future__ import annotations

import logging

import pytest

from grpo_npu.device import MemoryStats
from grpo_npu.rollout.memory import MemoryLedger

MIB = 1024**2
GIB = 1024**3


class ScriptedDevice:
    """memory_stats() returns the next allocated value from a script (reserved = 2x, free = 1 GiB unless scripted)."""

    def __init__(self, allocated, free=None, is_accelerator=False):
        self.allocated = iter(allocated)
        self.free = iter(free) if free is not None else None
        self.is_accelerator = is_accelerator

    def memory_stats(self) -> MemoryStats:
        a = next(self.allocated)
        return MemoryStats(a, 2 * a, 0, 0, next(self.free) if self.free else GIB, 4 * GIB, 0)


def _cycle(ledger):
    for transition in ("before_wake", "after_wake", "before_sleep", "after_sleep"):
        ledger.record(transition)
    return ledger.end_cycle()


def test_metrics_per_transition():
    ledger = MemoryLedger(ScriptedDevice([1 * GIB, 3 * GIB, 4 * GIB, 1 * GIB]))
    metrics = _cycle(ledger)
    assert metrics["rollout/mem_allocated_gb_before_wake"] == 1.0
    assert metrics["rollout/mem_allocated_gb_after_wake"] == 3.0
    assert metrics["rollout/mem_reserved_gb_before_sleep"] == 8.0
    assert metrics["rollout/mem_free_gb_after_sleep"] == 1.0
    assert metrics["rollout/mem_sleep_growth_gb"] == 0.0
    assert len(metrics) == 13


def test_leak_across_cycles_is_warned_with_figures(caplog):
    leak = 100 * MIB  # per cycle: over a window of 3 cycles, 300 MiB > 256 MiB
    script = []
    for cycle in range(5):
        base = GIB + cycle * leak
        script += [base, base + 2 * GIB, base + 2 * GIB, base]
    ledger = MemoryLedger(ScriptedDevice(script), leak_threshold_bytes=256 * MIB, window=3)
    with caplog.at_level(logging.WARNING, logger="grpo_npu.rollout.memory"):
        growth = [_cycle(ledger)["rollout/mem_sleep_growth_gb"] for _ in range(5)]
    assert growth[:3] == [0.0, 0.0, 0.0]
    assert growth[3] == pytest.approx(600 / 1024)  # measured on reserved memory (2x allocated here)
    assert ledger.leak_warnings == 2
    assert ("memory reserved by this process after sleep grew 0.586 GiB over the last 3 sleep/wake cycles, "
            "in every one of them (2.000 -> 2.586 GiB") in caplog.text


@pytest.mark.parametrize("accelerator", [True, False])
def test_a_leak_in_the_engines_own_pool_shows_through_device_free_memory(caplog, accelerator):
    """torch's allocator sees nothing (allocated and reserved flat); the device's free memory shrinks 200 MiB a
    cycle, as when an engine's own pool keeps weights after sleep. Seen on an accelerator, not on CPU (where
    free memory is the whole machine's)."""
    cycles = 5
    allocated = [GIB] * (4 * cycles)
    free = [2 * GIB - (i // 4) * 200 * MIB for i in range(4 * cycles)]
    ledger = MemoryLedger(ScriptedDevice(allocated, free, is_accelerator=accelerator), window=3)
    with caplog.at_level(logging.WARNING, logger="grpo_npu.rollout.memory"):
        growth = [_cycle(ledger)["rollout/mem_sleep_growth_gb"] for _ in range(cycles)]
    if accelerator:
        assert growth[3] == pytest.approx(600 / 1024) and ledger.leak_warnings == 2
        assert "in use on the device (the engine's own pool included)" in caplog.text
    else:
        assert growth == [0.0] * cycles and ledger.leak_warnings == 0


@pytest.mark.parametrize("accelerator", [True, False])
def test_a_one_off_allocation_is_not_a_leak(caplog, accelerator):
    """As on an H100 at the 0.5B shape: the first update creates AdamW's moments (3.9 GiB) between the first two
    sleeps, then memory after sleep stays flat. The growth metric shows it while the window spans it; no warning."""
    cycles = 6
    held = [GIB if cycle == 0 else GIB + 3.9 * GIB for cycle in range(cycles)]
    allocated = [int(h) for h in held for _ in range(4)]
    free = [int(8 * GIB - 2 * a) for a in allocated]
    ledger = MemoryLedger(ScriptedDevice(allocated, free, is_accelerator=accelerator), window=3)
    with caplog.at_level(logging.WARNING, logger="grpo_npu.rollout.memory"):
        growth = [_cycle(ledger)["rollout/mem_sleep_growth_gb"] for _ in range(cycles)]
    assert growth[3] == pytest.approx(7.8) and growth[4:] == [0.0, 0.0]  # reserved: 2x allocated here
    assert ledger.leak_warnings == 0 and not caplog.text


def test_a_leak_after_a_one_off_allocation_is_still_found(caplog):
    script = []
    for cycle in range(7):
        base = GIB + (3 * GIB if cycle >= 1 else 0) + max(cycle - 2, 0) * 100 * MIB  # one-off, then 100 MiB a cycle
        script += [base] * 4
    ledger = MemoryLedger(ScriptedDevice(script), leak_threshold_bytes=256 * MIB, window=3)
    with caplog.at_level(logging.WARNING, logger="grpo_npu.rollout.memory"):
        for _ in range(7):
            _cycle(ledger)
    assert ledger.leak_warnings == 2  # the last two cycles: their windows hold three steps of 200 MiB reserved each
    assert "grew 0.586 GiB over the last 3 sleep/wake cycles" in caplog.text


def test_steady_memory_is_not_a_leak(caplog):
    script = [GIB + (i % 3) * 10 * MIB for i in range(40)]  # allocator noise, no trend
    ledger = MemoryLedger(ScriptedDevice(script))
    with caplog.at_level(logging.WARNING, logger="grpo_npu.rollout.memory"):
        for _ in range(10):
            _cycle(ledger)
    assert ledger.leak_warnings == 0 and not caplog.text


def test_unknown_transition_and_bad_window():
    with pytest.raises(ValueError, match="known: before_wake"):
        MemoryLedger(ScriptedDevice([])).record("during_nap")
    with pytest.raises(ValueError, match="window=0"):
        MemoryLedger(ScriptedDevice([]), window=0)
