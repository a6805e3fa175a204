"""One run directory, one run: the advisory lock a live trainer holds, and what a fresh start finds there.

Lock. The driver takes an exclusive ``flock`` on ``<run dir>/.grpo_npu.lock`` for its whole life and writes
its pid, host and start time into the file. A second trainer on the same directory cannot take the lock and
stops at once, naming the holder. The kernel releases a flock when its process dies (kill -9 included), so a
lock file left by a killed run is simply taken over; its old contents name the dead holder in a warning.
(flock is advisory and, on some network filesystems, local to a host: the holder's host is written down so
the message says where the other run lives.)

Fresh start. A run that does not resume (``trainer.resume_mode=disable``, or ``auto`` with no checkpoint)
into a directory that already holds another run's files would mix the two (metrics appended to the old
``metrics.jsonl``, old ``global_step_*`` beside the new ones, a later ``auto`` resume picking the wrong
one). ``trainer.existing_run_dir`` decides: ``refuse`` (the default: one line, exit 2) or ``move_aside``
(the old files move into ``<run dir>/previous_runs/<time>/``, and the log says where).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from grpo_npu.errors import UserError
from grpo_npu.names import EXISTING_RUN_POLICIES

log = logging.getLogger(__name__)

LOCK_FILE = ".grpo_npu.lock"
PREVIOUS_RUNS = "previous_runs"
# What marks a directory as holding a run: its metrics, checkpoints, the commit point, curves, event files.
_RUN_FILES = ("metrics.jsonl", "latest_checkpointed_iteration.txt", "tensorboard")
_RUN_PREFIXES = ("global_step_", ".tmp_global_step_")
_RUN_SUFFIXES = (".png",)


class RunDirLock:
    """An exclusive advisory lock on a run directory, held from ``acquire`` to ``release``."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        """Take the lock or raise UserError naming the holder; warns when taking over a dead run's lock."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise UserError(f"trainer.default_local_dir={self.run_dir} is in use by another run "
                            f"({_describe(read_holder(self.path))}): stop it, or use another directory") from None
        previous = read_holder(self.path)
        if previous:
            log.warning("taking over the lock of %s, left by %s, which is no longer running", self.run_dir,
                        _describe(previous))
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the holder and drop the lock (the file stays: removing it would race a new holder)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def read_holder(path: Path) -> dict:
    """The holder recorded in a lock file ({} when empty or unreadable)."""
    try:
        text = path.read_text().strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def previous_run_files(run_dir: str | os.PathLike) -> list[Path]:
    """The files and folders in ``run_dir`` that belong to an earlier run (sorted)."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = (p for p in root.iterdir()
             if p.name in _RUN_FILES or p.name.startswith(_RUN_PREFIXES) or p.name.endswith(_RUN_SUFFIXES))
    return sorted(p for p in found if not (p.is_file() and p.stat().st_size == 0))  # an empty file logged nothing


def prepare_fresh_start(run_dir: str | os.PathLike, policy: str) -> Path | None:
    """Make ``run_dir`` clean for a run that does not resume; returns where an old run was moved, if any.

    ``refuse``: UserError naming the directory and what it holds. ``move_aside``: the old run's files go to
    ``previous_runs/<timestamp>/`` inside the directory.
    """
    if policy not in EXISTING_RUN_POLICIES:
        raise UserError(f"trainer.existing_run_dir={policy!r}; supported values: {', '.join(EXISTING_RUN_POLICIES)}")
    found = previous_run_files(run_dir)
    if not found:
        return None
    names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
    if policy == "refuse":
        raise UserError(f"trainer.default_local_dir={run_dir} already holds another run ({names}) and this run "
                        "does not resume it: use a new directory, resume it (trainer.resume_mode=auto), or set "
                        "trainer.existing_run_dir=move_aside to move the old run aside")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    dest = Path(run_dir) / PREVIOUS_RUNS / stamp
    dest.mkdir(parents=True)
    for path in found:
        os.replace(path, dest / path.name)
    log.warning("moved the earlier run in %s (%s) aside to %s", run_dir, names, dest)
    return dest
