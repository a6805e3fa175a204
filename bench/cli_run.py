"""grpo_npu as a user runs it: ``python -m grpo_npu.main_ppo key=value ...`` in a subprocess, read back.

The step benchmarks drive the product through its public command line: the defaults a user gets, plus
only the keys that define the workload (model, data, batch sizes, KL loss, rollout engine, where the run
goes). Step times come from the run's own ``metrics.jsonl`` (``timing_s/step``), the first step dropped
as warm-up; nothing in the trainer is patched or subclassed.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# grpo_npu's timed sections between generation and the update (TRL does these inside its generate-and-score).
SCORE_SECTIONS = ("reward", "old_log_prob", "ref", "adv")


def run_cli(keys: list[str], run_dir: Path, threads: int, timeout_s: float, log_name: str) -> dict:
    """Run ``python -m grpo_npu.main_ppo *keys`` (trainer.default_local_dir=run_dir); its metrics rows.

    ``threads`` goes to OMP_NUM_THREADS, as a user pins a run's cores. Raises with the log's tail on a
    non-zero exit or past ``timeout_s``.
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "grpo_npu.main_ppo", *keys, f"trainer.default_local_dir={run_dir}"]
    log = Path(tempfile.gettempdir()) / f"bench-{log_name}.log"  # outlives the work directory
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    metrics = run_dir / "metrics.jsonl"
    if returncode != 0 or not metrics.is_file():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-25:])
        raise RuntimeError(f"grpo_npu.main_ppo ({log_name}) failed ({returncode}); full output in {log}; "
                           f"last lines:\n{tail}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"rows": [r for r in rows if "timing_s/step" in r], "process_s": wall,
            "process_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), "log": str(log)}


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
        "process_s": run["process_s"], "process_cpu_s": run["process_cpu_s"],
    }
