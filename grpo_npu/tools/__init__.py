"""Command-line tools: the parity report (``compare_runs``) and the environment doctor (``doctor``).

Both stay dependency-light (stdlib; matplotlib only for the optional parity plot).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_NEW_FILE_MODE = 0o666  # what open() would create, before the umask


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write bytes to ``path`` through a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, _NEW_FILE_MODE & ~umask)  # mkstemp makes 0600; give the usual new-file mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
