"""The metric tracker: each step's metrics fanned out to every configured sink, PNG curves at the end.

    tracker = Tracker(run_dir, ("console", "jsonl"), project=..., experiment=..., config_dict=...,
                      total_steps=100)
    tracker.truncate_after(resumed_step)   # on resume: forget steps the checkpoint does not have
    tracker.log({"critic/score/mean": 0.4, ...}, step=1)
    tracker.close()                        # also writes reward.png, kl.png, ... into run_dir

The sinks (console, jsonl, file, tensorboard, wandb, mlflow) are :mod:`grpo_npu.tracking.sinks`, the curves
:mod:`grpo_npu.tracking.plots` (also ``python -m grpo_npu.tracking plot RUN_DIR``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from grpo_npu.metrics import scalar_value
from grpo_npu.tracking.plots import plot_curves
from grpo_npu.tracking.sinks import METRICS_FILE, SINKS, RunInfo, Sink, make_sink


class Tracker:
    """Sends each step's metrics to every configured sink; writes PNG curves when closed."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        loggers: Sequence[str],
        *,
        project: str,
        experiment: str,
        config_dict: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        initial_step: int = 0,
        progress: bool | None = None,
    ) -> None:
        if isinstance(loggers, str):
            loggers = (loggers,)
        unknown = [name for name in loggers if name not in SINKS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {', '.join(map(repr, unknown))}; "
                             f"known loggers: {', '.join(SINKS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        info = RunInfo(self.run_dir, project, experiment, dict(config_dict or {}), total_steps, initial_step, progress)
        self.history: dict[int, dict[str, float]] = {}
        self.sinks: dict[str, Sink] = {}
        try:
            # metrics.jsonl is written whatever trainer.logger says: compare_runs and resume read it.
            for name in dict.fromkeys(("jsonl", *loggers)):  # de-duplicated, order kept
                self.sinks[name] = make_sink(name, info)
        except BaseException:
            self._close_sinks()
            raise
        self._closed = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (numbers or one-element tensors) for ``step`` in every sink."""
        values = {key: scalar_value(key, value) for key, value in metrics.items()}
        self.history.setdefault(step, {}).update(values)
        for sink in self.sinks.values():
            sink.log(values, step)

    def truncate_after(self, step: int) -> None:
        """On resume from checkpoint ``step``: drop everything logged for later steps."""
        self.history = {s: m for s, m in self.history.items() if s <= step}
        for sink in self.sinks.values():
            sink.truncate_after(step)

    def _close_sinks(self) -> None:
        errors = []
        for name, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as exc:  # close the others before reporting
                errors.append(f"{name}: {exc}")
        if errors:
            raise RuntimeError("closing loggers failed: " + "; ".join(errors))

    def close(self) -> None:
        """Close every sink, then write the PNG curves (skipped with a warning without matplotlib)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close_sinks()
        finally:
            jsonl = self.run_dir / METRICS_FILE
            plot_curves(self.run_dir, history=None if "jsonl" in self.sinks and jsonl.is_file() else self.history)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
