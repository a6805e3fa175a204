"""How a GRPO step's cost grows: step time and peak memory against response length and batch size.

Run: ``python -m bench.scaling [--quick] [--model tiny|0.5b] [--rollout hf|vllm] [--packed] [--device cpu|cuda|npu]``.
Each point is one ``python -m grpo_npu.main_ppo`` run (defaults plus the point's keys: fixed-length
responses, KL loss, gradient checkpointing, one micro-batch per step, so that the step's activations
grow with the batch), one warm-up step then one timed step; step seconds are the timed
``timing_s/step``, peak memory the run's ``perf/max_memory_allocated_gb`` (peak RSS on CPU).

Two sweeps: response length T at 8 sequences, and sequences at T = 64. ``--packed`` runs the length
sweep again with ``model.use_remove_padding=True`` (packed rows). Targets: each sweep's step-time
exponent (the end points' log-log slope, <= :data:`TIME_EXPONENT_MAX`). Each sweep's memory exponent k
(``mem = a + b * x**k``) is a note, not a target: the points run on CPU, where the peak is the process's
RSS, whose start-up floor sits above the tiny model's activations, so the fit sees a floor and a jump;
``bench.scaling_activations`` measures the activations' growth and holds the memory targets.
A PNG (matplotlib) plots both sweeps against an ideal linear line through the first point. The CPU
point sets keep the run short on a shared 2-core machine (:data:`TINY_POINTS`, :data:`POINTS_05B`);
the 0.5B shape stops at 256 tokens x 32 sequences there. ``--rederive`` recomputes a stored result's
targets and sweep notes from its rows without running anything (:func:`rederive`).
On an accelerator (``--device cuda|npu``, the product's default precision there) both models run the full
range (:data:`ACCEL_POINTS`) and the peak is the device's allocator peak, which holds the activations
without a process floor: there a sweep's memory exponent is a target too where every point raises the peak
(the 0.5B shape's optimizer step, not its activations, sets the peak at the small points).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

from bench.cli_run import least_cpu_s, measured_steps, run_cli
from bench.common import RESULTS_DIR, BenchResult, bench_main, results_dir

N = 4  # samples per prompt: a point of S sequences is S / N prompts
SWEEP_BATCH, SWEEP_LENGTH = 8, 64  # the fixed coordinate of each sweep
# (lengths at 8 sequences, sequence counts at T=64)
TINY_POINTS = ((64, 256, 1024), (8, 32, 128))  # the full range in x4 steps: 3 points a sweep keep CPU runs short
POINTS_05B = ((64, 128, 256), (8, 16, 32))
ACCEL_POINTS = ((64, 256, 1024), (8, 32, 128))  # the full range, both models, on a lent accelerator
QUICK_POINTS = ((16, SWEEP_LENGTH), (4, SWEEP_BATCH))  # 3 CLI runs: the sweeps share (SWEEP_LENGTH, SWEEP_BATCH)
FLAT_FRACTION = 0.02  # memory that moves less than this over a sweep is flat (exponent 0): the fit would be noise
MEMORY_EXPONENT_MAX = 1.5  # above this a sweep's memory grows faster than linearly: reported as a miss
TIME_EXPONENT_MAX = 1.5  # above this a sweep's step time (end points' log-log slope) grows faster than linearly
TIMEOUT_S = 1200.0


def point_keys(model: str, train: str, length: int, seqs: int, rollout: str, packed: bool,
               device: str = "cpu") -> list[str]:
    prompts = max(1, seqs // N)
    n = seqs // prompts
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.train_batch_size={prompts}",
        f"data.max_response_length={length}", f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={seqs}",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.rollout.name={rollout}", f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.ignore_eos=True", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"trainer.device={device}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_training_steps=2",
        "trainer.val_before_train=False",
    ] + (["actor_rollout_ref.model.use_remove_padding=True"] if packed else [])


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """k of the least-squares fit ``y = a + b * x**k`` (k on a 0.01 grid in [0.25, 3]); 0 when y is flat."""
    import numpy as np

    if max(ys) - min(ys) < FLAT_FRACTION * min(ys):
        return 0.0

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    best = (math.inf, float("nan"))
    for k in np.arange(0.25, 3.0001, 0.01):
        design = np.stack([np.ones_like(x), x**k], 1)
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        if coef[1] <= 0:
            continue
        err = float(((design @ coef - y) ** 2).sum())
        best = min(best, (err, float(k)))
    return best[1]


def plot(rows: list[dict], path: Path) -> str | None:
    """Step time and memory per sweep, with the ideal linear line through each sweep's first point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    sweeps = list(dict.fromkeys(r["sweep"] for r in rows))
    fig, axes = plt.subplots(2, len(sweeps), figsize=(5 * len(sweeps), 8), squeeze=False)
    for col, sweep in enumerate(sweeps):
        pts = [r for r in rows if r["sweep"] == sweep]
        xs = [r["x"] for r in pts]
        for row, (key, unit) in enumerate((("step_s", "s/step"), ("peak_memory_gb", "peak memory (GB)"))):
            ax = axes[row][col]
            ys = [r[key] for r in pts]
            ax.plot(xs, ys, "o-", label="measured")
            if key == "peak_memory_gb" and len(xs) > 1:  # the first two points' slope, kept (fixed footprint + linear)
                slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
                ax.plot(xs, [ys[0] + slope * (x - xs[0]) for x in xs], "--", label="ideal linear")
            else:
                ax.plot(xs, [ys[0] * x / xs[0] for x in xs], "--", label="ideal linear")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log" if key == "step_s" else "linear")
            ax.set_xlabel(pts[0]["x_name"])
            ax.set_ylabel(unit)
            ax.set_title(sweep)
            ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return None


