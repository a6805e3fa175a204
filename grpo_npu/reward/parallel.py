"""Scoring a batch of responses: which rows run where, and what a failed row costs.

Torch-free on purpose, like the scorers (the sandbox workers import this package).

Where a row runs (``num_workers``: 0 automatic, N >= 1 a sandbox of N worker processes):

- in this process, with no timeout, when the function is the built-in dispatcher
  (:func:`grpo_npu.reward.score.runs_in_process`) and the row's data_source has a bounded scorer:
  one that reads only a fixed-length tail of the response (gsm8k, DAPO-math: 300 characters), so a
  response cannot make it slow, and that is plain Python over strings, so it cannot crash the
  process. This keeps the default job's ~6 us a row. Unless ``num_workers`` >= 2 asks for a pool.
- in the sandbox (:mod:`grpo_npu.reward.sandbox`) otherwise: every custom function
  (``custom_reward_function.path``), and built-in scorers whose cost grows with the response (MATH's
  ``\\boxed{}`` parsing reads all of it). Workers: ``num_workers``, or (0) one per CPU up to
  MAX_AUTO_WORKERS.
- in this process, unguarded, with a warning, when a function given through the Python API cannot be
  pickled (a lambda or closure): it cannot reach another process.

A row whose call times out, raises, kills its worker or returns a non-number gets
``fallback_score`` and is counted (``Scored.timeouts`` / ``.errors``) and logged with its index.
More than ``max_failed_fraction`` of the batch failing stops the run (:class:`TooManyRewardFailures`),
as :class:`RewardFunctionBroken` (a one-line user error naming the function and its first error) when
nothing succeeded. The sandbox stops sooner when its first ``all_fail_rows(fraction)`` rows (drawn
across the batch) all failed: a function failing on at most that fraction of rows does so with a
chance under ALL_FAIL_CHANCE, and a function that never returns would otherwise hold the run for
``fraction * B / workers`` timeouts.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
from dataclasses import dataclass
from typing import Callable, Sequence

from grpo_npu.reward.call import (
    RewardFunctionBroken, RewardFunctionError, Row, TooManyRewardFailures, first_line, score_row,
)
from grpo_npu.reward.custom import FileFunction
from grpo_npu.reward.sandbox import Sandbox, SandboxSettings
from grpo_npu.reward.score import is_builtin, runs_in_process

logger = logging.getLogger(__name__)

MAX_AUTO_WORKERS = 16
MAX_LOGGED_FAILURES = 5  # failed rows logged one by one per batch; the rest only in the batch's summary line
ALL_FAIL_CHANCE = 1e-6  # see the module docstring


def all_fail_rows(max_failed_fraction: float) -> float:
    """How many failures in a row, with no success, prove a function fails on more than the fraction."""
    if max_failed_fraction >= 1.0:
        return math.inf
    if max_failed_fraction <= 0.0:
        return 1
    return math.ceil(math.log(ALL_FAIL_CHANCE) / math.log(max_failed_fraction))


def describe(fn: Callable) -> str:
    """How errors name a score function."""
    if isinstance(fn, FileFunction):
        return f"custom_reward_function.path={fn.path} (name={fn.name})"
    if is_builtin(fn):
        return "the built-in reward"
    return f"reward function {getattr(fn, '__qualname__', repr(fn))}"


@dataclass
class Scored:
    infos: list[dict]  # B per-row dicts in row order (a failed row: fallback score, acc 0, pred None)
    timeouts: int = 0  # rows whose call ran past timeout_s
    errors: int = 0  # rows whose call raised, killed its worker, used too much memory or returned a non-number


@dataclass
class _Tally:
    """Failures in one batch; raises when the run must stop."""

    total: int
    settings: SandboxSettings
    who: str
    succeeded: int = 0
    timeouts: int = 0
    errors: int = 0
    sandbox_succeeded: int = 0
    sandbox_failed: int = 0
    first: str = ""

    @property
    def failed(self) -> int:
        return self.timeouts + self.errors

    def fail(self, kind: str, message: str, in_sandbox: bool) -> dict:
        """Count a failed row and return its fallback info."""
        message = message.splitlines()[0] if message else kind
        if kind == "timeout":
            self.timeouts += 1
        else:
            self.errors += 1
        self.sandbox_failed += in_sandbox
        self.first = self.first or message
        if self.failed <= MAX_LOGGED_FAILURES:
            logger.warning("reward %s (%s); it scores reward_model.fallback_score=%g",
                           message, kind, self.settings.fallback_score)
        stop_rows = all_fail_rows(self.settings.max_failed_fraction)
        if self.failed > self.settings.max_failed_fraction * self.total or (
                self.sandbox_succeeded == 0 and self.sandbox_failed >= stop_rows):
            raise self._stop()
        return {"score": self.settings.fallback_score, "acc": 0.0, "pred": None}

    def _stop(self) -> RewardFunctionError:
        if self.succeeded == 0:
            scope = (f"every row ({self.total})" if self.failed == self.total
                     else f"every row scored ({self.failed} of {self.total} before the run stopped)")
            return RewardFunctionBroken(f"{self.who} failed on {scope}; first: {self.first}")
        return TooManyRewardFailures(
            f"{self.failed} of {self.total} reward calls failed ({self.timeouts} timed out, {self.errors} errors), "
            f"more than reward_model.max_failed_fraction={self.settings.max_failed_fraction:g}; first: {self.first}")

    def summarize(self) -> None:
        if self.failed:
            logger.warning("reward: %d of %d rows failed (%d timed out, %d errors) and scored %g; first: %s",
                           self.failed, self.total, self.timeouts, self.errors, self.settings.fallback_score,
                           self.first)


class Scorer:
    """``fn(data_source, solution_str, ground_truth, extra_info)`` over many rows, guarded (module docstring)."""

    def __init__(self, fn: Callable, num_workers: int = 0, settings: SandboxSettings | None = None) -> None:
        if num_workers < 0:
            raise ValueError(f"reward_model.num_workers={num_workers} must be >= 0 (0: automatic)")
        self.fn = fn
        self.num_workers = num_workers
        self.settings = settings or SandboxSettings()
        self.who = describe(fn)
        self.last_used_pool = False  # whether the latest score() call used the sandbox (for tests)
        self._sandbox: Sandbox | None = None
        self._blob: bytes | None = None
        self._unpicklable = False
        self._local: dict[str, bool] = {}  # data_source -> scored in this process

    def workers(self) -> int:
        return self.num_workers or min(os.cpu_count() or 1, MAX_AUTO_WORKERS)

    def score(self, rows: Sequence[Row]) -> Scored:
        """Per-row info dicts in the order of ``rows``, with the batch's failure counts."""
        rows = list(rows)
        tally = _Tally(len(rows), self.settings, self.who)
        infos: list[dict | None] = [None] * len(rows)
        remote = []
        for key, row in enumerate(rows):
            if not self._in_process(row[1]):
                remote.append((key, row))
                continue
            try:
                infos[key] = score_row(self.fn, row)
                tally.succeeded += 1
            except RewardFunctionError as err:
                infos[key] = tally.fail("error", str(err), in_sandbox=False)

        def on_result(key: int, row: Row, failure: str | None, payload) -> None:
            if failure is None:
                infos[key] = payload
                tally.succeeded += 1
                tally.sandbox_succeeded += 1
            else:
                infos[key] = tally.fail(failure, payload, in_sandbox=True)

        self.last_used_pool = bool(remote)
        if remote:
            if self._sandbox is None:
                self._sandbox = Sandbox(self._blob, self.workers(), self.settings, self.who)
            self._sandbox.run(remote, on_result)
        tally.summarize()
        return Scored(infos, timeouts=tally.timeouts, errors=tally.errors)

    def _in_process(self, data_source: str) -> bool:
        local = self._local.get(data_source)
        if local is None:
            local = not self._picklable() or (self.num_workers < 2 and runs_in_process(self.fn, data_source))
            self._local[data_source] = local
        return local

    def _picklable(self) -> bool:
        if self._blob is None and not self._unpicklable:
            try:
                self._blob = pickle.dumps(self.fn)
            except Exception as err:  # noqa: BLE001 - any pickling failure means: not across processes
                logger.warning(
                    "reward scoring runs in the trainer's process with no timeout or crash protection: %s cannot be "
                    "pickled for the sandbox (%s); use a module-level function or custom_reward_function.path",
                    self.who, first_line(err))
                self._unpicklable = True
        return not self._unpicklable

    def close(self) -> None:
        """End the sandbox's workers (if any were started)."""
        if getattr(self, "_sandbox", None) is not None:
            self._sandbox.close()
            self._sandbox = None

    def __del__(self) -> None:
        self.close()
