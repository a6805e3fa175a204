"""Shared plumbing for benchmarks: a uniform result shape, a printed table and a JSON file.

Each benchmark module ``bench/<name>.py`` exposes ``run(quick: bool = False) -> BenchResult`` and a
``main()`` built with :func:`bench_main`. Results are ratios measured side by side in one process,
never absolute timing thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from grpo_npu.perf.hardware import best_seconds as timeit  # noqa: F401  (the benchmarks' timer)

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # full-size results, committed (bench/report.py reads them)


def results_dir(quick: bool) -> Path:
    """Where results go by default: quick-size ones apart (git-ignored), so they never replace full ones."""
    return RESULTS_DIR / "quick" if quick else RESULTS_DIR


@dataclass
class BenchResult:
    """rows: one dict per measured configuration; targets: name -> (measured ratio, target, passed);
    meta: when and where it was measured (:func:`run_meta`), filled in by :func:`bench_main`."""

    name: str
    rows: list[dict] = field(default_factory=list)
    targets: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def add_target(self, name: str, measured: float, target: float, higher_is_better: bool = True) -> None:
        passed = measured >= target if higher_is_better else measured <= target
        op = ">=" if higher_is_better else "<="
        self.targets[name] = {"measured": measured, "target": f"{op} {target}", "passed": bool(passed)}

    def table(self) -> str:
        lines = [f"== {self.name} =="]
        if self.rows:
            cols = list(dict.fromkeys(k for row in self.rows for k in row))
            cells = [[_fmt(row.get(c, "")) for c in cols] for row in self.rows]
            widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
            lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
            lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
        for name, t in self.targets.items():
            verdict = "PASS" if t["passed"] else "MISS"
            lines.append(f"target {name}: {_fmt(t['measured'])} (want {t['target']}) {verdict}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def write_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, path)
        return path


def copy_seconds(named_tensors: Iterable[tuple[str, "torch.Tensor"]], repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds of an in-memory ``copy_`` of these tensors into preallocated ones: the floor of
    any weight sync that moves them (the benchmarks' sync targets are ratios to it)."""
    import torch

    items = list(named_tensors)
    copies = [torch.empty_like(t) for _, t in items]

    def copy_all() -> None:
        for dst, (_, src) in zip(copies, items):
            dst.copy_(src)

    return timeit(copy_all, repeat=repeat)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def run_meta(quick: bool) -> dict:
    """Date, machine, package versions, load average and the CPU's matmul speed and copy bandwidth at the end of a run.

    The speed (grpo_npu.perf.hardware's 2048^3 fp32 product, best of 3, this process's threads, timed anew) says what
    state a shared host was in: on this project's VM it has read from ~110 to ~220 GFLOP/s within an hour,
    and grpo_npu's matmul-bound steps move with it more than TRL's (docs/performance.md). The copy bandwidth
    (its 256 MiB copy, timed anew) has read from ~32 to ~48 GB/s within an hour there.
    """
    import datetime
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    machine = f"{cpu} ({os.cpu_count()} CPUs), torch {torch.__version__}"
    if torch.cuda.is_available():  # the accelerator a run may have used (bench code may name torch.cuda)
        machine = f"{torch.cuda.get_device_name(0)}, {machine}"
    from grpo_npu.perf.hardware import cpu_bandwidth_probe, measured_cpu_matmul_flops

    load = "load average " + "/".join(f"{x:.1f}" for x in os.getloadavg())
    speed = (f"{measured_cpu_matmul_flops.__wrapped__() / 1e9:.0f} GFLOP/s fp32 CPU matmul and "
             f"{cpu_bandwidth_probe() / 1e9:.0f} GB/s copy ({torch.get_num_threads()} threads)")
    return {"quick": quick, "measured_at": datetime.date.today().isoformat(), "machine": machine,
            "load": f"{load} and {speed} at the end"}


def bench_main(run: Callable[..., BenchResult], argv: list[str] | None = None,
               parents: Sequence[argparse.ArgumentParser] = ()) -> BenchResult:
    """--quick / --json, and a benchmark's own options (``parents``, parsed before) shown in the same --help."""
    parser = argparse.ArgumentParser(description=(run.__doc__ or "").strip().splitlines()[0] if run.__doc__ else None,
                                     parents=list(parents))
    parser.add_argument("--quick", action="store_true", help="small sizes for CI; ratios are indicative only")
    parser.add_argument("--json", default=None, help="where to write the JSON result (default bench/results/<name>.json; "
                                                      "with --quick bench/results/quick/<name>.json)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    result.meta = {**run_meta(args.quick), **result.meta}
    print(result.table())
    out = result.write_json(args.json or results_dir(args.quick) / f"{result.name}.json")
    print(f"wrote {out}")
    return result