def summarise(result: BenchResult) -> None:
    """Per sweep of ``result.rows``: a note with the peak memory and its fitted exponent, and the step-time
    exponent as a target. On CPU the memory exponent is no target: the peak is the process's RSS, whose
    start-up floor sits above the tiny model's activations (the fit sees the floor, then a jump);
    ``bench.scaling_activations`` measures the activations' growth. On an accelerator (``meta["device"]``)
    the peak is the allocator's, and the memory exponent is a target where every point raises it (a model
    whose optimizer step peaks above its activations shows that floor first, then a jump)."""
    accel = result.meta.get("device", "cpu") != "cpu"
    for sweep in dict.fromkeys(r["sweep"] for r in result.rows):
        pts = [r for r in result.rows if r["sweep"] == sweep]
        xs, mems = [r["x"] for r in pts], [r["peak_memory_gb"] for r in pts]
        k_mem = fit_exponent(xs, mems)
        k_time = math.log(pts[-1]["step_s"] / pts[0]["step_s"]) / math.log(xs[-1] / xs[0])
        rising = all(b - a > FLAT_FRACTION * a for a, b in zip(mems, mems[1:]))  # activations above any floor
        if not accel:
            why = "not a target: the CPU peak RSS has a start-up floor, bench.scaling_activations measures the activations"
        elif rising:
            why = "the device allocator's peak, rising at every point: a target"
        else:
            why = ("not a target: the device peak sits on a floor (the optimizer step's weights, gradients and states) "
                   "at some points, so the fit sees the floor, then a jump")
        result.notes.append(f"{sweep}: peak memory {mems[0]:.3f} -> {mems[-1]:.3f} GB, fitted a + b*x^{k_mem:.2f} "
                            f"(0 = flat: under {FLAT_FRACTION:.0%} change; {why}); step time grew "
                            f"x^{k_time:.2f} overall ({xs[0]} -> {xs[-1]})")
        name = sweep.replace(", ", "_")
        result.add_target(f"step_time_exponent_{name}", k_time, TIME_EXPONENT_MAX, higher_is_better=False)
        if accel and rising:
            result.add_target(f"memory_exponent_{name}", k_mem, MEMORY_EXPONENT_MAX, higher_is_better=False)


def rederive(path: Path) -> BenchResult:
    """A stored result with its targets and per-sweep notes computed again from its rows (rows, meta and the
    other notes kept): ``python -m bench.scaling --rederive [PATH]``, which also redraws PATH's plot."""
    import json

    result = BenchResult(**json.loads(path.read_text()))
    kept = [n for n in result.notes if not any(n.startswith(f"{r['sweep']}: ") for r in result.rows)]
    result.targets, result.notes = {}, []
    summarise(result)
    result.notes += kept
    return result


def measure_point(keys: list[str], root: Path, sweep: str, x_name: str, length: int, seqs: int,
                  threads: int) -> dict:
    """One CLI run of a point (a work directory under ``root``): its row, the best timed step's figures."""
    tag = f"{sweep.replace(', ', '_')}_{length}x{seqs}"
    measured = measured_steps(run_cli(keys, root / tag, threads, TIMEOUT_S, f"scaling-{tag}"), seqs)
    return {"sweep": sweep, "x_name": x_name, "x": length if sweep != "batch" else seqs,
            "response_len": length, "sequences": seqs, "step_s": min(measured["step_s"]),
            "cpu_s": least_cpu_s(measured["cpu_s"]),
            "update_s": min(s["update"] for s in measured["sections"]),
            "gen_s": min(s["gen"] for s in measured["sections"]),
            "peak_memory_gb": measured["peak_memory_gb"]}


