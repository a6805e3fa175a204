"""Parity report between two runs: reward (or SFT loss) MAE %, throughput ratio, overlaid curves.

Usage::

    python -m grpo_npu.tools.compare_runs RUN_A RUN_B [--mode rl|sft] [--reward-key KEY]
        [--loss-key KEY] [--throughput-steps N] [--target-pct X] [--json PATH] [--plot PATH | --no-plot]
    python -m grpo_npu.tools.compare_runs RUN_A RUN_B --mode train [--rtol R] [--atol A]   (compare_train.py:
        the training side of two replays of one rollout dump, docs/parity.md)

Run format. RUN_A / RUN_B are run directories holding ``metrics.jsonl``, or paths to such a jsonl
file. Each non-blank line is one JSON object with an integer ``"step"`` and metric names as the
trainer logs them (``"critic/score/mean"``, ``"perf/throughput"``, ``"actor/pg_loss"``,
``"val-core/openai/gsm8k/reward/mean@1"``, ...). A step may be spread over several lines (for
example training and validation metrics); they are merged, and a later line wins for a key that
repeats (a resumed run that re-logs a step keeps its last value).

Definitions (run B is the baseline, e.g. the GPU run or the "before" run):

- common steps: the steps at which both runs log the compared metric;
- MAE = mean over the common steps of ``|a_s - b_s|`` (in the metric's units);
- MAE % = ``100 * MAE / mean over the common steps of |b_s|``, i.e. the absolute error relative to
  the baseline's mean magnitude (infinite when the baseline is 0 everywhere and the runs differ);
- throughput ratio = mean ``perf/throughput`` over the first N (default 4) steps that each run logs,
  run A / run B.

Targets follow the parity criteria Ascend publishes for verl on NPU (verl
``docs/ascend_tutorial/ascend_quick_start.rst``, sections "精度对比说明" and "吞吐对比说明"): reward
mean absolute error <= 4% for RL algorithms (key ``critic/score/mean``), training-loss mean absolute
error <= 2% for SFT (key ``train/loss``), and throughput ratio = mean ``perf/throughput`` of the first
4 logged steps, NPU / A100. That page states the MAE as a percentage but gives its formula only as
a figure (and points to hiascend's LMaccuracy guide), so the relative form above is our reading of
it, stated here so the number is reproducible.

No signal, no verdict: two runs whose rewards stay 0 have MAE 0% and prove nothing. The comparison
is INCONCLUSIVE (never PASS or FAIL; the MAE is still shown) with fewer than 5 common steps, or when
either run's metric has a population standard deviation below 1e-6 over the common steps.

Exit codes: 0 PASS (the MAE % is within the target), 1 FAIL (it is not; CI can gate on parity),
2 on bad input (missing file, malformed line, missing metric, no common steps, matplotlib absent
while ``--plot`` was asked for), 3 INCONCLUSIVE (no signal, see above).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import pstdev
from typing import Any, Sequence

from grpo_npu.io import write_atomic
from grpo_npu.tools import compare_train
from grpo_npu.tools.run_metrics import RUN_FILE, STEP_KEY, load_metrics, metric_curve, resolve_metrics_file

REWARD_KEY = "critic/score/mean"
SFT_LOSS_KEY = "train/loss"
THROUGHPUT_KEY = "perf/throughput"
# Ascend averages perf/throughput over the first 4 steps of each run's log.
THROUGHPUT_STEPS = 4
# Ascend's published parity targets, MAE % per mode: rewards for RL, training loss for SFT.
TARGET_PCT = {"rl": 4.0, "sft": 2.0}
MODES = tuple(TARGET_PCT)
DEFAULT_PLOT = "compare.png"
# Fewer common steps, or a flatter curve (a reward that stays 0), and a comparison proves nothing.
MIN_COMMON_STEPS = 5
MIN_STD = 1e-6

EXIT_WITHIN, EXIT_OUTSIDE, EXIT_BAD_INPUT, EXIT_INCONCLUSIVE = 0, 1, 2, 3
EXIT_CODES_HELP = (
    f"exit codes: {EXIT_WITHIN} PASS (MAE % within the target), {EXIT_OUTSIDE} FAIL (outside it), "
    f"{EXIT_BAD_INPUT} bad input, {EXIT_INCONCLUSIVE} INCONCLUSIVE (no signal: fewer than {MIN_COMMON_STEPS} "
    f"common steps, or either run's metric with a standard deviation below {MIN_STD:g} over them)"
)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed, so the curve plot cannot be drawn."""


