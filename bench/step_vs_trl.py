"""End-to-end GRPO step: grpo_npu's public command line against TRL's ``GRPOTrainer`` on the same work.

Run: ``python -m bench.step_vs_trl [--quick] [--workloads fixed eos] [--model 3m|0.5b] [--threads N]
[--trl-path DIR] [--override KEY=VALUE ...]``.
Targets (CPU, issue 20): grpo_npu >= 1.5x TRL's steps/s with ``rollout.name=vllm`` and >= 1.2x with
``rollout.name=hf`` (transformers generation, like TRL's), on each workload.

grpo_npu runs as a user runs it: ``python -m grpo_npu.main_ppo`` in a subprocess with its defaults plus only
the workload's keys (:func:`workload_keys`); step seconds are the run's own ``timing_s/step`` from its
``metrics.jsonl``. Nothing is tuned for the benchmark: a setting that makes grpo_npu faster belongs in its
defaults. ``--override`` adds grpo_npu keys on top, and the rows then say so.

Workloads, identical on both sides (16 prompts x 4 samples, <= 64 new tokens, micro-batches of 16, one
optimizer step per generation batch, low_var_kl KL loss against a reference model, gradient checkpointing,
fp32 on CPU and bf16 compute on an accelerator (grpo_npu's defaults; TRL ``bf16=True``; grpo_npu's vLLM engine
in ``rollout.dtype=auto``'s dtype, bf16 on a CPU with bf16 dot products), 2 threads, the
gsm8k reward on the synthetic arithmetic task):
- ``fixed``: a 3M-parameter random Qwen2 built here (:data:`BENCH_3M`), every response exactly 64 tokens
  (grpo_npu ``rollout.ignore_eos=True``; TRL ``min_new_tokens``);
- ``eos``: the default job's SFT-warm-started tiny model (:mod:`grpo_npu.default_job`), which answers and
  stops: responses end at EOS on both sides, so each side's response tokens per step are reported.
TRL gets grpo_npu's defaults for what the workload leaves open (:mod:`bench.trl_side`). Each side runs in a
fresh process, one warm-up step then N timed steps. A run is ``rounds`` rounds (3 by default); a round runs
every side once, one after the other, the order rotated from round to round. A side's row shows its fastest
timed step of the whole run (the least disturbed by other processes on a shared machine), the median
beside it. The ratio to TRL that meets or misses a target is the median over rounds of each round's own
ratio (fastest step against fastest step, both measured within minutes of each other): a shared host's
speed drifts over minutes (fp32 matmul 110-220 GFLOP/s within an hour here), and a ratio between sides run
far apart measures that drift as much as the trainers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.cli_run import REPO_ROOT, child_env, least_cpu_s, measured_steps, run_cli
from bench.common import BenchResult, bench_main

SIDES = ("grpo_npu_hf", "trl", "grpo_npu_vllm")
LABELS = {"grpo_npu_hf": "grpo_npu (rollout=hf)", "trl": "TRL GRPOTrainer", "grpo_npu_vllm": "grpo_npu (rollout=vllm)"}
TARGET_SPEEDUP = {"grpo_npu_vllm": 1.5, "grpo_npu_hf": 1.2}  # issue 20, CPU, public CLI
# issue 20 item 4: the transformers rollout's generation beats TRL's; per response token, as eos answers differ
TARGET_HF_GENERATION = 1.0
MODELS = ("3m", "tiny-sft", "0.5b")
SIDE_TIMEOUT_S = 1800.0  # one side's process, start to end
TRL_PATH_ENV = "BENCH_TRL_PATH"  # a folder holding trl (pip install --target), for TRL's process only


@dataclass(frozen=True)
class Workload:
    """One GRPO step's work; every size is shared by both trainers."""

    name: str  # "fixed" | "eos"
    model: str  # "3m" | "tiny-sft" | "0.5b"
    prompts: int = 16  # B prompts per step
    n: int = 4  # samples per prompt
    response_len: int = 64  # at most T new tokens per sample (exactly T unless natural_eos)
    micro_batch: int = 16  # samples per forward/backward
    timed_steps: int = 3  # after one warm-up step
    rounds: int = 3  # every side once per round, the order rotated; the target ratio is the median over rounds
    threads: int = 2
    natural_eos: bool = False
    device: str = "cpu"
    seed: int = 0
    overrides: tuple[str, ...] = ()  # extra key=value for grpo_npu's sides only (applied last)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}; known: {list(MODELS)}")
        if (self.prompts * self.n) % self.micro_batch:
            raise ValueError(f"prompts x n = {self.prompts} x {self.n} is not a multiple of "
                             f"micro_batch={self.micro_batch}")
        if self.timed_steps < 1 or self.rounds < 1 or self.threads < 1:
            raise ValueError("timed_steps, rounds and threads must be >= 1")
        bad = [o for o in self.overrides if "=" not in o]
        if bad:
            raise ValueError(f"--override {bad[0]!r}: expected key=value (a grpo_npu config key)")


