"""Reading a run's ``metrics.jsonl`` for the comparison tools (compare_runs.py, compare_train.py).

A run is a run directory holding ``metrics.jsonl``, or the path of such a file: one JSON object a line, with an
integer ``"step"`` and metric names as the trainer logs them. A step may be spread over several lines; they are
merged, and a later line wins for a key that repeats (a resumed run that re-logs a step keeps its last value).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

RUN_FILE = "metrics.jsonl"
STEP_KEY = "step"


def resolve_metrics_file(run: str | os.PathLike) -> Path:
    """A run directory -> its metrics.jsonl; a file path is returned as is."""
    path = Path(run)
    if path.is_dir():
        path = path / RUN_FILE
        if not path.is_file():
            raise FileNotFoundError(f"run directory {run} has no {RUN_FILE}")
        return path
    if not path.is_file():
        raise FileNotFoundError(f"run {run} is neither a run directory nor a metrics jsonl file")
    return path


def load_metrics(run: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Read a run's metrics jsonl into {step: {metric: value}}; later lines win for a repeated key."""
    path = resolve_metrics_file(run)
    steps: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            step = row.get(STEP_KEY)
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"{path}:{lineno}: expected an integer {STEP_KEY!r}, got {step!r}")
            steps.setdefault(step, {}).update((k, v) for k, v in row.items() if k != STEP_KEY)
    if not steps:
        raise ValueError(f"{path}: no metric rows")
    return dict(sorted(steps.items()))


def metric_curve(metrics: dict[int, dict[str, Any]], key: str, *, label: str) -> dict[int, float]:
    """{step: value} of one metric; raises ValueError if it is never logged or not a finite number."""
    curve: dict[int, float] = {}
    for step, row in metrics.items():
        if key not in row:
            continue
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{label}: step {step}: {key!r} must be a finite number, got {value!r}")
        curve[step] = float(value)
    if not curve:
        known = sorted({k for row in metrics.values() for k in row})
        shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
        raise ValueError(f"{label}: metric {key!r} is never logged (metrics present: {shown or 'none'})")
    return curve