# --------------------------------------------------------------------------------------------
# The numbers
# --------------------------------------------------------------------------------------------
def mae_percent(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(MAE, MAE %) of ``a`` against the baseline ``b``: mean|a-b| and 100 * mean|a-b| / mean|b|."""
    if len(a) != len(b) or not a:
        raise ValueError(f"mae_percent needs two equal, non-empty sequences (got {len(a)} and {len(b)})")
    mae = sum(abs(x - y) for x, y in zip(a, b)) / len(a)
    scale = sum(abs(y) for y in b) / len(b)
    if scale == 0.0:
        return mae, 0.0 if mae == 0.0 else math.inf
    return mae, 100.0 * mae / scale


def no_signal_reason(num_common: int, std_a: float, std_b: float, key: str) -> str | None:
    """Why comparing ``key`` over ``num_common`` steps with these population stds proves nothing, or None."""
    if num_common < MIN_COMMON_STEPS:
        return f"only {num_common} common steps with {key!r} (need >= {MIN_COMMON_STEPS})"
    flat = [name for name, std in (("A", std_a), ("B", std_b)) if std < MIN_STD]
    if flat:
        runs = " and ".join(f"run {name}" for name in flat)
        return f"{key!r} of {runs} is flat over the common steps (std < {MIN_STD:g})"
    return None


def first_steps_mean(curve: dict[int, float], n: int) -> tuple[float, tuple[int, ...]]:
    """Mean of a curve over its first ``n`` logged steps (fewer if the run is shorter)."""
    steps = tuple(sorted(curve)[:n])
    return sum(curve[s] for s in steps) / len(steps), steps


@dataclass(frozen=True)
class ParityReport:
    """Parity of run A against the baseline run B; see the module docstring for the definitions."""

    run_a: str
    run_b: str
    mode: str
    metric_key: str
    common_steps: tuple[int, ...]
    mae: float
    mae_pct: float
    max_abs_diff: float
    baseline_mean_abs: float
    target_pct: float
    throughput_a: float | None
    throughput_b: float | None
    throughput_ratio: float | None
    throughput_steps_a: tuple[int, ...]
    throughput_steps_b: tuple[int, ...]
    std_a: float
    std_b: float
    inconclusive_reason: str | None
    curve_a: dict[int, float] = field(repr=False)
    curve_b: dict[int, float] = field(repr=False)

    @property
    def within_target(self) -> bool:
        """A PASS: the comparison has signal and its MAE % is within the target."""
        return self.inconclusive_reason is None and self.mae_pct <= self.target_pct

    @property
    def verdict(self) -> str:
        if self.inconclusive_reason is not None:
            return "INCONCLUSIVE"
        return "PASS" if self.within_target else "FAIL"

    @property
    def exit_code(self) -> int:
        return {"PASS": EXIT_WITHIN, "FAIL": EXIT_OUTSIDE, "INCONCLUSIVE": EXIT_INCONCLUSIVE}[self.verdict]

    def summary(self) -> dict[str, Any]:
        """The JSON summary: every number above (non-finite ones as null) without the curves."""
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "baseline": "run_b",
            "mode": self.mode,
            "metric_key": self.metric_key,
            "mae_definition": "100 * mean_s |a_s - b_s| / mean_s |b_s| over the common steps s",
            "num_common_steps": len(self.common_steps),
            "common_steps": list(self.common_steps),
            "mae": _finite_or_none(self.mae),
            "mae_pct": _finite_or_none(self.mae_pct),
            "max_abs_diff": _finite_or_none(self.max_abs_diff),
            "baseline_mean_abs": self.baseline_mean_abs,
            "target_pct": self.target_pct,
            "std_a": self.std_a,
            "std_b": self.std_b,
            "verdict": self.verdict,
            "inconclusive_reason": self.inconclusive_reason,
            "within_target": self.within_target,
            "throughput_key": THROUGHPUT_KEY,
            "throughput_a": self.throughput_a,
            "throughput_b": self.throughput_b,
            "throughput_ratio": self.throughput_ratio,
            "throughput_steps_a": list(self.throughput_steps_a),
            "throughput_steps_b": list(self.throughput_steps_b),
        }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def compare_runs(
    run_a: str | os.PathLike,
    run_b: str | os.PathLike,
    *,
    reward_key: str = REWARD_KEY,
    loss_key: str = SFT_LOSS_KEY,
    mode: str = "rl",
    first_n_throughput: int = THROUGHPUT_STEPS,
    target_pct: float | None = None,
) -> ParityReport:
    """Compare run A with the baseline run B (``mode`` rl: reward MAE, sft: loss MAE) plus throughput.

    ``first_n_throughput=0`` skips the throughput ratio; ``target_pct`` overrides the mode's target.
    """
    if mode not in TARGET_PCT:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(MODES)}")
    if first_n_throughput < 0:
        raise ValueError(f"first_n_throughput must be >= 0, got {first_n_throughput}")
    target = TARGET_PCT[mode] if target_pct is None else float(target_pct)
    if not target >= 0.0:
        raise ValueError(f"target_pct must be >= 0, got {target_pct}")
    path_a, path_b = resolve_metrics_file(run_a), resolve_metrics_file(run_b)
    metrics_a, metrics_b = load_metrics(path_a), load_metrics(path_b)
    label_a, label_b = f"run A ({path_a})", f"run B ({path_b})"

    key = reward_key if mode == "rl" else loss_key
    curve_a = metric_curve(metrics_a, key, label=label_a)
    curve_b = metric_curve(metrics_b, key, label=label_b)
    common = tuple(sorted(set(curve_a) & set(curve_b)))
    if not common:
        raise ValueError(
            f"no common steps with {key!r}: {label_a} logs steps {_span(curve_a)}, "
            f"{label_b} logs steps {_span(curve_b)}"
        )
    a = [curve_a[s] for s in common]
    b = [curve_b[s] for s in common]
    mae, mae_pct = mae_percent(a, b)
    std_a, std_b = pstdev(a), pstdev(b)

    tp_a = tp_b = ratio = None
    steps_tp_a: tuple[int, ...] = ()
    steps_tp_b: tuple[int, ...] = ()
    if first_n_throughput > 0:
        tp_a, steps_tp_a = first_steps_mean(metric_curve(metrics_a, THROUGHPUT_KEY, label=label_a), first_n_throughput)
        tp_b, steps_tp_b = first_steps_mean(metric_curve(metrics_b, THROUGHPUT_KEY, label=label_b), first_n_throughput)
        if tp_b <= 0.0:
            raise ValueError(
                f"{label_b}: mean {THROUGHPUT_KEY!r} over steps {list(steps_tp_b)} is {tp_b}, expected > 0"
            )
        ratio = tp_a / tp_b

    return ParityReport(
        run_a=str(path_a), run_b=str(path_b),
        mode=mode,
        metric_key=key,
        common_steps=common,
        mae=mae,
        mae_pct=mae_pct,
        max_abs_diff=max(abs(x - y) for x, y in zip(a, b)),
        baseline_mean_abs=sum(abs(y) for y in b) / len(b),
        target_pct=target,
        std_a=std_a, std_b=std_b,
        inconclusive_reason=no_signal_reason(len(common), std_a, std_b, key),
        throughput_a=tp_a, throughput_b=tp_b,
        throughput_ratio=ratio,
        throughput_steps_a=steps_tp_a, throughput_steps_b=steps_tp_b,
        curve_a=curve_a, curve_b=curve_b,
    )


def _span(steps: Sequence[int] | dict[int, float]) -> str:
    steps = sorted(steps)
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])


# --------------------------------------------------------------------------------------------
# Output: table, JSON, plot
# --------------------------------------------------------------------------------------------
def format_report(report: ParityReport) -> str:
    """The stdout table."""
    pct = f"{report.mae_pct:.2f}%" if math.isfinite(report.mae_pct) else "inf"
    what = "reward" if report.mode == "rl" else "loss"
    rows = [
        ("check", "value", "target", "result"),
        (f"{what} MAE %", pct, f"<= {report.target_pct:g}%", report.verdict),
    ]
    if report.throughput_ratio is not None:
        rows.append(("throughput ratio A/B", f"{report.throughput_ratio:.3f}", "-", "info"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines = [
        f"parity report, mode {report.mode} (run B is the baseline)",
        f"  run A: {report.run_a}",
        f"  run B: {report.run_b}",
        *table,
        f"  {report.metric_key} over {len(report.common_steps)} common steps ({_span(report.common_steps)}): "
        f"MAE {report.mae:.6g}, max |A-B| {report.max_abs_diff:.6g}, mean |B| {report.baseline_mean_abs:.6g}",
        "  MAE % = 100 * mean|A-B| / mean|B| over the common steps",
    ]
    if report.throughput_ratio is not None:
        lines.append(
            f"  {THROUGHPUT_KEY} mean over the first {len(report.throughput_steps_a)}/{len(report.throughput_steps_b)} "
            f"steps: A {report.throughput_a:.6g} (steps {_span(report.throughput_steps_a)}), "
            f"B {report.throughput_b:.6g} (steps {_span(report.throughput_steps_b)})"
        )
    why = f"{'within' if report.within_target else 'outside'} target"
    if report.inconclusive_reason is not None:
        why = f"inconclusive, no signal: {report.inconclusive_reason}"
    lines.append(f"verdict: {why} (exit {report.exit_code})")
    return "\n".join(lines)


def write_summary(report: ParityReport, path: str | os.PathLike) -> Path:
    """Write the JSON summary atomically."""
    text = json.dumps(report.summary(), indent=2, allow_nan=False) + "\n"
    return write_atomic(path, text.encode("utf-8"))


def plot_curves(report: ParityReport, path: str | os.PathLike) -> Path:
    """Overlay both runs' curves of the compared metric in a PNG (matplotlib, no global backend change)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise PlotUnavailable("matplotlib is not installed (pip install 'grpo_npu[plot]')") from exc
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, run, curve in (("A", report.run_a, report.curve_a), ("B (baseline)", report.run_b, report.curve_b)):
        ax.plot(list(curve), list(curve.values()), marker="." if len(curve) < 50 else None,
                label=f"{label}: {_run_name(run)}")
    pct = f"{report.mae_pct:.2f}%" if math.isfinite(report.mae_pct) else "inf"
    ax.set_title(f"{report.metric_key}: MAE {pct} (target <= {report.target_pct:g}%): {report.verdict}")
    ax.set_xlabel(STEP_KEY)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(report.metric_key)
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return write_atomic(path, buf.getvalue())


def _run_name(run: str) -> str:
    path = Path(run)
    return path.parent.name if path.name == RUN_FILE and path.parent.name else path.name


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m grpo_npu.tools.compare_runs",
        description="Parity report of run A against the baseline run B (reward/loss MAE %, throughput ratio).",
        epilog=EXIT_CODES_HELP,
    )
    p.add_argument("run_a", help=f"run directory (with {RUN_FILE}) or metrics jsonl path")
    p.add_argument("run_b", help="the baseline run: directory or metrics jsonl path")
    p.add_argument("--mode", choices=(*MODES, compare_train.MODE), default="rl",
                   help="rl: reward MAE (<= 4%%); sft: loss MAE (<= 2%%); train: losses of two replays (--mode train -h)")
    p.add_argument("--reward-key", default=REWARD_KEY, help=f"metric compared in rl mode (default {REWARD_KEY})")
    p.add_argument("--loss-key", default=SFT_LOSS_KEY, help=f"metric compared in sft mode (default {SFT_LOSS_KEY})")
    p.add_argument("--throughput-steps", type=int, default=THROUGHPUT_STEPS,
                   help=f"average {THROUGHPUT_KEY} over this many first steps; 0 skips the ratio")
    p.add_argument("--target-pct", type=float, default=None, help="override the mode's MAE %% target")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    plot = p.add_mutually_exclusive_group()
    plot.add_argument("--plot", metavar="PATH", help=f"PNG of both curves (default ./{DEFAULT_PLOT})")
    plot.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if compare_train.requested(argv):  # the training side of two replays: grpo_npu/tools/compare_train.py
        return compare_train.main(argv)
    args = _parser().parse_args(argv)
    try:
        report = compare_runs(
            args.run_a, args.run_b, reward_key=args.reward_key, loss_key=args.loss_key, mode=args.mode,
            first_n_throughput=args.throughput_steps, target_pct=args.target_pct,
        )
        if args.json:
            write_summary(report, args.json)
        plot_note = None
        if not args.no_plot:
            try:
                plot_note = f"plot: {plot_curves(report, args.plot or DEFAULT_PLOT)}"
            except PlotUnavailable as exc:
                if args.plot:
                    raise
                plot_note = f"plot: skipped, {exc}"
    except (ValueError, OSError, PlotUnavailable) as exc:
        print(f"compare_runs: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(report))
    if plot_note:
        print(plot_note)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
