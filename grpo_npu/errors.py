"""The user-facing error types and the process exit codes: one home for both.

A ``UserError`` (or a ``ConfigError``, its configuration flavour) is a problem with what the user
gave: a key, a file, a data row. The entry points print its message as one line and exit with
``EXIT_BAD_INPUT``; the message names the key/file/row and what was expected.
"""

from __future__ import annotations

EXIT_OK = 0  # the run completed
EXIT_STOPPED = 1  # the run stopped itself by policy (e.g. too many consecutive bad steps)
EXIT_BAD_INPUT = 2  # bad configuration or input: one line names the key/file/row
EXIT_SIGNAL_BASE = 128  # stopped by signal N (after saving a checkpoint): exit 128 + N, as shells report it


class UserError(ValueError):
    """A problem with the user's input; its message is one line naming the key, file or row."""


class ConfigError(UserError):
    """A configuration problem; the message names the key, the value and what is accepted."""


class TrainingStopped(RuntimeError):
    """The run stopped itself (too many consecutive bad steps); a checkpoint of the last good state exists."""


class StoppedBySignal(RuntimeError):
    """SIGINT/SIGTERM stopped the run after a step (a checkpoint was saved if saving is on)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
