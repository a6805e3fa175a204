"""PNG curves of a run: reward, response length, KL, entropy, throughput, from its metrics.

    python -m grpo_npu.tracking plot RUN_DIR     # the PNGs from RUN_DIR/metrics.jsonl

The Tracker writes the same PNGs into the run directory when it closes. matplotlib is optional
(``pip install 'grpo_npu[plot]'``): it is imported when a plot is drawn, and without it nothing is
drawn and one warning says so.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from grpo_npu.io import write_atomic
from grpo_npu.tracking.sinks import METRICS_FILE, VAL_PREFIX, read_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurveSpec:
    """One PNG: the metrics drawn on it (exact names, then any with one of the prefixes)."""

    filename: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    prefixes: tuple[str, ...] = field(default=())

    def select(self, names: set[str]) -> list[str]:
        exact = [k for k in self.keys if k in names]
        by_prefix = sorted(k for k in names if k.startswith(self.prefixes) and k not in exact) if self.prefixes else []
        return exact + by_prefix


CURVES = (
    CurveSpec("reward.png", "Reward", "score", ("critic/score/mean",), (VAL_PREFIX,)),
    CurveSpec("response_length.png", "Response length", "tokens",
              ("response_length/mean", "response_length/max", "response_length/min")),
    CurveSpec("kl.png", "KL", "kl", ("actor/kl_loss", "actor/ppo_kl")),
    CurveSpec("entropy.png", "Entropy", "nats / token", ("actor/entropy",)),
    CurveSpec("throughput.png", "Throughput", "tokens / s / device", ("perf/throughput",)),
)

_warned_no_matplotlib = False


def plot_curves(run_dir: str | os.PathLike, history: Mapping[int, Mapping[str, Any]] | None = None) -> list[Path]:
    """Write one PNG per curve in CURVES that has data; ``history`` defaults to run_dir/metrics.jsonl."""
    global _warned_no_matplotlib
    run_dir = Path(run_dir)
    if history is None:
        history = read_metrics(run_dir / METRICS_FILE)
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        if not _warned_no_matplotlib:
            logger.warning("matplotlib is not installed: no PNG curves (pip install 'grpo_npu[plot]')")
            _warned_no_matplotlib = True
        return []
    names = {k for row in history.values() for k in row}
    written = []
    for spec in CURVES:
        keys = spec.select(names)
        if not keys:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.add_subplot()
        for key in keys:
            points = [(s, float(row[key])) for s, row in sorted(history.items())
                      if key in row and isinstance(row[key], (int, float)) and math.isfinite(float(row[key]))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(spec.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(spec.ylabel)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        written.append(write_atomic(run_dir / spec.filename, buf.getvalue()))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_npu.tracking", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="write reward/response_length/kl/entropy/throughput PNGs into RUN_DIR")
    plot.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    args = parser.parse_args(argv)
    try:
        written = plot_curves(args.run_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not written:
        print("no curves written (matplotlib missing, or none of the plotted metrics were logged)", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0

