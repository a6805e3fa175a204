"""Control of a running step: named wall-clock sections, the graceful stop on SIGINT/SIGTERM, and the watchdog.

Every way a step can stop progressing ends the run within a bounded time:
- a rank that does not answer (hung, SIGSTOPped, its node gone): the worker group's calls wait at most until
  the step's deadline (``trainer.step_timeout_s``) and then raise :class:`grpo_npu.errors.StepTimeout`
  naming the phase and the ranks (:mod:`grpo_npu.workers.group`);
- the driver itself stuck (a call that never returns in this process): :class:`Watchdog`, a thread, ends the
  process STUCK_GRACE_S after the deadline with one line naming the phase;
- a signal during a step that cannot finish: :class:`StopRequest` waits SIGNAL_GRACE_S for the step to end,
  then ends the process (exit 128 + signal); a second signal ends it at once.
Nothing partial is saved in any of these cases: the newest complete checkpoint stays the newest.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

from grpo_npu.errors import EXIT_STOPPED, StoppedBySignal, WorkerError

log = logging.getLogger(__name__)

STUCK_GRACE_S = 30.0  # past the step deadline, the main thread has this long to raise StepTimeout itself
SIGNAL_GRACE_S = 60.0  # after SIGINT/SIGTERM, the step has this long to finish (and checkpoint) before exit


def _hard_exit(code: int, line: str) -> None:
    """One line on stderr, then end the process now (no clean-up can be trusted to finish)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


class Timer:
    """Named wall-clock sections of one step: ``with timer("gen"): ...`` -> {"gen": seconds}."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.current = "step"  # the innermost section running now (the watchdog names it)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start, outer = time.perf_counter(), self.current
        self.current = name
        try:
            yield
        finally:
            self.current = outer
            self.seconds[name] += time.perf_counter() - start


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop finishes the step, checkpoints and stops (exit 128 + signal)."""

    def __init__(self, grace_s: float = SIGNAL_GRACE_S) -> None:
        self.requested: str | None = None
        self.signum = 0
        self.grace_s = grace_s
        self.step_done = threading.Event()  # set by the loop when a step ends (the grace timer stands down)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, no graceful stop
                pass
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:  # a second signal means now
            _hard_exit(128 + signum, f"stopped: second {name}: exiting now, no checkpoint of the current step")
        self.requested, self.signum = name, int(signum)
        self.step_done.clear()
        log.warning("%s received: finishing this step, saving a checkpoint, then stopping (at most %.0f s; a "
                    "second signal stops at once)", name, self.grace_s)
        threading.Thread(target=self._expire, name="grpo-npu-stop-grace", daemon=True).start()

    def _expire(self) -> None:
        if not self.step_done.wait(self.grace_s):
            _hard_exit(128 + self.signum, f"stopped: {self.requested}: the step did not finish within "
                                          f"{self.grace_s:.0f} s (workers gone or stuck); no checkpoint of it")

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@contextmanager
def stopped_workers_mean_signal(stop: StopRequest, step: Callable[[], int]) -> Iterator[None]:
    """A worker error after SIGINT/SIGTERM is the same signal having stopped the workers (a process-group
    signal, as a scheduler or Ctrl-C in a terminal sends): report the stop by signal, not the worker error."""
    try:
        yield
    except WorkerError:
        if not stop.requested:
            raise
        raise StoppedBySignal(stop.signum, f"stopped by {stop.requested} during step {step()}: the workers were "
                                           "stopped by it too; no checkpoint of that step") from None


class Watchdog:
    """Ends the process when a step outlives its deadline by STUCK_GRACE_S: the driver itself is stuck.

    ``start_step(timer)`` before each step, ``end_step()`` after it. The worker group enforces the deadline on
    the ranks (StepTimeout in the main thread); this thread is the backstop for a main thread that cannot
    raise because it never returns to Python (or is stuck in its own code).
    """

    def __init__(self, timeout_s: float, grace_s: float = STUCK_GRACE_S) -> None:
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.deadline: float | None = None  # monotonic time the running step must end by
        self._timer: Timer | None = None
        self._step = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="grpo-npu-watchdog", daemon=True)
        self._thread.start()

    def start_step(self, step: int, timer: Timer) -> float:
        """Arm for one step; returns its deadline (monotonic seconds)."""
        with self._lock:
            self._step, self._timer = step, timer
            self.deadline = time.monotonic() + self.timeout_s
            self._wake.set()
            return self.deadline

    def end_step(self) -> None:
        with self._lock:
            self.deadline = None
            self._wake.set()

    def close(self) -> None:
        with self._lock:
            self._closed, self.deadline = True, None
            self._wake.set()

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                deadline = self.deadline
            if deadline is None:
                self._wake.wait()
                self._wake.clear()
                continue
            late = deadline + self.grace_s - time.monotonic()
            if late > 0:
                self._wake.wait(late)
                self._wake.clear()
                continue
            with self._lock:
                if self._closed or self.deadline != deadline:  # the step ended or a new one started meanwhile
                    continue
                phase = self._timer.current if self._timer is not None else "step"
            _hard_exit(EXIT_STOPPED, f"stopped: step {self._step} did not finish within trainer.step_timeout_s="
                                     f"{self.timeout_s:g} s: stuck in phase {phase!r} in the driver process; no "
                                     "checkpoint of this step (set trainer.step_timeout_s higher if the step is "
                                     "just slow)")
