"""Where log lines go: the console gets one line per step and real warnings; the run's log file gets everything.

- Console (stderr): INFO and above, except engine chatter (vLLM's per-cycle "reset prefix cache" and similar
  INFO lines, Ray's and filelock's), which is kept for the file: those loggers reach the console only at
  WARNING and above.
- The run's log file ``<run dir>/train.log`` (attached by the trainer once the run directory is locked):
  everything from grpo_npu down to DEBUG, every library's INFO, and the full traceback of an error that ended
  the run (the console shows that error as one line; ``GRPO_NPU_DEBUG=1`` shows the traceback there too).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LOG_FILE = "train.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers whose INFO lines are engine chatter: file only.
QUIET_LOGGERS = ("vllm", "ray", "filelock", "urllib3", "httpx")
DEBUG_ENV = "GRPO_NPU_DEBUG"
_current_log: list[Path] = []  # the run log attached last (the entry point names it in error lines)


class _Stderr(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is at the time of each record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D401 - the current stderr, not the one at construction
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always reads sys.stderr
        pass


class _ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not record.name.split(".", 1)[0] in QUIET_LOGGERS


def debug_mode() -> bool:
    """GRPO_NPU_DEBUG=1: full tracebacks on the console too."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def setup_logging() -> None:
    """The console handler on the root logger (idempotent); grpo_npu's own loggers pass DEBUG on to the file."""
    root = logging.getLogger()
    if not any(getattr(h, "_grpo_npu_console", False) for h in root.handlers):
        console = _Stderr()
        console.setLevel(logging.INFO)
        console.setFormatter(logging.Formatter(FORMAT))
        console.addFilter(_ConsoleFilter())
        console._grpo_npu_console = True  # type: ignore[attr-defined]
        root.addHandler(console)
    root.setLevel(logging.INFO)
    logging.getLogger("grpo_npu").setLevel(logging.DEBUG)
    # vLLM installs its own stream handler unless told not to; its records then reach ours (and the file).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def attach_run_log(run_dir: str | os.PathLike) -> logging.Handler:
    """Append everything to ``<run dir>/train.log`` from now on; returns the handler (detach it when done)."""
    path = Path(run_dir) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().addHandler(handler)
    _current_log.append(path)
    return handler


def detach(handler: logging.Handler) -> None:
    """Stop writing to a run log (it stays the one named in error lines until another is attached)."""
    logging.getLogger().removeHandler(handler)
    handler.close()


def current_log() -> Path | None:
    """The run log attached most recently in this process, if any."""
    return _current_log[-1] if _current_log else None
