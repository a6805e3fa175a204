"""The user-facing error types and the process exit codes: one home for both.

A ``UserError`` (or a ``ConfigError``, its configuration flavour) is a problem with what the user
gave: a key, a file, a data row. The entry points print its message as one line and exit with
``EXIT_BAD_INPUT``; the message names the key/file/row and what was expected.
"""

from __future__ import annotations

import traceback

EXIT_OK = 0  # the run completed
EXIT_STOPPED = 1  # the run stopped itself by policy (e.g. too many consecutive bad steps)
EXIT_BAD_INPUT = 2  # bad configuration or input: one line names the key/file/row
EXIT_INTERNAL = 3  # an error inside grpo_npu or a library: one line, the traceback in the run's train.log
EXIT_SIGNAL_BASE = 128  # stopped by signal N (after saving a checkpoint): exit 128 + N, as shells report it


class UserError(ValueError):
    """A problem with the user's input; its message is one line naming the key, file or row."""


class ConfigError(UserError):
    """A configuration problem; the message names the key, the value and what is accepted."""


class TrainingStopped(RuntimeError):
    """The run stopped itself (too many consecutive bad steps); a checkpoint of the last good state exists."""


class StepTimeout(TrainingStopped):
    """A step outlived trainer.step_timeout_s: some ranks did not answer in time (hung, stopped, node gone)."""


class SyncMismatch(TrainingStopped):
    """The weight-sync canary found the rollout engine's log-probs off the actor's after a weight sync."""


class StoppedBySignal(RuntimeError):
    """SIGINT/SIGTERM stopped the run after a step (a checkpoint was saved if saving is on)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class WorkerError(RuntimeError):
    """A worker raised: carries the rank, the method, the worker-side traceback, a one-line ``summary``
    ("ExceptionType: first line of its message"), whether it was a user error (bad input: a ValueError or
    OSError such as a missing file, as opposed to a failure inside grpo_npu or a library) and whether the rank
    stopped the run by policy (a TrainingStopped, e.g. the weight-sync canary)."""

    def __init__(self, rank: int, method: str, details: str, summary: str = "", user_error: bool = False,
                 stopped: bool = False):
        super().__init__(f"rank {rank} failed in {method}():\n{details}")
        self.rank = rank
        self.method = method
        self.details = details
        self.summary = summary or (details.strip().splitlines()[-1] if details.strip() else "unknown error")
        self.user_error = user_error
        self.stopped = stopped

    @classmethod
    def from_exception(cls, rank: int, method: str, exc: BaseException) -> "WorkerError":
        """From the exception being handled (call inside ``except``)."""
        text = str(exc).strip()
        summary = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        return cls(rank, method, traceback.format_exc(), summary, isinstance(exc, (ValueError, OSError)),
                   isinstance(exc, TrainingStopped))

    def __reduce__(self):  # picklable across the Ray boundary
        return (WorkerError, (self.rank, self.method, self.details, self.summary, self.user_error, self.stopped))
