"""Rows (same-shaped dicts) written as a parquet file, atomically: the preprocessors' and the synthetic task's writer.

Kept apart from :mod:`grpo_npu.data.schema`, whose names the reward scorers import in every pool worker:
they never write parquet and do not load pyarrow.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_npu.io import atomic_path


def write_parquet_atomic(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write ``rows`` to ``path`` (folders created) through :func:`grpo_npu.io.atomic_path`."""
    if not rows:
        raise ValueError(f"refusing to write an empty parquet file to {path}")
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return path
