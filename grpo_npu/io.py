"""Files that a reader, or a crash, never sees half written: the one home of every atomic write.

- :func:`atomic_path` hands out a temporary name in the target's folder; when the ``with`` block ends
  without an error the file is fsync'd, given the usual new-file mode, renamed over the target with
  ``os.replace`` and the folder fsync'd; on an error the temporary file is removed and the target is
  untouched. :func:`write_atomic` (bytes or text) and :func:`write_json` are built on it.
- :func:`commit_dir` does the same for a directory built under a temporary name.
- :class:`JsonlAppender` appends one JSON object per line, flushed line by line, and cuts off a torn
  last line (left by a killed writer) when it opens the file.

Standard library only: the entry points and the doctor import it before torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

_NEW_FILE_MODE = 0o666  # what open() would create, before the umask
_NEW_DIR_MODE = 0o777  # what mkdir() would create, before the umask


def current_umask() -> int:
    """The process umask (read by setting and restoring it: the only portable way)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (best effort: not every filesystem lets a directory be fsync'd)."""
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root``, then every directory, bottom-up."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(dirpath)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to; it replaces ``path`` when the block succeeds."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: folder {path.parent} does not exist")
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fsync_path(tmp)
        os.chmod(tmp, _NEW_FILE_MODE & ~current_umask())  # mkstemp makes 0600; give the usual new-file mode
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (str: as UTF-8) to ``path`` atomically and durably; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any, **dumps_kwargs: Any) -> Path:
    """``json.dumps(obj, **dumps_kwargs)`` written atomically to ``path``."""
    return write_atomic(path, json.dumps(obj, **dumps_kwargs))


def commit_dir(tmp: str | os.PathLike, final: str | os.PathLike, trash: str | os.PathLike | None = None) -> Path | None:
    """Make the finished directory ``tmp`` appear as ``final`` in one rename; returns the replaced one.

    Every file under ``tmp`` is fsync'd first. An existing ``final`` is first renamed to ``trash``
    (default: a hidden name next to it; a leftover there is deleted) and returned, for the caller to
    delete once its own commit point is written; None when there was nothing to replace. The parent folder is fsync'd last.
    """
    tmp, final = Path(tmp), Path(final)
    os.chmod(tmp, _NEW_DIR_MODE & ~current_umask())  # mkdtemp makes 0700: give the usual new-folder mode
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = Path(trash) if trash is not None else final.with_name(f".{final.name}.old.{os.getpid()}")
        if old.exists():  # left by an earlier attempt that was killed before deleting it
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    return old


class JsonlAppender:
    """``path`` as JSON lines: one object per :meth:`append`, written in one call and flushed."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._drop_torn_tail()
        self._file = open(self.path, "a", encoding="utf-8")

    def _drop_torn_tail(self) -> None:
        """A writer killed mid-line leaves a last line without its newline: cut it off."""
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            write_atomic(self.path, data[: data.rfind(b"\n") + 1])

    def append(self, row: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")  # one write per line
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


SHM_ROOT = "/dev/shm/grpo_npu-models"  # model.use_shm's copies, one per source directory and machine


def shm_copy(path: str, root: str = SHM_ROOT) -> str:
    """A copy of the model directory ``path`` in shared memory (``root``), made once per machine: the first process
    copies into a temporary folder and renames it into place; a later one (or another rank) finds it there. The
    name is a hash of the absolute source path."""
    if not os.path.isdir(os.path.dirname(root)):
        raise ValueError(f"actor_rollout_ref.model.use_shm=True: {os.path.dirname(root)} does not exist on this machine")
    source = os.path.abspath(path)
    dest = os.path.join(root, hashlib.sha1(source.encode()).hexdigest()[:16])
    if os.path.isdir(dest):
        return dest
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".copy-", dir=root)
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(dest):  # not another process's rename that got there first
            raise
    return dest