FIXED = Workload("fixed", "3m")
EOS = Workload("eos", "tiny-sft", natural_eos=True)
WORKLOADS = {w.name: w for w in (FIXED, EOS)}
QUICK = Workload("fixed", "3m", prompts=2, n=4, response_len=16, micro_batch=8, timed_steps=2, rounds=1)
SIZE_FIELDS = ("prompts", "n", "response_len", "micro_batch", "timed_steps", "rounds", "threads")  # settable from the CLI


def bench_3m_spec():
    """The fixed workload's model: a 3.0M-parameter random Qwen2 with the tiny kit's tokenizer."""
    from grpo_npu.models.tiny import TinySpec

    return TinySpec(name="bench-qwen2-3m", hidden_size=256, intermediate_size=640, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2)


# ------------------------------------------------------------------------------------------------
# Shared inputs: model, prompts
# ------------------------------------------------------------------------------------------------
def prepare_inputs(work: Workload, root: Path) -> dict:
    """Write the model path and the B-prompt parquet (one epoch = one step); the same files feed both sides."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from grpo_npu.data.parquet import write_parquet_atomic
    from grpo_npu.data.synthetic import write_synthetic
    from grpo_npu.models.tiny import QWEN2_5_0_5B_SHAPE, build_tiny_model

    train = root / "data" / "train.parquet"
    if work.model == "tiny-sft":
        from grpo_npu import default_job

        keys = dict(k.split("=", 1) for k in default_job.prepare(rollout="hf"))  # SFT on first use (~1 min)
        model = keys["actor_rollout_ref.model.path"]
        rows = pq.read_table(keys["data.train_files"]).to_pylist()[: work.prompts]
        write_parquet_atomic(rows, train)
    else:
        model = build_tiny_model(spec=bench_3m_spec() if work.model == "3m" else QWEN2_5_0_5B_SHAPE)
        write_synthetic(str(train.parent), train_size=work.prompts, test_size=1, seed=work.seed, write_sft=False)
        rows = pq.read_table(train).to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = tokenizer.apply_chat_template([r["prompt"] for r in rows], add_generation_prompt=True, tokenize=False)
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return {"model": str(model), "train": str(train), "prompt_tokens": sum(lengths)}


# ------------------------------------------------------------------------------------------------
# grpo_npu: the public command line
# ------------------------------------------------------------------------------------------------
def workload_keys(work: Workload, inputs: dict, rollout: str) -> list[str]:
    """The only keys grpo_npu's command line gets: what defines the workload; everything else is a default."""
    keys = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={inputs['train']}", f"data.train_batch_size={work.prompts}",
        f"data.max_response_length={work.response_len}",
        f"actor_rollout_ref.model.path={inputs['model']}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={work.prompts}",  # one optimizer step per batch, as TRL
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={work.micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.rollout.name={rollout}", f"actor_rollout_ref.rollout.n={work.n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"trainer.device={work.device}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={1 + work.timed_steps}", "trainer.val_before_train=False",
    ]
    if not work.natural_eos:
        keys.append("actor_rollout_ref.rollout.ignore_eos=True")
    return keys + list(work.overrides)


def run_grpo_npu(work: Workload, inputs: dict, rollout: str, root: Path) -> dict:
    keys = workload_keys(work, inputs, rollout)
    run = run_cli(keys, root / f"run_{work.name}_{rollout}", work.threads, SIDE_TIMEOUT_S,
                  f"step_vs_trl-{work.name}-{rollout}")
    measured = measured_steps(run, work.prompts * work.n)
    measured["threads"] = work.threads
    return measured


# ------------------------------------------------------------------------------------------------
# TRL: bench/trl_side.py in its own process
# ------------------------------------------------------------------------------------------------
def missing_dependency(side: str, trl_path: str | None = None) -> str | None:
    """Why ``side`` cannot run here (an optional package is absent), or None."""
    import importlib.util

    if side == "trl" and trl_path:
        return None if (Path(trl_path) / "trl" / "__init__.py").is_file() else f"no trl package in {trl_path}"
    needs = {"trl": ("trl", "pip install -e '.[bench]'"), "grpo_npu_vllm": ("vllm", "pip install -e '.[vllm]'")}
    if side in needs and importlib.util.find_spec(needs[side][0]) is None:
        return f"{needs[side][0]} is not installed ({needs[side][1]})"
    return None


def run_trl(work: Workload, inputs: dict, root: Path, trl_path: str | None) -> dict:
    """TRL's side in a fresh process, with grpo_npu's process environment (what main_ppo sets on this device)."""
    from grpo_npu.env import apply_process_env_defaults, cpu_malloc_defaults

    out = root / f"trl_{work.name}"
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(work.threads, trl_path)
    apply_process_env_defaults(env)
    if work.device == "cpu":
        cpu_malloc_defaults(env)
    cmd = [sys.executable, "-m", "bench.trl_side", "--work", json.dumps(asdict(work)), "--inputs", json.dumps(inputs),
           "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=SIDE_TIMEOUT_S)
    result = out / "side.json"
    if proc.returncode != 0 or not result.exists():
        log = Path(tempfile.gettempdir()) / f"bench-step_vs_trl-{work.name}-trl.log"
        log.write_text(proc.stdout + proc.stderr)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"TRL side failed (exit {proc.returncode}); full output in {log}; last lines:\n{tail}")
    measured = json.loads(result.read_text())
    measured["process_s"] = time.perf_counter() - start
    return measured


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------
def summarise(work: Workload, side: str, rounds: list[dict]) -> dict:
    """One table row from a side's rounds (one measured run each): the fastest timed step of them all, its
    throughput and where its time went; ``step_s_all`` lists every timed step, rounds apart by `` | ``."""
    measured = {key: [x for one in rounds for x in one[key]] for key in ("step_s", "sections", "tokens",
                                                                          "response_tokens", "cpu_s")}
    best = min(range(len(measured["step_s"])), key=lambda i: measured["step_s"][i])
    step_s, sections = measured["step_s"][best], measured["sections"][best]
    tokens, response = measured["tokens"][best], measured["response_tokens"][best]
    label = LABELS[side] + (" + overrides" if work.overrides and side != "trl" else "")
    row = {
        "workload": work.name, "side": label, "step_s": step_s, "step_s_median": statistics.median(measured["step_s"]),
        "steps_per_s": 1.0 / step_s, "tokens_per_s": tokens / step_s, "response_tokens_per_s": response / step_s,
        "tokens_per_step": tokens, "response_tokens_per_step": response, "prompt_tokens_per_step": tokens - response,
        "gen_s": sections["gen"], "score_s": sections["score"], "update_s": sections["update"],
        "other_s": sections["other"],
        "step_s_all": " | ".join("/".join(f"{s:.3g}" for s in one["step_s"]) for one in rounds),
        "cpu_s": least_cpu_s(measured["cpu_s"]),
        "threads": rounds[0]["threads"], "process_s": max(one["process_s"] for one in rounds),
    }
    peaks = [one["peak_memory_gb"] for one in rounds if "peak_memory_gb" in one]
    if peaks:
        row["peak_memory_gb"] = max(peaks)
    limits = [x for one in rounds for x in one.get("limits", [{}] * len(one["step_s"]))]
    row.update(limits[best])  # that step's perf/mfu/*, perf/limit_frac/*
    return row


def run(quick: bool = False, workloads: tuple[str, ...] = ("fixed", "eos"), model: str | None = None,
        device: str = "cpu", sides: tuple[str, ...] = SIDES, overrides: tuple[str, ...] = (),
        trl_path: str | None = None, **sizes) -> BenchResult:
    """End-to-end GRPO step: grpo_npu's CLI vs TRL on the same workloads; ``sizes`` override Workload fields."""
    from grpo_npu.device import resolve_kind

    unknown = (set(sides) - set(SIDES)) | (set(workloads) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"unknown {sorted(unknown)}; sides: {list(SIDES)}, workloads: {list(WORKLOADS)}")
    bases = [QUICK] if quick else [WORKLOADS[name] for name in workloads]
    trl_path = trl_path or os.environ.get(TRL_PATH_ENV) or None
    works = [replace(base, device=resolve_kind(device), overrides=tuple(overrides),
                     **({"model": model} if model and base.name == "fixed" else {}),
                     **{k: v for k, v in sizes.items() if v is not None}) for base in bases]
    result = BenchResult(name="step_vs_trl")
    skipped = {side: why for side in sides if (why := missing_dependency(side, trl_path))}
    active = [s for s in sides if s not in skipped]
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-step-vs-trl-"))
    try:
        for work in works:
            inputs = prepare_inputs(work, root / work.name)
            rounds = []  # per round: {side: measured}
            for number in range(work.rounds):
                here = root / work.name / f"round{number}"
                rounds.append({side: run_trl(work, inputs, here, trl_path) if side == "trl" else
                               run_grpo_npu(work, inputs, side.removeprefix("grpo_npu_"), here)
                               for side in rotated(active, number)})
            rows = {side: summarise(work, side, [one[side] for one in rounds]) for side in active}
            result.rows += list(rows.values())
            check_workload(result, work, inputs, rows,
                           [{side: summarise(work, side, [one[side]]) for side in one} for one in rounds])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result.notes += [f"{side} not run: {why}" for side, why in skipped.items()]
    result.notes += describe(works, trl_path, load_before, os.getloadavg(), quick)
    return result


def rotated(sides: list[str], number: int) -> list[str]:
    """Round ``number``'s order: ``sides`` rotated left by ``number``, so no side always runs first."""
    shift = number % len(sides) if sides else 0
    return sides[shift:] + sides[:shift]


def check_workload(result: BenchResult, work: Workload, inputs: dict, rows: dict,
                   rounds: list[dict] | None = None) -> None:
    """Same prompts (and, at fixed length, same response tokens) on every side; then the ratios to TRL.

    ``rows``: each side's row over the whole run; ``rounds``: each round's rows (default: one round, ``rows``).
    The target's ratio is the median over rounds of each round's fastest-step ratio.
    """
    rounds = rounds or [rows]
    expected = {"prompt_tokens_per_step": inputs["prompt_tokens"] * work.n}
    if not work.natural_eos:
        expected["response_tokens_per_step"] = work.prompts * work.n * work.response_len
    for side, row in rows.items():
        for key, want in expected.items():
            if row[key] != want:  # the comparison is void: say so loudly, next to the numbers
                result.notes.append(f"WORKLOAD MISMATCH: {work.name}/{side} counted {row[key]} {key}, expected {want}")
    if "trl" in rows:
        for side, target in TARGET_SPEEDUP.items():
            if side in rows:
                per_round = [one[side]["steps_per_s"] / one["trl"]["steps_per_s"] for one in rounds]
                result.add_target(target_name(work, side), statistics.median(per_round), target)
                overall = rows[side]["steps_per_s"] / rows["trl"]["steps_per_s"]
                cpu_ratio = rows["trl"]["cpu_s"] / rows[side]["cpu_s"]
                result.notes.append(
                    f"{work.name}: {LABELS[side]} vs TRL, each round's fastest steps: "
                    f"{'/'.join(f'{r:.2f}' for r in per_round)}x (median {statistics.median(per_round):.2f}x, "
                    f"the target's); the whole run's fastest steps: {overall:.2f}x in wall time, "
                    f"{cpu_ratio:.2f}x in CPU seconds (TRL's / ours)")
    if {"trl", "grpo_npu_hf"} <= rows.keys():
        per_round = [gen_per_token(one["trl"]) / gen_per_token(one["grpo_npu_hf"]) for one in rounds]
        result.add_target(f"{work.name}_grpo_npu_hf_vs_trl_generation_per_token", statistics.median(per_round),
                          TARGET_HF_GENERATION)
        result.notes.append(
            f"{work.name}: the transformers rollout's generation vs TRL's, seconds per response token in each round's "
            f"fastest step (TRL's / ours): {'/'.join(f'{r:.2f}' for r in per_round)}x (median, the target's)")


def gen_per_token(row: dict) -> float:
    """A row's generation seconds per response token (its fastest step's)."""
    return row["gen_s"] / row["response_tokens_per_step"]


def target_name(work: Workload, side: str) -> str:
    return f"{work.name}_{side}_vs_trl_steps_per_s"


def precision(work: Workload) -> str:
    """The workload's arithmetic on both sides: grpo_npu's default for the device, which TRL is given too."""
    if work.device == "cpu":
        from grpo_npu.device import Device

        engine = str(Device("cpu").engine_dtype("auto")).removeprefix("torch.")
        return (f"fp32 training; grpo_npu's vLLM engine generates in {engine} (rollout.dtype=auto on this CPU), "
                "its transformers rollout and TRL with the fp32 model")
    return "bf16 compute with fp32 master weights (grpo_npu's default mixed precision; TRL bf16=True)"


def describe(works: list[Workload], trl_path: str | None, load_before, load_after, quick: bool) -> list[str]:
    from grpo_npu.env import CPU_MALLOC_ENV, PROCESS_ENV_DEFAULTS

    notes = []
    for w in works:
        model = {"3m": "a 3.0M-parameter random Qwen2 (bench_3m_spec)", "0.5b": "Qwen2.5-0.5B's shape, random",
                 "tiny-sft": "the default job's SFT-warm-started tiny Qwen2 (0.9M)"}[w.model]
        length = "responses end at EOS (natural length)" if w.natural_eos else f"exactly {w.response_len} new tokens"
        notes.append(f"workload {w.name}: {model}, {w.prompts} prompts x n={w.n}, <= {w.response_len} new tokens, "
                     f"{length}, micro-batch {w.micro_batch}, low_var_kl KL loss, gradient checkpointing, {precision(w)}, "
                     f"{w.threads} threads (OMP_NUM_THREADS; TRL also torch.set_num_threads), device {w.device}; "
                     f"{w.rounds} round(s), each side once per round in a rotating order, each run 1 warm-up step then "
                     f"{w.timed_steps} timed steps; rows: the fastest timed step of all rounds (step_s_all: every "
                     f"timed step, rounds apart by ' | ')")
    notes += [
        "grpo_npu: `python -m grpo_npu.main_ppo` with its defaults plus the workload's keys only (workload_keys); "
        "step seconds are its metrics.jsonl timing_s/step; gen_s = timing_s/gen, score_s = reward + old/ref "
        "log-probs + advantages, update_s = timing_s/update_actor, other_s = the rest of the step (weight sync, "
        "bookkeeping); cpu_s = the least CPU seconds of a timed step (grpo_npu: its process tree's, sampled "
        "when each step's metrics line appears; TRL: process time inside the step), less sensitive than wall "
        "time to other processes on a shared machine; peak_memory_gb = perf/max_memory_allocated_gb (the process's peak RSS on CPU)",
        "TRL: GRPOTrainer from on_step_begin to on_step_end (generation, reward, reference forward, backward and "
        "optimizer step all inside), given grpo_npu's defaults for lr, weight decay, clip ratio, grad clip and KL "
        "coefficient, loss_type=dapo (token-mean), and grpo_npu's process environment ("
        + ", ".join(f"{k}={v}" for k, v in {**PROCESS_ENV_DEFAULTS, **CPU_MALLOC_ENV}.items()) + ")"
        + (f"; trl imported from {trl_path}" if trl_path else ""),
        f"load average (1/5/15 min) before {_load(load_before)}, after {_load(load_after)}, on {os.cpu_count()} CPUs",
    ]
    if any(w.overrides for w in works):
        notes.append("grpo_npu sides ran with these overrides on top (not its defaults): " + " ".join(works[0].overrides))
    if quick:
        notes.append("quick sizes: ratios are indicative only")
    return notes


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def main(argv: list[str] | None = None) -> BenchResult:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--model", default=None, choices=("3m", "0.5b"), help="the fixed workload's model")
    parser.add_argument("--device", default="cpu", choices=("cpu", "auto", "cuda", "npu"),
                        help="cpu (default); auto: the accelerator when there is one")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES, help="which trainers to run")
    parser.add_argument("--trl-path", default=None, help=f"a folder holding trl, for TRL's process only "
                                                          f"(default ${TRL_PATH_ENV})")
    for field in SIZE_FIELDS:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help="override the preset's size")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a grpo_npu config key for its sides (repeatable; applied after the workload's)")
    ours, rest = parser.parse_known_args(argv)

    def configured(quick: bool = False) -> BenchResult:
        """End-to-end GRPO step: grpo_npu's CLI vs TRL's GRPOTrainer (steps/s, tokens/s, ratio)."""
        return run(quick=quick, workloads=tuple(ours.workloads), model=ours.model, device=ours.device,
                   sides=tuple(ours.sides), overrides=tuple(ours.override), trl_path=ours.trl_path,
                   **{field: getattr(ours, field) for field in SIZE_FIELDS})

    return bench_main(configured, rest, parents=[parser])


if __name__ == "__main__":
    main()
