"""Training-side parity of two runs that replayed the same rollouts (``compare_runs RUN_A RUN_B --mode train``).

Usage::

    python -m grpo_npu.tools.compare_runs RUN_A RUN_B --mode train [--rtol R] [--atol A] [--key KEY ...] [--json PATH]

Two replays of one dump (``trainer.replay_rollouts_from``, docs/parity.md) train on the same token ids and
scores, so their rewards are identical by construction and sampling noise is gone: what differs is the
training side (kernels, reduction orders, dtypes, code versions). Run B is the baseline. For every metric of
``TRAIN_KEYS`` (or ``--key``) that either run logs, over the steps both runs log ``actor/pg_loss``:

- a step agrees when ``|a - b| <= atol + rtol * |b|``;
- the metric PASSes when every step agrees; the report shows the worst step (largest ``|a - b|``).

``REPLAY_IDENTICAL_KEYS`` (the rewards and lengths, which come from the dump) must be equal at every common
step; when they are not, the runs did not replay the same dump and nothing is compared (exit 2). A metric
that one run logs and the other does not (a KL loss on one side only) is a configuration difference: exit 2.

Default tolerances: ``rtol`` 2% (Ascend's training-loss target for SFT parity) and ``atol`` 1e-3 (GRPO's
``pg_loss`` sits near 0 at ratio 1). Two replays on the same machine with ``trainer.deterministic=True``
agree exactly (``--rtol 0 --atol 0``); different devices agree within the defaults on the first steps and
drift apart slowly as their weights do.

Exit codes: 0 PASS (every compared metric agrees at every common step), 1 FAIL, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

from grpo_npu.io import write_atomic
from grpo_npu.tools.run_metrics import load_metrics, metric_curve, resolve_metrics_file

MODE = "train"
TRAIN_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac",
              "actor/ppo_kl", "critic/vf_loss", "critic/grad_norm")
STEP_SOURCE_KEY = "actor/pg_loss"  # the steps compared: those where both runs updated the actor
# Read from the dump in a replay: two replays of one dump log the same values.
REPLAY_IDENTICAL_KEYS = ("critic/score/mean", "response_length/mean")
RTOL = 0.02
ATOL = 1e-3
EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


@dataclass(frozen=True)
class KeyParity:
    """One metric over the common steps."""

    key: str
    worst_step: int
    a: float  # run A at the worst step
    b: float  # run B at the worst step
    max_abs_diff: float
    steps_outside: int  # steps where |a - b| > atol + rtol * |b|

    @property
    def verdict(self) -> str:
        return "PASS" if self.steps_outside == 0 else "FAIL"


@dataclass(frozen=True)
class TrainParity:
    run_a: str
    run_b: str
    rtol: float
    atol: float
    common_steps: tuple[int, ...]
    keys: tuple[KeyParity, ...]

    @property
    def verdict(self) -> str:
        return "PASS" if all(k.verdict == "PASS" for k in self.keys) else "FAIL"

    @property
    def exit_code(self) -> int:
        return EXIT_PASS if self.verdict == "PASS" else EXIT_FAIL


def requested(argv: Sequence[str]) -> bool:
    """Whether a compare_runs command line asks for ``--mode train``."""
    args = list(argv)
    return f"--mode={MODE}" in args or any(a == "--mode" and b == MODE for a, b in zip(args, args[1:]))


def compare_train(run_a: str | os.PathLike, run_b: str | os.PathLike, *, rtol: float = RTOL, atol: float = ATOL,
                  keys: Sequence[str] = TRAIN_KEYS) -> TrainParity:
    """Compare run A's training metrics with the baseline run B's; ValueError on bad input (see the module doc)."""
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"rtol and atol must be >= 0, got {rtol} and {atol}")
    path_a, path_b = resolve_metrics_file(run_a), resolve_metrics_file(run_b)
    runs = {"A": load_metrics(path_a), "B": load_metrics(path_b)}
    labels = {"A": f"run A ({path_a})", "B": f"run B ({path_b})"}
    steps = [set(metric_curve(runs[r], STEP_SOURCE_KEY, label=labels[r])) for r in runs]
    common = tuple(sorted(steps[0] & steps[1]))
    if not common:
        raise ValueError(f"no common steps with {STEP_SOURCE_KEY!r}")
    logged = {r: {k for s in common for k in runs[r][s]} for r in runs}
    for key in REPLAY_IDENTICAL_KEYS:
        if key in logged["A"] and key in logged["B"]:
            for s in common:
                a, b = runs["A"][s].get(key), runs["B"][s].get(key)
                if a != b:
                    raise ValueError(f"{key!r} differs at step {s} ({a} vs {b}): the runs did not train on the same "
                                     "rollouts; replay both from one dump (trainer.replay_rollouts_from)")
    results = []
    for key in keys:
        if key not in logged["A"] and key not in logged["B"]:
            continue
        only = [r for r in runs if key not in logged[r]]
        if only:
            logger = "B" if only == ["A"] else "A"
            raise ValueError(f"{key!r} is logged by run {logger} only: the runs were configured differently")
        curves = {r: metric_curve({s: runs[r][s] for s in common}, key, label=labels[r]) for r in runs}
        shared = [s for s in common if s in curves["A"] and s in curves["B"]]
        diffs = {s: abs(curves["A"][s] - curves["B"][s]) for s in shared}
        worst = max(shared, key=lambda s: diffs[s])
        outside = sum(diffs[s] > atol + rtol * abs(curves["B"][s]) for s in shared)
        results.append(KeyParity(key, worst, curves["A"][worst], curves["B"][worst], diffs[worst], outside))
    return TrainParity(str(path_a), str(path_b), rtol, atol, common, tuple(results))


def format_report(report: TrainParity) -> str:
    """The stdout table."""
    rows = [("metric", "max |A-B|", "at step", "A", "B", "result")]
    rows += [(k.key, f"{k.max_abs_diff:.3g}", str(k.worst_step), f"{k.a:.6g}", f"{k.b:.6g}", k.verdict)
             for k in report.keys]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    steps = report.common_steps
    return "\n".join([
        "training-side parity report (run B is the baseline)",
        f"  run A: {report.run_a}",
        f"  run B: {report.run_b}",
        f"  {len(steps)} common steps ({steps[0]}..{steps[-1]}); a step agrees when |A-B| <= "
        f"{report.atol:g} + {report.rtol:g} * |B|",
        *("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows),
        f"verdict: {report.verdict} (exit {report.exit_code})",
    ])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m grpo_npu.tools.compare_runs --mode {MODE}",
                                description="Training-side parity of two replays of one rollout dump.",
                                epilog=f"exit codes: {EXIT_PASS} PASS, {EXIT_FAIL} FAIL, {EXIT_BAD_INPUT} bad input")
    p.add_argument("run_a", help="run directory (with metrics.jsonl) or metrics jsonl path")
    p.add_argument("run_b", help="the baseline run")
    p.add_argument("--mode", choices=[MODE], default=MODE)
    p.add_argument("--rtol", type=float, default=RTOL, help=f"relative tolerance (default {RTOL})")
    p.add_argument("--atol", type=float, default=ATOL, help=f"absolute tolerance (default {ATOL})")
    p.add_argument("--key", action="append", help="compare this metric (repeatable; default: the training losses)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        report = compare_train(args.run_a, args.run_b, rtol=args.rtol, atol=args.atol, keys=args.key or TRAIN_KEYS)
        if args.json:
            summary = {**asdict(report), "verdict": report.verdict,
                       "keys": [{**asdict(k), "verdict": k.verdict} for k in report.keys]}
            write_atomic(args.json, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    except (ValueError, OSError) as exc:
        print(f"compare_runs: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
