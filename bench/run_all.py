"""Every benchmark in turn, each in its own Python process, then one summary table of all targets.

Run: ``python -m bench [--quick] [--only NAME ...] [--out-dir DIR]`` (or ``python -m bench.run_all``).
Each benchmark prints its own table and writes ``<out-dir>/<name>.json``; the summary (benchmark,
target, measured, wanted, PASS/MISS, or CRASH for a benchmark that failed) goes to
``<out-dir>/summary.json``. Exit status: 0 when every benchmark ran, even if targets were missed
(benchmarks report, they are not tests); 1 when any benchmark crashed.

A separate process per benchmark keeps peak-memory readings, thread settings and imports (vLLM,
TRL) of one benchmark out of the next.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import BenchResult, results_dir

# Run order: cheap component benchmarks first, the end-to-end comparison last.
BENCHMARKS = ("advantage", "lora", "logprob", "rollout", "step_vs_trl", "phase_limits", "scaling", "scaling_activations")
PACKAGE = "bench"  # where the benchmark modules live (a test points this at a package of its own)
SUMMARY_NAME = "summary"
REPO_ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(name: str, quick: bool, out_dir: Path, package: str = "bench") -> dict:
    """``python -m <package>.<name> [--quick] --json <out_dir>/<name>.json``; its result dict, or an error."""
    out = out_dir / f"{name}.json"
    out.unlink(missing_ok=True)  # a stale file must not pass for this run's result
    cmd = [sys.executable, "-m", f"{package}.{name}", "--json", str(out)] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"\n>>> {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    returncode = subprocess.run(cmd, cwd=REPO_ROOT, env=env).returncode
    seconds = time.perf_counter() - start
    if returncode != 0:
        return {"name": name, "seconds": seconds, "error": f"exited with status {returncode}"}
    if not out.is_file():
        return {"name": name, "seconds": seconds, "error": f"exited 0 but wrote no {out}"}
    return {"name": name, "seconds": seconds, "result": json.loads(out.read_text())}


def summarise(outcomes: list[dict], quick: bool) -> BenchResult:
    """One row per target of every benchmark (PASS/MISS), one CRASH row per benchmark that failed."""
    summary = BenchResult(name=SUMMARY_NAME)
    for outcome in outcomes:
        name = outcome["name"]
        if "error" in outcome:
            summary.rows.append({"benchmark": name, "target": "-", "measured": "-", "want": "-", "verdict": "CRASH",
                                 "seconds": outcome["seconds"]})
            summary.notes.append(f"{name} crashed: {outcome['error']} (its output is above)")
            continue
        targets = outcome["result"].get("targets", {})
        if not targets:
            summary.rows.append({"benchmark": name, "target": "(none measured)", "measured": "-", "want": "-",
                                 "verdict": "-", "seconds": outcome["seconds"]})
        for target, t in targets.items():
            summary.rows.append({"benchmark": name, "target": target, "measured": t["measured"], "want": t["target"],
                                 "verdict": "PASS" if t["passed"] else "MISS", "seconds": outcome["seconds"]})
    passed = sum(r["verdict"] == "PASS" for r in summary.rows)
    judged = sum(r["verdict"] in ("PASS", "MISS") for r in summary.rows)
    summary.notes.append(f"{passed} of {judged} targets met; {len(outcomes)} benchmark(s), "
                         f"{'quick sizes (indicative only)' if quick else 'full sizes'}")
    summary.notes.append(f"load average (1/5/15 min) at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())} "
                         f"on {os.cpu_count()} CPUs")
    return summary


def run_all(names: list[str], quick: bool, out_dir: Path, package: str = "bench") -> tuple[BenchResult, list[str]]:
    """Run ``names`` in order; returns the summary (also written to out_dir/summary.json) and the crashed names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes = [run_benchmark(name, quick, out_dir, package) for name in names]
    summary = summarise(outcomes, quick)
    summary.write_json(out_dir / f"{SUMMARY_NAME}.json")
    return summary, [o["name"] for o in outcomes if "error" in o]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every benchmark (each in its own process) and summarise targets")
    parser.add_argument("--quick", action="store_true", help="small sizes for CI; ratios are indicative only")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=None, metavar="NAME",
                        help=f"run only these, in the given order (known: {', '.join(BENCHMARKS)})")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the JSON files go (default bench/results, with --quick bench/results/quick)")
    args = parser.parse_args(argv)
    args.out_dir = args.out_dir or results_dir(args.quick)
    summary, crashed = run_all(list(args.only or BENCHMARKS), args.quick, args.out_dir, PACKAGE)
    print("\n" + summary.table())
    print(f"wrote {args.out_dir / (SUMMARY_NAME + '.json')}")
    if crashed:
        print(f"crashed: {', '.join(crashed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
