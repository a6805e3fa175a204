"""The reward sandbox: worker processes that score rows under a per-row deadline and a memory limit.

A worker is a fresh interpreter (``python -c``; multiprocessing's spawn would re-run the trainer's
``__main__`` in it) that loads the score function once and scores chunks of rows sent over a socket.
It publishes the row it is on and when that row started in a small shared slot (an mmap'ed
temporary file), so the parent tells a slow row from a stuck one without a message per row.

The parent kills a worker, with its whole process group, when its row runs past ``timeout_s`` or its
resident memory passes ``memory_limit_mb``; a worker that dies on its own (segfault, ``os._exit``)
shows as its socket closing. The row it was on fails, the rest of its chunk goes back in the queue,
and a replacement starts when one is needed. A worker above half the memory limit is replaced
between rows (a slow leak costs a restart, not a row). Workers exit when the trainer does.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import pickle
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Callable

from grpo_npu.errors import ConfigError
from grpo_npu.reward.call import RewardFunctionBroken, RewardFunctionError, Row, first_line, row_label, score_row
from grpo_npu.reward.names import SANDBOX_DEFAULTS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxSettings:
    """How reward calls are guarded (the ``reward_model.*`` keys of the same names)."""

    timeout_s: float = SANDBOX_DEFAULTS["timeout_s"]
    """Seconds one reward call may run before its worker is killed and the row gets fallback_score."""
    fallback_score: float = SANDBOX_DEFAULTS["fallback_score"]
    """Score of a row whose reward call timed out, raised, crashed its worker or returned a non-number."""
    max_failed_fraction: float = SANDBOX_DEFAULTS["max_failed_fraction"]
    """Stop the run when more than this fraction of a batch's reward calls fail (1.0: never stop)."""
    memory_limit_mb: int = SANDBOX_DEFAULTS["memory_limit_mb"]
    """Resident MB a reward worker may hold: above it killed (its row fails), above half replaced; 0: no limit."""

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"reward_model.timeout_s={self.timeout_s}: expected a finite number of seconds > 0")
        if not math.isfinite(self.fallback_score):
            raise ConfigError(f"reward_model.fallback_score={self.fallback_score}: expected a finite number")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ConfigError(f"reward_model.max_failed_fraction={self.max_failed_fraction}: expected 0 <= x <= 1")
        if self.memory_limit_mb < 0:
            raise ConfigError(f"reward_model.memory_limit_mb={self.memory_limit_mb}: expected >= 0 (0: no limit)")


CHUNKS_PER_WORKER = 4  # a few chunks per worker even out uneven row costs
FLUSH_SECONDS = 0.05  # a worker sends its finished rows at least this often (fewer rows redone after a kill)
LOAD_TIMEOUT_S = 120.0  # loading the score function in a worker; the parent has already loaded it once
MAX_START_FAILURES = 3  # workers in a row that die before scoring anything: give up, something is broken
MEMORY_POLL_S = 0.5  # how often the parent reads its busy workers' memory
MIN_POLL_S = 0.01  # a deadline is confirmed on a second look, at least this much later
EXIT_WITH_PARENT_POLL_S = 1.0  # a worker checks this often that the trainer is still alive
EXIT_GRACE_S = 1.0  # a worker that closed its socket (or was asked to) gets this long to exit by itself
KILL_WAIT_S = 5.0  # a killed worker is reaped within this, or left behind (uninterruptible I/O)

# The worker's shared slot: (row key it is on or -1, when that row started (time.monotonic)), then one
# byte the parent sets to ask the worker to exit after its current row.
_SLOT = struct.Struct("qd")
_RETIRE = _SLOT.size
_SLOT_BYTES = _SLOT.size + 8
_IDLE = -1

_BOOT = ("import sys; sys.path[:] = sys.argv[3:]; from grpo_npu.reward.sandbox import worker_main; "
         "worker_main(int(sys.argv[1]), int(sys.argv[2]))")


