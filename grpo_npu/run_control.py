"""Control of a running step: named wall-clock sections, and the graceful stop on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger(__name__)


class Timer:
    """Named wall-clock sections of one step: ``with timer("gen"): ...`` -> {"gen": seconds}."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop finishes the step, checkpoints and stops (exit 128 + signal)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, no graceful stop
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self.requested, self.signum = signal.Signals(signum).name, int(signum)
        log.warning("%s received: finishing this step, saving a checkpoint, then stopping", self.requested)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
