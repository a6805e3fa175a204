"""Scoring many responses: per-row calls with clear errors, in-process or in a spawned process pool.

Torch-free on purpose: a pool worker imports only this module, the scorers and the user's file.

``Scorer.score(rows)`` with ``num_workers``: 1 scores in this process; N >= 2 uses a pool of N
processes; 0 (auto) times the scorer on the first PROBE_ROWS rows and sends the rest to a pool
only when the estimate says it pays. The pool is created on first use and kept until ``close()``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

# Auto mode. Measured on the 2-core dev box under load (spawned pool of 2, gsm8k-length texts): the
# gsm8k scorer costs ~4.6 us a row (4096 rows: 18.8 ms in-process, 16.5 ms in the pool: a wash); a
# pool round trip adds ~1-4 us a row plus ~1 ms a dispatch, and with other processes on the cores
# a pool of 2 only won reliably at >= 500 us a row (1.7-1.8x). On an idle many-core host it pays sooner;
# these thresholds stay conservative because the trainer shares the host's cores.
PROBE_ROWS = 64  # rows scored in-process first, to time the scorer
POOL_MIN_ROW_SECONDS = 250e-6  # below this per-row cost IPC and contention ate the gain (100-200 us: 0.7-1.3x)
POOL_MIN_BATCH_SECONDS = 0.05  # below this estimated in-process time a dispatch is not worth it
MAX_AUTO_WORKERS = 16
CHUNKS_PER_WORKER = 4  # a few chunks per worker even out uneven row costs

Row = tuple  # (row index, data_source, solution_str, ground_truth, extra_info)


class RewardFunctionError(RuntimeError):
    """A reward function failed (or returned something unusable) on one row."""


def as_row_info(raw: Any, row: int, data_source: str) -> dict:
    """A scorer's float or dict result as {"score": float, "acc": float, "pred": ..., ...}."""
    if isinstance(raw, dict):
        if "score" not in raw:
            raise RewardFunctionError(
                f"row {row} (data_source={data_source!r}): the reward function returned a dict without "
                f"'score' (keys: {sorted(raw)})"
            )
        info = dict(raw)
    else:
        info = {"score": raw}
    try:
        info["score"] = float(info["score"])
        info["acc"] = float(info.get("acc", info["score"]))
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(
            f"row {row} (data_source={data_source!r}): the reward function returned a non-numeric score/acc: {raw!r}"
        ) from err
    info.setdefault("pred", None)
    return info


def score_rows(fn: Callable, rows: Sequence[Row]) -> list[dict]:
    """Score rows in order; a failure names the row and its data_source."""
    out = []
    for row, data_source, text, ground_truth, extra_info in rows:
        try:
            raw = fn(data_source, text, ground_truth, extra_info)
        except Exception as err:
            raise RewardFunctionError(
                f"row {row} (data_source={data_source!r}): the reward function raised {type(err).__name__}: {err}"
            ) from err
        out.append(as_row_info(raw, row, data_source))
    return out


_WORKER_FN: Callable | None = None  # the scorer inside a pool worker, set once by the initializer


def _worker_init(fn: Callable) -> None:
    global _WORKER_FN
    _WORKER_FN = fn


def _worker_score(rows: Sequence[Row]) -> list[dict]:
    return score_rows(_WORKER_FN, rows)


class Scorer:
    """``fn(data_source, solution_str, ground_truth, extra_info)`` over many rows, parallel where it pays."""

    def __init__(self, fn: Callable, num_workers: int = 0) -> None:
        if num_workers < 0:
            raise ValueError(f"reward_model.num_workers={num_workers} must be >= 0 (0: automatic)")
        self.fn = fn
        self.num_workers = num_workers
        self.last_used_pool = False  # whether the latest score() call used the pool (for metrics/tests)
        self._pool: ProcessPoolExecutor | None = None
        self._pool_refused = False  # fn cannot be pickled: stay in-process (said once)

    def score(self, rows: Sequence[Row]) -> list[dict]:
        """Per-row info dicts, in the order of ``rows``."""
        rows = list(rows)
        self.last_used_pool = False
        if self.num_workers == 1 or len(rows) <= PROBE_ROWS:
            return score_rows(self.fn, rows)
        if self.num_workers >= 2:
            return self._pool_score(rows) if self._can_pool() else score_rows(self.fn, rows)
        start = time.perf_counter()
        head = score_rows(self.fn, rows[:PROBE_ROWS])
        per_row = (time.perf_counter() - start) / PROBE_ROWS
        rest = rows[PROBE_ROWS:]
        if per_row >= POOL_MIN_ROW_SECONDS and per_row * len(rest) >= POOL_MIN_BATCH_SECONDS and self._can_pool():
            return head + self._pool_score(rest)
        return head + score_rows(self.fn, rest)

    def workers(self) -> int:
        return self.num_workers if self.num_workers >= 2 else min(os.cpu_count() or 1, MAX_AUTO_WORKERS)

    def _can_pool(self) -> bool:
        if self._pool_refused or self.workers() < 2:
            return False
        if self._pool is None:
            try:
                pickle.dumps(self.fn)
            except Exception as err:
                logger.warning(
                    "reward scoring stays in-process: the score function cannot be pickled for a process pool "
                    "(%s: %s); use a module-level function or custom_reward_function.path", type(err).__name__, err,
                )
                self._pool_refused = True
                return False
        return True

    def _pool_score(self, rows: list[Row]) -> list[dict]:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers(),
                mp_context=multiprocessing.get_context("spawn"),  # safe next to torch/vLLM/ray threads
                initializer=_worker_init,
                initargs=(self.fn,),
            )
        size = -(-len(rows) // (self.workers() * CHUNKS_PER_WORKER))
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        try:
            parts = list(self._pool.map(_worker_score, chunks))
        except BrokenProcessPool as err:  # e.g. a script without an `if __name__ == "__main__":` guard
            logger.warning("reward scoring pool broke (%s); scoring in-process from now on", err)
            self._pool_refused = True
            self.close()
            return score_rows(self.fn, rows)
        self.last_used_pool = True
        return [info for part in parts for info in part]

    def close(self) -> None:
        """Shut the pool down (if one was started)."""
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:
        self.close()