# ------------------------------------------------------------------------------------------------
# Inside a worker
# ------------------------------------------------------------------------------------------------
def worker_main(sock_fd: int, slot_fd: int) -> None:
    """Load the pickled function, then score chunks of (key, row) until the socket closes."""
    os.set_inheritable(sock_fd, False)  # programs the user's function starts must not hold the socket open
    os.set_inheritable(slot_fd, False)
    conn = Connection(sock_fd)
    slot = mmap.mmap(slot_fd, _SLOT_BYTES)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        try:
            fn = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            raise
        except BaseException as err:  # noqa: BLE001 - whatever the user's file does at import is reported
            conn.send(("load_error", _load_error(err)))
            return
        conn.send(("ready", []))
        while _score_chunk(fn, conn.recv(), conn, slot):
            pass
    except (EOFError, OSError):  # the trainer closed the socket (or ended): so does the worker
        return


def _load_error(err: BaseException) -> str:
    """One line; load_function's own errors already name the key and file."""
    text = str(err).strip()
    return text.splitlines()[0] if text.startswith("custom_reward_function.") else first_line(err)


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(EXIT_WITH_PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def _score_chunk(fn: Callable, chunk: list[tuple[int, Row]], conn: Connection, slot: mmap.mmap) -> bool:
    """Score a chunk, sending results at least every FLUSH_SECONDS; False when asked to retire."""
    results: list[tuple[int, bool, object]] = []
    flushed = time.monotonic()
    rows = dict(chunk)
    keep_going = True
    for key, row in chunk:
        _SLOT.pack_into(slot, 0, key, time.monotonic())
        try:
            results.append((key, True, score_row(fn, row)))
        except RewardFunctionError as err:
            results.append((key, False, str(err)))
        except BaseException as err:  # noqa: BLE001 - SystemExit etc. from the user's code fail the row only
            results.append((key, False, f"{row_label(row)}: the reward function raised {first_line(err)}"))
        if slot[_RETIRE]:
            keep_going = False
            break
        if time.monotonic() - flushed >= FLUSH_SECONDS:
            _SLOT.pack_into(slot, 0, _IDLE, 0.0)
            _send(conn, "rows", results, rows)
            results, flushed = [], time.monotonic()
    _SLOT.pack_into(slot, 0, _IDLE, 0.0)
    _send(conn, "done" if keep_going else "retire", results, rows)
    return keep_going


def _send(conn: Connection, kind: str, results: list, rows: dict) -> None:
    try:
        conn.send((kind, results))
    except Exception:  # a result the user's function returned cannot be pickled: fail that row only
        safe = []
        for key, ok, payload in results:
            try:
                pickle.dumps(payload)
            except Exception as err:  # noqa: BLE001
                ok, payload = False, f"{row_label(rows[key])}: the reward function returned a value that cannot " \
                                     f"be sent between processes ({first_line(err)})"
            safe.append((key, ok, payload))
        conn.send((kind, safe))


# ------------------------------------------------------------------------------------------------
# In the trainer
# ------------------------------------------------------------------------------------------------
class _Worker:
    """One worker process, its socket, its shared slot and the rows it holds."""

    def __init__(self, fn_blob: bytes) -> None:
        parent_sock, child_sock = socket.socketpair()
        self.slot_file = tempfile.TemporaryFile()
        self.slot_file.write(_SLOT.pack(_IDLE, 0.0) + bytes(_SLOT_BYTES - _SLOT.size))
        self.slot_file.flush()
        self.slot = mmap.mmap(self.slot_file.fileno(), _SLOT_BYTES)
        fds = (child_sock.fileno(), self.slot_file.fileno())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, *map(str, fds), *sys.path], pass_fds=fds, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a kill takes whatever the user's function started
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.conn.send_bytes(fn_blob)
        self.ready = False
        self.rows: dict[int, Row] = {}  # key -> row of the chunk it holds, not yet answered
        self.since = time.monotonic()  # when it started, was given a chunk, or last sent something
        self.seen: tuple[int, float] | None = None  # its slot at the previous deadline check
        self.scored_any = False
        self.ended = ""  # how it ended, once it has

    def slot_state(self) -> tuple[int, float]:
        return _SLOT.unpack_from(self.slot)

    def ask_to_retire(self) -> None:
        self.slot[_RETIRE] = 1

    def rss_mb(self) -> float | None:
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * mmap.PAGESIZE / 2**20
        except (OSError, ValueError, IndexError):
            return None

    def end(self, grace: float = 0.0) -> str:
        """Wait up to ``grace`` s for it to exit, then kill its process group; how it ended ("exit code 3")."""
        if self.ended:
            return self.ended
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:  # also after it exited: whatever the user's function started goes with it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            code = self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. a hung network mount): leave it behind
            logger.warning("reward worker %d did not exit %g s after SIGKILL; leaving it", self.proc.pid, KILL_WAIT_S)
            self.ended = "killed"
            return self.ended
        self.ended = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return self.ended

    def messages(self) -> list[tuple[str, list]]:
        """What it sent and is waiting to be read; ("eof", []) last when its socket has closed."""
        out = []
        try:
            while self.conn.poll(0):
                out.append(self.conn.recv())
        except (EOFError, OSError):
            out.append(("eof", []))
        return out

    def release(self) -> None:
        """Close the parent's ends (after ``end``)."""
        self.conn.close()
        self.slot.close()
        self.slot_file.close()