def run(quick: bool = False, model: str = "tiny", rollout: str = "hf", packed: bool = False,
        png: Path | None = None, threads: int = 2, device: str = "cpu") -> BenchResult:
    """Step time and peak memory against response length and batch size (grpo_npu's CLI)."""
    from grpo_npu.data.synthetic import write_synthetic
    from grpo_npu.models.tiny import QWEN2_5_0_5B_SHAPE, TINY, build_tiny_model

    if quick:
        lengths, batches = QUICK_POINTS
    elif device != "cpu":
        lengths, batches = ACCEL_POINTS
    else:
        lengths, batches = POINTS_05B if model == "0.5b" else TINY_POINTS
    path = str(build_tiny_model(spec=QWEN2_5_0_5B_SHAPE if model == "0.5b" else TINY))
    sweeps = [("length", "response tokens T", [(t, SWEEP_BATCH, False) for t in lengths])]
    if packed:
        sweeps.append(("length, packed", "response tokens T", [(t, SWEEP_BATCH, True) for t in lengths]))
    sweeps.append(("batch", "sequences", [(SWEEP_LENGTH, s, False) for s in batches]))
    name = "scaling" if model == "tiny" else f"scaling_{model}"
    result = BenchResult(name=name if device == "cpu" else f"{name}_{device}", meta={"device": device})
    root = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    try:
        train = write_synthetic(str(root / "data"), train_size=max(batches) // N, test_size=1, write_sft=False)
        done: dict[tuple[int, int, bool], dict] = {}  # a point both sweeps pass through runs once
        for sweep, x_name, points in sweeps:
            for length, seqs, pack in points:
                if (length, seqs, pack) in done:
                    row = {**done[length, seqs, pack], "sweep": sweep, "x_name": x_name,
                           "x": length if sweep != "batch" else seqs}
                else:
                    keys = point_keys(path, str(train["train"]), length, seqs, rollout, pack, device)
                    row = done[length, seqs, pack] = measure_point(keys, root, sweep, x_name, length, seqs, threads)
                result.rows.append(row)
                print(row, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summarise(result)
    png = png or results_dir(quick) / f"{result.name}.png"  # a --quick run never overwrites the committed plot
    missing = plot(result.rows, png)
    result.notes.append(missing or f"plot: {png.name} (dashed: ideal linear through the first point)")
    result.notes.append(f"model {model}, rollout {rollout}, {N} samples per prompt, one micro-batch per step, "
                        f"fixed-length responses, {threads} thread(s); length sweep at {SWEEP_BATCH} sequences, batch sweep "
                        f"at T={SWEEP_LENGTH} (the point they share is run once); points {lengths} / {batches}"
                        + (" chosen to keep a CPU run short" if device == "cpu" else f", device {device}"))
    if quick:
        result.notes.append("quick sizes: exponents are indicative only")
    return result


def main(argv: list[str] | None = None) -> BenchResult:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default="tiny", choices=("tiny", "0.5b"), help="the model shape of every point")
    parser.add_argument("--rollout", default="hf", choices=("hf", "vllm"), help="actor_rollout_ref.rollout.name")
    parser.add_argument("--packed", action="store_true", help="also the length sweep with use_remove_padding=True")
    parser.add_argument("--png", type=Path, default=None, help="where to draw the plot (default bench/results/<name>.png; with --quick bench/results/quick/)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"),
                        help="trainer.device of every point (accelerators: the full range for both models)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run (default 2)")
    parser.add_argument("--rederive", type=Path, nargs="?", const=RESULTS_DIR / "scaling.json", default=None,
                        help="recompute a stored result's targets and sweep notes from its rows, run nothing")
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.rederive is not None:
        result = rederive(ours.rederive)
        missing = plot(result.rows, ours.rederive.with_suffix(".png"))  # the plot is derived from the rows too
        if missing:
            print(missing)
        print(result.table())
        print(f"wrote {result.write_json(ours.rederive)}")
        return result

    def configured(quick: bool = False) -> BenchResult:
        """Step time and peak memory against response length and batch size."""
        return run(quick=quick, model=ours.model, rollout=ours.rollout, packed=ours.packed, png=ours.png,
                   threads=ours.threads, device=ours.device)

    return bench_main(configured, rest, parents=[parser])


if __name__ == "__main__":
    main()
