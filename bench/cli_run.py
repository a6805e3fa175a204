"""grpo_npu as a user runs it: ``python -m grpo_npu.main_ppo key=value ...`` in a subprocess, read back.

The step benchmarks drive the product through its public command line: the defaults a user gets, plus
only the keys that define the workload (model, data, batch sizes, KL loss, rollout engine, where the run
goes). Step times come from the run's own ``metrics.jsonl`` (``timing_s/step``), the first step dropped
as warm-up; nothing in the trainer is patched or subclassed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# grpo_npu's timed sections between generation and the update (TRL does these inside its generate-and-score).
SCORE_SECTIONS = ("reward", "old_log_prob", "ref", "adv")


# Rendezvous variables of a process group this process may hold (the eos workload's SFT warm start runs in
# the parent): a child that inherited them would try to listen on the parent's MASTER_PORT.
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def child_env(threads: int, *paths: str | None) -> dict:
    """A benchmark side's environment: ours less any process-group rendezvous, ``threads`` OpenMP threads,
    the repo (and ``paths``) importable."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), *paths, os.environ.get("PYTHONPATH")])))
    return env


def run_cli(keys: list[str], run_dir: Path, threads: int, timeout_s: float, log_name: str) -> dict:
    """Run ``python -m grpo_npu.main_ppo *keys`` (trainer.default_local_dir=run_dir); its metrics rows.

    ``threads`` goes to OMP_NUM_THREADS, as a user pins a run's cores. Raises with the log's tail on a
    non-zero exit or past ``timeout_s``.
    """
    env = child_env(threads)
    cmd = [sys.executable, "-m", "grpo_npu.main_ppo", *keys, f"trainer.default_local_dir={run_dir}"]
    log = Path(tempfile.gettempdir()) / f"bench-{log_name}.log"  # outlives the work directory
    start = time.perf_counter()
    metrics = run_dir / "metrics.jsonl"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        cpu_at_line = _watch(proc, metrics, timeout_s)
    wall = time.perf_counter() - start
    returncode = proc.returncode
    if returncode != 0 or not metrics.is_file():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-25:])
        raise RuntimeError(f"grpo_npu.main_ppo ({log_name}) failed ({returncode}); full output in {log}; "
                           f"last lines:\n{tail}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [i for i, r in enumerate(rows) if "timing_s/step" in r]
    # a step's CPU seconds: its process tree's, from the line before its metrics line appearing to its own
    cpu_s = [cpu_at_line[i + 1] - cpu_at_line[i] if {i, i + 1} <= cpu_at_line.keys() else None for i in steps]
    return {"rows": [rows[i] for i in steps], "cpu_s": cpu_s, "process_s": wall, "log": str(log)}


def _watch(proc: subprocess.Popen, metrics: Path, timeout_s: float, every_s: float = 0.1) -> dict[int, float]:
    """Wait for ``proc``; returns {lines in metrics.jsonl: CPU seconds of its process tree when they appeared}.

    On a shared machine wall time counts other processes' load; CPU time per step does much less so.
    """
    import psutil

    root, seen, deadline = psutil.Process(proc.pid), {0: 0.0}, time.monotonic() + timeout_s
    total = 0.0
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"grpo_npu.main_ppo ran past {timeout_s:.0f} s and was stopped")
        try:
            total = sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])
        except psutil.Error:  # a child ended between the listing and the reading
            pass
        lines = metrics.read_bytes().count(b"\n") if metrics.is_file() else 0
        if lines not in seen:
            seen[lines] = total
        time.sleep(every_s)
    return seen


LIMIT_PREFIXES = ("perf/mfu/", "perf/limit_frac/")


def least_cpu_s(cpu_s: list) -> float:
    """The least CPU seconds of the timed steps; nan when none has a figure (a step shorter than the CPU
    sampler's period gets None from :func:`run_cli`)."""
    return min((c for c in cpu_s if c is not None), default=float("nan"))


def measured_steps(run: dict, samples: int) -> dict:
    """Per timed step (the first, warm-up, step dropped): seconds, sections, tokens, memory."""
    steps = run["rows"][1:]
    if not steps:
        raise RuntimeError(f"the run logged {len(run['rows'])} step(s): no timed step after the warm-up")
    sections = []
    for r in steps:
        gen, update = r["timing_s/gen"], r["timing_s/update_actor"]
        score = sum(r.get(f"timing_s/{k}", 0.0) for k in SCORE_SECTIONS)
        sections.append({"gen": gen, "score": score, "update": update,
                         "other": r["timing_s/step"] - gen - score - update})
    return {
        "step_s": [r["timing_s/step"] for r in steps],
        "sections": sections,
        "tokens": [r["perf/total_num_tokens"] for r in steps],
        "response_tokens": [r["response_length/mean"] * samples for r in steps],
        # on CPU the process's peak RSS (device.py's memory stats), on an accelerator the device's peak
        "peak_memory_gb": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in run["rows"]),
        "cpu_s": run["cpu_s"][1:], "process_s": run["process_s"],
        # the product's own limit metrics per timed step (perf/mfu/*, perf/limit_frac/*: grpo_npu.perf.report)
        "limits": [{k: v for k, v in r.items() if k.startswith(LIMIT_PREFIXES)} for r in steps],
    }