class Sandbox:
    """Up to ``workers`` worker processes running ``fn`` on rows, each row under ``settings.timeout_s``."""

    def __init__(self, fn_blob: bytes, workers: int, settings: SandboxSettings, who: str) -> None:
        self.fn_blob = fn_blob
        self.size = workers
        self.settings = settings
        self.who = who  # names the function in errors
        self.workers: list[_Worker] = []
        self._start_failures = 0
        if settings.memory_limit_mb and not os.path.exists(f"/proc/{os.getpid()}/statm"):
            logger.warning("reward_model.memory_limit_mb=%d is not enforced: this OS has no /proc/<pid>/statm",
                           settings.memory_limit_mb)

    def run(self, items: list[tuple[int, Row]], on_result: Callable[[int, Row, str | None, object], None]) -> None:
        """Score ``items`` [(key, row)]; ``on_result(key, row, failure, payload)`` once per item.

        ``failure``: None (payload: the row's info dict), "error" or "timeout" (payload: a one-line message).
        If ``on_result`` raises, the workers still busy are killed and the exception propagates.
        """
        items = list(items)
        random.Random(len(items)).shuffle(items)  # spread each prompt's responses over chunks and workers
        size = -(-len(items) // (self.size * CHUNKS_PER_WORKER))
        queue = deque(items[i:i + size] for i in range(0, len(items), size))
        self._pending = len(items)
        self._on_result = on_result
        try:
            self._recycle_idle()
            while self._pending:
                self._dispatch(queue)
                busy = [w for w in self.workers if w.rows or not w.ready]
                ready = wait([w.conn for w in busy], timeout=self._next_wake(busy))
                for w in [w for w in busy if w.conn in ready]:
                    self._read(w, queue)
                self._check(queue)
        finally:
            if self._pending:  # stopped early: abandon the rows still out
                for w in [w for w in self.workers if w.rows]:
                    self._end(w)

    # -- the loop's steps -------------------------------------------------------------------------
    def _dispatch(self, queue: deque) -> None:
        """Give queued chunks to idle workers; start workers (up to ``size``) for what is left."""
        for w in self.workers:
            if queue and w.ready and not w.rows:
                chunk = queue.popleft()
                w.rows, w.since, w.seen = dict(chunk), time.monotonic(), None
                try:
                    w.conn.send(chunk)
                except OSError:  # it died while idle: read as its end of file next
                    pass
        starting = sum(not w.ready for w in self.workers)
        while queue and starting < len(queue) and len(self.workers) < self.size:
            self.workers.append(_Worker(self.fn_blob))
            starting += 1

    def _next_wake(self, busy: list[_Worker]) -> float:
        """Seconds until the nearest deadline (a row's, or a load's), the next memory check at the latest."""
        now = time.monotonic()
        wake = now + (MEMORY_POLL_S if self.settings.memory_limit_mb else LOAD_TIMEOUT_S)
        for w in busy:
            key, start = w.slot_state()
            wake = min(wake, start + self.settings.timeout_s if key != _IDLE else w.since + self._idle_limit(w))
        return max(wake - now, MIN_POLL_S)

    def _idle_limit(self, w: _Worker) -> float:
        """How long a busy worker may go without starting a row: loading, or from taking a chunk to its first row."""
        return self.settings.timeout_s if w.ready else LOAD_TIMEOUT_S

    def _read(self, w: _Worker, queue: deque) -> None:
        for kind, payload in w.messages():
            w.since = time.monotonic()
            if kind == "load_error":
                self._retire(w, queue, blame=None, why="could not load")
                raise RewardFunctionBroken(
                    f"{payload} (in a reward worker process)" if payload.startswith("custom_reward_function.")
                    else f"{self.who} cannot be loaded in a reward worker process: {payload}")
            if kind == "eof":
                self._retire(w, queue, blame="error", why=f"died ({w.end(grace=EXIT_GRACE_S)})")
                return
            w.ready = True
            self._deliver(w, payload)
            if kind == "retire":
                self._retire(w, queue, blame=None, why="retired")
                return

    def _deliver(self, w: _Worker, results: list) -> None:
        for key, ok, payload in results:
            row = w.rows.pop(key, None)
            if row is None:
                continue
            w.scored_any = True
            self._start_failures = 0
            self._pending -= 1
            self._on_result(key, row, None if ok else "error", payload)

    def _check(self, queue: deque) -> None:
        """Kill workers past their deadline or memory limit; ask big ones to retire between rows."""
        now = time.monotonic()
        limit = self.settings.memory_limit_mb
        for w in list(self.workers):
            busy = bool(w.rows) or not w.ready
            key, start = w.slot_state()
            if busy and key != _IDLE:
                if w.seen == (key, start) and now - start > self.settings.timeout_s:
                    self._retire(w, queue, blame="timeout",
                                 why=f"no result within reward_model.timeout_s={self.settings.timeout_s:g}")
                    continue
                w.seen = (key, start)
            elif busy and now - w.since > self._idle_limit(w):
                what = "load the reward function" if not w.ready else "take its rows"
                self._retire(w, queue, blame=None, why=f"did not {what} within {self._idle_limit(w):g} s")
                continue
            rss = w.rss_mb() if limit else None
            if rss is not None and rss > limit:
                self._retire(w, queue, blame="error",
                             why=f"used {rss:.0f} MB, more than reward_model.memory_limit_mb={limit}")
            elif rss is not None and rss > limit / 2:
                if busy:
                    w.ask_to_retire()
                else:
                    self._end(w, grace=EXIT_GRACE_S)

    def _recycle_idle(self) -> None:
        """Replace idle workers that hold more than half the memory limit (a leak left from earlier batches)."""
        limit = self.settings.memory_limit_mb
        for w in [w for w in self.workers if w.ready and not w.rows]:
            rss = w.rss_mb() if limit else None
            if rss is not None and rss > limit / 2:
                self._end(w, grace=EXIT_GRACE_S)

    # -- ending a worker --------------------------------------------------------------------------
    def _retire(self, w: _Worker, queue: deque, blame: str | None, why: str) -> None:
        """End ``w``; the row it was on fails (when ``blame``: "error"/"timeout"); the rest are queued again."""
        key, _ = w.slot_state()
        w.end()
        left = w.messages()  # rows it finished before it ended are kept
        self._end(w)
        for kind, payload in left:
            if kind in ("rows", "done", "retire"):
                self._deliver(w, payload)
        if blame is not None and key in w.rows:
            row = w.rows.pop(key)
            self._pending -= 1
            self._start_failures = 0
            self._on_result(key, row, blame, f"{row_label(row)}: {why}; its worker process was killed"
                            if blame == "timeout" else f"{row_label(row)}: the reward worker {why} while scoring it")
        elif not w.scored_any and why != "retired":
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                raise RewardFunctionBroken(
                    f"{self.who}: {MAX_START_FAILURES} reward worker processes in a row ended before scoring a row "
                    f"(the last {why}); see the log above")
        if w.rows:
            queue.appendleft(list(w.rows.items()))
            w.rows = {}

    def _end(self, w: _Worker, grace: float = 0.0) -> None:
        """Stop tracking ``w`` and end it (idempotent)."""
        if w in self.workers:
            self.workers.remove(w)
        w.conn.close()  # an idle worker exits when its socket closes
        w.end(grace)
        w.release()

    def close(self) -> None:
        """End every worker."""
        for w in list(self.workers):
            self._end(w, grace=EXIT_GRACE_S)
