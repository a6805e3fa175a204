"""Memory ledger: device memory at each sleep/wake transition, and a warning when it leaks.

The rollout engine's memory is meant to come and go with every step (wake before generating, sleep
after). The field's most-reported sleep-mode failure is memory that does not come back: a few hundred
MB more held after every sleep until the run dies with an out-of-memory error many steps later. The
ledger records :meth:`grpo_npu.device.Device.memory_stats` at four points per step and compares what
is still held after sleep with what was held ``window`` cycles earlier. It warns only when the growth is
steady: more than the threshold in all, and at least ``threshold / window`` in every one of those cycles.
A one-off allocation between two sleeps (the optimizer state the first update creates, 3.9 GiB of AdamW
moments at the 0.5B shape, which an H100 run reported as a leak under the old whole-window rule; a cache
filled once) raises the figure in one cycle and is not a leak.

Metrics, per step (GiB; on CPU allocated and reserved are the process RSS, free is MemAvailable):

- ``rollout/mem_{allocated,reserved,free}_gb_{before,after}_wake``: around waking weights + KV cache;
- ``rollout/mem_{allocated,reserved,free}_gb_{before,after}_sleep``: around sleeping after generation;
- ``rollout/mem_sleep_growth_gb``: how much more memory is held after this sleep than after the sleep
  ``window`` cycles ago (0 until that many cycles have run): the larger of the growth of this process's
  reserved memory (the caching allocator's pool, which is what an OOM runs out of: allocated bytes alone
  miss memory the allocator keeps cached) and, on an accelerator, of the memory in use on the whole device
  (total - free), which also sees the inference engine's own pool that torch's allocator does not manage.
  On CPU the device-wide figure is the machine's, shared with every other process: it is left out there.
"""

from __future__ import annotations

import logging
from typing import Protocol

from grpo_npu.device import MemoryStats

log = logging.getLogger(__name__)

_GIB = 1024**3
TRANSITIONS = ("before_wake", "after_wake", "before_sleep", "after_sleep")
# Default leak threshold: the per-cycle growth reported in the field is ~240 MB, so a growth of 256 MiB
# over the window is a leak, not allocator noise (which stays within tens of MB on a steady workload).
LEAK_THRESHOLD_BYTES = 256 * 1024**2
# Cycles compared; each of them must add memory for a leak, so a one-off allocation is never one.
LEAK_WINDOW = 3


class _HasMemoryStats(Protocol):
    def memory_stats(self) -> MemoryStats: ...


class MemoryLedger:
    """Records memory at each transition of a rollout cycle; warns when post-sleep memory keeps growing."""

    def __init__(
        self,
        device: _HasMemoryStats,
        leak_threshold_bytes: int = LEAK_THRESHOLD_BYTES,
        window: int = LEAK_WINDOW,
    ) -> None:
        if window < 1:
            raise ValueError(f"MemoryLedger window={window} must be >= 1 cycle")
        self.device = device
        self.leak_threshold_bytes = leak_threshold_bytes
        self.window = window
        self._cycle: dict[str, MemoryStats] = {}
        # One (reserved, device bytes in use) pair per completed cycle, taken after sleep.
        self.after_sleep: list[tuple[int, int]] = []
        self.device_wide = bool(getattr(device, "is_accelerator", False))
        self.leak_warnings = 0

    def record(self, transition: str) -> None:
        """Take a memory snapshot for one of TRANSITIONS in the current cycle."""
        if transition not in TRANSITIONS:
            raise ValueError(f"unknown memory transition {transition!r}; known: {', '.join(TRANSITIONS)}")
        self._cycle[transition] = self.device.memory_stats()

    def end_cycle(self) -> dict[str, float]:
        """Close the cycle: its rollout/mem_* metrics, plus a logged warning if memory leaks across cycles."""
        metrics: dict[str, float] = {}
        for transition, stats in self._cycle.items():
            metrics[f"rollout/mem_allocated_gb_{transition}"] = stats.allocated / _GIB
            metrics[f"rollout/mem_reserved_gb_{transition}"] = stats.reserved / _GIB
            metrics[f"rollout/mem_free_gb_{transition}"] = stats.free / _GIB
        after = self._cycle.get("after_sleep")
        self._cycle = {}
        if after is None:
            return metrics
        history = self.after_sleep
        history.append((after.reserved, after.total - after.free))
        growth = 0
        if len(history) > self.window:
            recent = history[-1 - self.window:]
            measures = [("reserved by this process", [reserved for reserved, _ in recent])]
            if self.device_wide:
                measures.append(("in use on the device (the engine's own pool included)", [used for _, used in recent]))
            growth = max(series[-1] - series[0] for _, series in measures)
            leaking = [(what, series) for what, series in measures if self._steady_growth(series)]
            if leaking:
                what, series = max(leaking, key=lambda m: m[1][-1] - m[1][0])
                then, now = series[0], series[-1]
                self.leak_warnings += 1
                log.warning(
                    "rollout memory leak? memory %s after sleep grew %.3f GiB over the last %d sleep/wake cycles, "
                    "in every one of them (%.3f -> %.3f GiB; threshold %.3f GiB). Memory that survives sleep "
                    "accumulates until OOM: check that empty_cache runs after sleep and that no tensors from "
                    "generation are kept alive.",
                    what, (now - then) / _GIB, self.window, then / _GIB, now / _GIB, self.leak_threshold_bytes / _GIB,
                )
        metrics["rollout/mem_sleep_growth_gb"] = growth / _GIB
        return metrics

    def _steady_growth(self, series: list[int]) -> bool:
        """Whether bytes held after sleep, one value per cycle, grew past the threshold, each cycle its share."""
        steps = [after - before for before, after in zip(series, series[1:])]
        return sum(steps) > self.leak_threshold_bytes and min(steps) >= self.leak_threshold_bytes / self.window
