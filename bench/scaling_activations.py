"""Activation memory of one actor forward + backward against response length and batch: padded and packed rows.

Run: ``python -m bench.scaling_activations [--quick]``. On CPU a CLI run's peak memory (``bench.scaling``)
is the process's peak RSS, whose start-up floor hides the tiny model's activations; this measures them
directly. Two sweeps of 16-prompt-token rows: response length T (64 -> 1024 at 8 sequences, every path)
and sequences (8 -> 128 at T = 64, the paths the workers run). Per point and path, a fresh process
builds the actor as the workers do (:func:`grpo_npu.workers.response_model.build_sharded`, gradient
checkpointing on, fp32, one thread), runs one forward + backward of the micro-batch as a warm-up, resets
the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``) and reports VmHWM - VmRSS over a
second one, with ``MALLOC_MMAP_THRESHOLD_`` set so that RSS follows live tensors (bench/logprob.py's
method). Each point is the best of :data:`REPEATS` processes (the point where a path's two sweeps meet is
measured once for both); ``--quick`` measures every point once, all in one process (indicative numbers, a
fraction of the start-up time).

Paths (:data:`PATHS`): padded rows; packed rows as the workers run them (``model.use_remove_padding``:
varlen attention, no mask); packed rows through transformers' SDPA with its block-diagonal (N, N) mask,
the behaviour before issue 20 item 5, for comparison. The memory exponent k of ``mem = a + b * x**k`` is
fitted per sweep and path (:func:`bench.scaling.fit_exponent`); the two paths the workers run are targets
(k <= 1.5) in both sweeps, the old one a note.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import BenchResult, bench_main, results_dir
from bench.scaling import MEMORY_EXPONENT_MAX, SWEEP_BATCH, SWEEP_LENGTH, fit_exponent, plot

LENGTHS = (64, 128, 256, 512, 1024)  # x2 steps at SWEEP_BATCH sequences: a point costs seconds, not a CLI run
BATCHES = (8, 16, 32, 64, 128)  # sequences, x2 steps at SWEEP_LENGTH response tokens
QUICK_LENGTHS, QUICK_BATCHES = (16, 32, 64), (2, 4, 8)
PROMPT = 16  # prompt tokens of every row
# path -> (packed inputs, the model built with use_remove_padding=True: varlen attention)
PATHS = {"padded": (False, False), "packed": (True, True), "packed, sdpa mask (before)": (True, False)}
TARGETS = ("padded", "packed")  # the paths the workers run; the old one is a note, not a target
REPEATS = 3  # fresh processes per point; the least memory and time are kept (a shared machine)
MMAP_THRESHOLD = 65536  # buffers >= 64 KiB get their own mmap, released on free: RSS follows live tensors
TIMEOUT_S = 1200.0


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def sweeps(quick: bool = False) -> list[tuple[str, str, str, list[tuple[int, int]]]]:
    """(sweep, x name, path, [(response length, sequences)]): the length sweep for every path, the batch sweep
    for the target paths."""
    lengths, batches = (QUICK_LENGTHS, QUICK_BATCHES) if quick else (LENGTHS, BATCHES)
    out = [(f"length, {path}", "response tokens T", path, [(t, SWEEP_BATCH) for t in lengths]) for path in PATHS]
    out += [(f"batch, {path}", "sequences", path, [(SWEEP_LENGTH, b) for b in batches]) for path in TARGETS]
    return out


def point(length: int, path: str, model: str | None = None, batch: int = SWEEP_BATCH) -> dict:
    """Extra peak RSS (MB) and seconds of one actor forward + backward of ``batch`` rows at response length
    ``length`` (fresh process; ``model``: a tiny-model directory, default the built-in tiny model)."""
    import gc
    import time

    import torch

    from grpo_npu.batch import RolloutBatch
    from grpo_npu.config import FSDPConfig
    from grpo_npu.device import get_device
    from grpo_npu.models.tiny import build_tiny_model
    from grpo_npu.workers import fsdp
    from grpo_npu.workers.model_inputs import build_inputs
    from grpo_npu.workers.response_model import CausalLMLogProbs, build_sharded

    packed, varlen = PATHS[path]
    torch.set_num_threads(1)
    dev = get_device("cpu")
    fsdp.init_distributed(dev, rank=0, world_size=1, master_addr="127.0.0.1", master_port=fsdp.free_port())
    module = build_sharded(CausalLMLogProbs, path=model or str(build_tiny_model()), override_config={},
                           trust_remote_code=False, fsdp_cfg=FSDPConfig(), dev=dev, compute_dtype=torch.float32,
                           trainable=True, gradient_checkpointing=True, fused_kernels=False, remove_padding=varlen)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1000, (batch, PROMPT), generator=gen)
    response = torch.randint(3, 1000, (batch, length), generator=gen)
    batch = RolloutBatch(prompt, torch.ones_like(prompt), response, torch.ones_like(response))

    def step() -> None:
        logp, _ = module(build_inputs(batch, packed), 1.0, False)
        logp.sum().backward()

    step()  # warm-up: gradients and one-time buffers exist before the measured pass
    gc.collect()  # an earlier point's models (several points in one process) are freed now, not mid-measurement
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    base_kib, start = _status_kib("VmRSS"), time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    fsdp.destroy_distributed()
    return {"peak_extra_mb": (_status_kib("VmHWM") - base_kib) / 1024, "seconds": seconds,
            "attn_implementation": module.hf.config._attn_implementation}


def _in_fresh_process(env: dict, specs: list[dict]) -> list[dict]:
    """:func:`point` for each spec, one after another in one new process."""
    out = subprocess.run([sys.executable, "-m", "bench.scaling_activations", "--point", json.dumps(specs)], env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S, check=True)
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(specs):]]


def run(quick: bool = False) -> BenchResult:
    """Activation memory of one actor forward + backward against response length and batch: padded and packed rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    result = BenchResult(name="scaling_activations")
    plan = sweeps(quick)
    # each distinct point once (the sweeps of a path meet at one): quick, all in one process; else REPEATS fresh ones
    specs = list(dict.fromkeys((length, path, batch) for _, _, path, points in plan for length, batch in points))
    as_dicts = [{"length": length, "path": path, "batch": batch} for length, path, batch in specs]
    if quick:
        measured = {spec: [m] for spec, m in zip(specs, _in_fresh_process(env, as_dicts))}
    else:
        measured = {spec: [_in_fresh_process(env, [d])[0] for _ in range(REPEATS)] for spec, d in zip(specs, as_dicts)}
    for sweep, x_name, path, points in plan:
        for length, batch in points:
            runs = measured[length, path, batch]
            x = length if sweep.startswith("length") else batch
            result.rows.append({"sweep": sweep, "x_name": x_name, "x": x,
                                "response_len": length, "sequences": batch, "tokens": batch * (PROMPT + length),
                                "attn_implementation": runs[0]["attn_implementation"],
                                "step_s": min(p["seconds"] for p in runs),
                                "peak_memory_gb": min(p["peak_extra_mb"] for p in runs) / 1024})
            print(result.rows[-1], flush=True)
    for sweep, x_name, path, _ in plan:
        pts = [r for r in result.rows if r["sweep"] == sweep]
        xs, mems = [r["x"] for r in pts], [r["peak_memory_gb"] for r in pts]
        k_mem = fit_exponent(xs, mems)
        result.notes.append(f"{sweep}: activation peak {mems[0] * 1024:.0f} -> {mems[-1] * 1024:.0f} MB, fitted "
                            f"a + b*x^{k_mem:.2f} ({xs[0]} -> {xs[-1]} {x_name})")
        if path in TARGETS:
            result.add_target(f"memory_exponent_{sweep.replace(', ', '_')}", k_mem, MEMORY_EXPONENT_MAX,
                              higher_is_better=False)
    png = results_dir(quick) / f"{result.name}.png"
    missing = plot(result.rows, png)
    result.notes.append(missing or f"plot: {png.name} (step_s = seconds of the measured forward + backward; memory "
                        "= peak RSS above the resting RSS)")
    measured_how = "every point once, in one process" if quick else f"best of {REPEATS} fresh processes per point"
    result.notes.append(f"tiny model, rows of {PROMPT} prompt + T response tokens: length sweep at {SWEEP_BATCH} "
                        f"sequences, batch sweep at T={SWEEP_LENGTH}; one micro-batch, gradient checkpointing, fp32, "
                        f"one thread; {measured_how}")
    if quick:
        result.notes.append("quick sizes: exponents are indicative only")
    return result


def main(argv: list[str] | None = None) -> BenchResult | None:
    parser = argparse.ArgumentParser(add_help=False)
    # a point (JSON object) or points (JSON list), measured in this process, one JSON line each
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.point is not None:
        specs = json.loads(ours.point)
        for spec in specs if isinstance(specs, list) else [specs]:
            print(json.dumps(point(**spec)), flush=True)
        return None
    return bench_main(run, rest)


if __name__ == "__main__":
    main()
