"""End-to-end GRPO step: grpo_npu's ``Trainer`` against TRL's ``GRPOTrainer`` on the same workload.

Run: ``python -m bench.step_vs_trl [--quick] [--model tiny|0.5b] [--device cpu|auto] [--threads N]
[--trl-env-defaults]``.
Target: grpo_npu >= 2x TRL's steps/s, reported for both rollouts: ``rollout.name=vllm`` (grpo_npu's engine)
and ``rollout.name=hf`` (transformers generation, like TRL's).

The workload, identical on both sides:
- the same checkpoint (the offline tiny Qwen2, or ``--model 0.5b``: Qwen2.5-0.5B's shape with random
  weights), fp32, the same torch intra-op thread count, set explicitly in each side's process;
- the same B chat prompts every step (a B-row dataset, no shuffling: one epoch is one step), so both
  sides generate from identical inputs, padded to the same width (the longest prompt);
- n samples per prompt (TRL ``num_generations``), temperature 1, top-p 1, no top-k, exactly T new
  tokens per sample (grpo_npu ``rollout.ignore_eos``; TRL ``min_new_tokens = max_completion_length``);
- gsm8k ``compute_score`` on the decoded completions (grpo_npu's reward manager; a TRL reward function);
- GRPO advantages (group mean/std), clip 0.2, token-mean loss, low-variance KL loss with coefficient
  ``beta > 0`` against a reference model (both sides run the reference forward), AdamW with the same
  lr, no weight decay, grad-norm clip 1.0, gradient checkpointing on;
- one optimizer step per generation batch of B x n samples, in micro-batches of the same size
  (TRL: ``per_device_train_batch_size`` = micro-batch, ``gradient_accumulation_steps`` = B x n /
  micro-batch, ``num_iterations`` = 1).

Method: each side runs in a fresh subprocess (imports, threads, allocator and process-group state
stay apart), one warm-up step then N timed steps. A step is what each trainer itself calls a step:
grpo_npu from its rollout phase to the end of its update phase (generate, reward, old/ref log-probs,
advantages, update), TRL from ``on_step_begin`` to ``on_step_end`` (its generation, reward, reference
forward, backward and optimizer step all happen inside); on an accelerator the clock synchronizes the
device at both ends. Step seconds are the best of the N, with the process CPU seconds of that step
beside them (less sensitive than wall time to other processes on a shared machine). Tokens per step
(prompt + response, padding excluded) are counted by each trainer, and the prompt part is checked
against the shared prompts. The load average before and after is in the notes. TRL is a
benchmark-only dependency (``pip install -e '.[bench]'``).
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
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.common import BenchResult, bench_main
from grpo_npu.env import CPU_MALLOC_ENV, PROCESS_ENV_DEFAULTS, apply_process_env_defaults, cpu_malloc_defaults

TARGET_SPEEDUP = 2.0
# One intra-op thread by default: on a shared 2-core machine a parallel region stalls whenever another
# process holds a core; both sides always run under the same, explicit setting.
DEFAULT_THREADS = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
SIDES = ("grpo_npu_hf", "trl", "grpo_npu_vllm")
RESULT_FILE = "side.json"
# Packing rows (remove padding) without a varlen attention kernel makes SDPA attend over the whole packed
# micro-batch under a block-diagonal mask, quadratic in its length: measured 2x slower updates on CPU here.
USE_REMOVE_PADDING = False
# grpo_npu's timed sections between generation and the update (TRL does these inside its generate-and-score).
SCORE_SECTIONS = ("reward", "old_log_prob", "ref", "adv")


@dataclass(frozen=True)
class Workload:
    """One GRPO step's work; every size is shared by both trainers."""

    model: str  # "tiny" | "0.5b"
    prompts: int  # B prompts per step
    n: int  # samples per prompt
    response_len: int  # T new tokens per sample (fixed: EOS ignored)
    micro_batch: int  # samples per forward/backward
    timed_steps: int  # after one warm-up step
    threads: int
    device: str = "cpu"
    lr: float = 1e-5
    beta: float = 0.001  # KL coefficient (> 0: the reference model runs on both sides)
    seed: int = 0
    overrides: tuple[str, ...] = ()  # extra key=value for grpo_npu's sides only (applied last)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}; known: {sorted(MODELS)}")
        if (self.prompts * self.n) % self.micro_batch:
            raise ValueError(f"prompts x n = {self.prompts} x {self.n} is not a multiple of "
                             f"micro_batch={self.micro_batch}")
        if self.timed_steps < 1 or self.threads < 1 or self.beta <= 0:
            raise ValueError("timed_steps and threads must be >= 1 and beta > 0")


MODELS = ("tiny", "0.5b")
SIZE_FIELDS = ("prompts", "n", "response_len", "micro_batch", "timed_steps")  # settable from the command line
QUICK = Workload("tiny", prompts=2, n=4, response_len=16, micro_batch=8, timed_steps=2, threads=DEFAULT_THREADS)
FULL = Workload("tiny", prompts=8, n=8, response_len=64, micro_batch=16, timed_steps=4, threads=DEFAULT_THREADS)
# 500M parameters in fp32 on a 2-core CPU: small batch, short responses.
FULL_05B = Workload("0.5b", prompts=2, n=4, response_len=32, micro_batch=4, timed_steps=2, threads=DEFAULT_THREADS)


# ------------------------------------------------------------------------------------------------
# Shared inputs: model, prompts
# ------------------------------------------------------------------------------------------------
def prepare_inputs(work: Workload, root: Path) -> dict:
    """Write the model path, the B-prompt parquet and its prompt width; the same files feed both sides."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from grpo_npu.data.synthetic import write_synthetic
    from grpo_npu.models.tiny import QWEN2_5_0_5B_SHAPE, TINY, build_tiny_model

    spec = TINY if work.model == "tiny" else QWEN2_5_0_5B_SHAPE
    model = build_tiny_model(spec=spec)  # cached under $GRPO_NPU_CACHE
    files = write_synthetic(str(root / "data"), train_size=work.prompts, test_size=1, seed=work.seed, write_sft=False)
    rows = pq.read_table(files["train"]).to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = tokenizer.apply_chat_template([r["prompt"] for r in rows], add_generation_prompt=True, tokenize=False)
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return {"model": str(model), "train": str(files["train"]), "prompt_width": max(lengths),
            "prompt_tokens": sum(lengths)}


class StepClock:
    """Wall and process-CPU seconds of each step; ``measured`` drops the first (warm-up) step."""

    def __init__(self, device: str) -> None:
        from grpo_npu.device import get_device

        self.synchronize = get_device(device).synchronize  # queued device work belongs to the step
        self.wall_s: list[float] = []
        self.cpu_s: list[float] = []
        self._start = (0.0, 0.0)

    def begin(self) -> None:
        self.synchronize()
        self._start = (time.perf_counter(), time.process_time())

    def end(self) -> None:
        self.synchronize()
        self.wall_s.append(time.perf_counter() - self._start[0])
        self.cpu_s.append(time.process_time() - self._start[1])

    def measured(self, **per_step) -> dict:
        out = {"step_s": self.wall_s[1:], "cpu_s": self.cpu_s[1:]}
        for key, value in per_step.items():
            out[key] = value[1:] if isinstance(value, list) else value
        return out


# ------------------------------------------------------------------------------------------------
# Side 1: grpo_npu's Trainer
# ------------------------------------------------------------------------------------------------
def share_prompt_prefix(device: str) -> bool:
    """Whether grpo_npu's sides pack each prompt once with its responses (where it measured faster: CPU)."""
    return device == "cpu"


def grpo_npu_overrides(work: Workload, inputs: dict, rollout: str, run_dir: Path) -> list[str]:
    """The command-line overrides that give grpo_npu's Trainer the shared workload."""
    micro = work.micro_batch
    return [
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=True",
        f"data.train_files={inputs['train']}", "data.shuffle=False",
        f"data.train_batch_size={work.prompts}", f"data.max_prompt_length={inputs['prompt_width']}",
        f"data.max_response_length={work.response_len}",
        f"actor_rollout_ref.model.path={inputs['model']}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        # each prompt's tokens go through the layers once for its n responses: same loss and gradients.
        # CPU only: on CUDA without a varlen attention kernel it loops SDPA per prompt, which measured a 2.1x
        # slower update at the 0.5B shape on an H100 (4.5 s vs 2.1 s)
        f"actor_rollout_ref.model.share_prompt_prefix={share_prompt_prefix(work.device)}",
        # linear layers through oneDNN's fp32 matmul instead of torch's MKL sgemm (CPU only; same products)
        f"actor_rollout_ref.model.use_onednn_linear={work.device == 'cpu'}",
        f"actor_rollout_ref.model.use_remove_padding={USE_REMOVE_PADDING}", "actor_rollout_ref.model.dtype=float32",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=float32",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=float32",
        f"actor_rollout_ref.actor.optim.lr={work.lr}", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.grad_clip=1.0", "actor_rollout_ref.actor.clip_ratio=0.2",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.entropy_coeff=0.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={work.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=True", f"actor_rollout_ref.actor.kl_loss_coef={work.beta}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.rollout.name={rollout}", f"actor_rollout_ref.rollout.n={work.n}",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.ignore_eos=True",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.load_format=dummy", f"actor_rollout_ref.rollout.seed={work.seed}",
        f"actor_rollout_ref.rollout.max_num_seqs={work.prompts * work.n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"trainer.device={work.device}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.project_name=bench", "trainer.experiment_name=step_vs_trl", f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=['jsonl']", f"trainer.total_training_steps={1 + work.timed_steps}",
        f"trainer.seed={work.seed}",
        # fit() always checkpoints its last step (outside the timed steps); the optimizer state is not needed
        # and, for the 0.5B shape, its full gather is what pushes a 24 GB machine over the edge.
        "actor_rollout_ref.actor.checkpoint.save_contents=['model']",
        *work.overrides,
    ]


def run_grpo_npu(work: Workload, inputs: dict, rollout: str, out_dir: Path) -> dict:
    """Warm-up + timed steps through Trainer.fit(); sections and tokens from its metrics.jsonl."""
    import torch

    from grpo_npu.config import load_config
    from grpo_npu.trainer import Trainer

    class TimedTrainer(Trainer):
        """Trainer whose steps are clocked from the first phase (rollout) to the last (update)."""

        def rollout_and_reward(self, step, timer):
            clock.begin()
            return super().rollout_and_reward(step, timer)

        def update(self, batch, step, timer):
            metrics = super().update(batch, step, timer)
            clock.end()
            return metrics

    clock = StepClock(work.device)
    run_dir = out_dir / f"run_{rollout}"
    trainer = TimedTrainer(load_config(grpo_npu_overrides(work, inputs, rollout, run_dir)))
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing_s/step" in r]
    samples = work.prompts * work.n
    return clock.measured(
        sections=[{"gen": r["timing_s/gen"], "update": r["timing_s/update_actor"],
                   "score": sum(r.get(f"timing_s/{k}", 0.0) for k in SCORE_SECTIONS)} for r in steps],
        tokens=[r["perf/total_num_tokens"] for r in steps],
        response_tokens=[r["response_length/mean"] * samples for r in steps],
        threads=torch.get_num_threads(),
    )


# ------------------------------------------------------------------------------------------------
# Side 2: TRL's GRPOTrainer
# ------------------------------------------------------------------------------------------------
def trl_config_kwargs(work: Workload, out_dir: Path) -> dict:
    """GRPOConfig arguments for the shared workload (one optimizer step per B x n generation batch)."""
    samples = work.prompts * work.n
    return dict(
        output_dir=str(out_dir / "trl"), seed=work.seed, use_cpu=work.device == "cpu", bf16=False, fp16=False,
        per_device_train_batch_size=work.micro_batch, gradient_accumulation_steps=samples // work.micro_batch,
        num_generations=work.n, num_iterations=1, max_completion_length=work.response_len,
        generation_kwargs={"min_new_tokens": work.response_len},  # fixed length: EOS suppressed until T
        temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False,
        beta=work.beta, epsilon=0.2, loss_type="dapo", scale_rewards="group",  # dapo = token-mean over the batch
        learning_rate=work.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0,
        gradient_checkpointing=True, max_steps=1 + work.timed_steps,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0,
    )


def run_trl(work: Workload, inputs: dict, out_dir: Path) -> dict:
    """Warm-up + timed steps through GRPOTrainer.train(); steps clocked by callbacks, tokens from its logs."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_npu.reward.gsm8k import compute_score

    rows = pq.read_table(inputs["train"]).to_pylist()
    table = InMemoryTable.from_pylist([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                       for r in rows])
    # A fixed fingerprint: datasets would hash the table with dill, which fails on some Python 3.12 + pyarrow
    # builds ("Can't pickle <class 'MonthDayNano'>"); nothing here is cached, so the name only has to be unique.
    dataset = Dataset(table, fingerprint=f"bench-step-vs-trl-{os.getpid()}")

    def gsm8k_reward(completions, ground_truth, **kwargs) -> list[float]:
        return [compute_score(c[-1]["content"], gt) for c, gt in zip(completions, ground_truth)]

    class Hooks(TrainerCallback):
        """Step boundaries, TRL's cumulative token count, and named sections inside a step."""

        def __init__(self) -> None:
            self.sections: list[dict[str, float]] = []
            self.num_tokens: list[float] = []

        @contextmanager
        def section(self, name: str):
            start = time.perf_counter()
            try:
                yield
            finally:
                current = self.sections[-1]
                current[name] = current.get(name, 0.0) + time.perf_counter() - start

        def on_step_begin(self, args, state, control, **kwargs):
            self.sections.append({})
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                self.num_tokens.append(float(logs["num_tokens"]))

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with two timed sections: generation, and generate-and-score (+ reward, ref forward)."""

        def _generate_single_turn(self, *args, **kwargs):
            with hooks.section("gen"):
                return super()._generate_single_turn(*args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            with hooks.section("gen_and_score"):
                return super()._generate_and_score_completions(*args, **kwargs)

    clock, hooks = StepClock(work.device), Hooks()
    tokenizer = AutoTokenizer.from_pretrained(inputs["model"])
    model = AutoModelForCausalLM.from_pretrained(inputs["model"], dtype=torch.float32)
    args = GRPOConfig(**trl_config_kwargs(work, out_dir))
    trainer = TimedGRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=args, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[hooks])
    trainer.train()
    tokens = [b - a for a, b in zip([0.0] + hooks.num_tokens, hooks.num_tokens)]  # num_tokens is cumulative
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    samples = work.prompts * work.n
    return clock.measured(
        sections=[{"gen": c["gen"], "score": c["gen_and_score"] - c["gen"], "update": wall - c["gen_and_score"]}
                  for c, wall in zip(hooks.sections, clock.wall_s)],
        tokens=tokens,
        response_tokens=[length * samples for length in lengths],
        threads=torch.get_num_threads(),
    )


# ------------------------------------------------------------------------------------------------
# Driver: one subprocess per side
# ------------------------------------------------------------------------------------------------
def worker_main(argv: list[str]) -> None:
    """``--side NAME --work JSON --inputs JSON --out DIR``: run one side, write DIR/side.json."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", required=True, choices=SIDES)
    parser.add_argument("--work", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch

    work = Workload(**json.loads(args.work))
    torch.set_num_threads(work.threads)
    torch.manual_seed(work.seed)
    inputs, out = json.loads(args.inputs), Path(args.out)
    if args.side == "trl":
        measured = run_trl(work, inputs, out)
    else:
        measured = run_grpo_npu(work, inputs, args.side.removeprefix("grpo_npu_"), out)
    tmp = out / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(measured))
    os.replace(tmp, out / RESULT_FILE)


def missing_dependency(side: str) -> str | None:
    """Why ``side`` cannot run here (an optional package is absent), or None."""
    import importlib.util

    needs = {"trl": ("trl", "pip install -e '.[bench]'"), "grpo_npu_vllm": ("vllm", "pip install -e '.[vllm]'")}
    if side in needs and importlib.util.find_spec(needs[side][0]) is None:
        return f"{needs[side][0]} is not installed ({needs[side][1]})"
    return None


def process_env(device: str) -> dict[str, str]:
    """The variables grpo_npu's entry points give a run on ``device`` (where the caller has not set them)."""
    return {**PROCESS_ENV_DEFAULTS, **(CPU_MALLOC_ENV if device == "cpu" else {})}


def run_side(side: str, work: Workload, inputs: dict, root: Path, trl_env_defaults: bool = False) -> dict:
    """Run one side in a fresh Python process and return its measurements; raise if it fails.

    grpo_npu's sides get the process environment its entry points set (``env.PROCESS_ENV_DEFAULTS``, and on CPU
    ``env.CPU_MALLOC_ENV``); TRL's gets the caller's environment as it is, unless ``trl_env_defaults``.
    """
    out = root / side
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(work.threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    if side != "trl" or trl_env_defaults:  # what `python -m grpo_npu.main_ppo` gives its own process
        apply_process_env_defaults(env)
        if work.device == "cpu":
            cpu_malloc_defaults(env)
    cmd = [sys.executable, "-m", "bench.step_vs_trl", "--worker", "--side", side, "--work", json.dumps(asdict(work)),
           "--inputs", json.dumps(inputs), "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not (out / RESULT_FILE).exists():
        log = Path(tempfile.gettempdir()) / f"bench-step_vs_trl-{side}.log"  # outlives the work directory
        log.write_text(proc.stdout + proc.stderr)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"step_vs_trl side {side!r} failed (exit {proc.returncode}); full output in {log}; "
                           f"last lines:\n{tail}")
    measured = json.loads((out / RESULT_FILE).read_text())
    measured["process_s"] = wall
    return measured


def summarise(label: str, measured: dict) -> dict:
    """One table row: the best (fastest) timed step, its throughput and where its time went."""
    best = min(range(len(measured["step_s"])), key=lambda i: measured["step_s"][i])
    step_s, sections = measured["step_s"][best], measured["sections"][best]
    tokens, response = measured["tokens"][best], measured["response_tokens"][best]
    return {
        "side": label, "step_s": step_s, "step_s_median": statistics.median(measured["step_s"]),
        "steps_per_s": 1.0 / step_s, "tokens_per_s": tokens / step_s,
        "response_tokens_per_s": response / step_s, "tokens_per_step": tokens, "response_tokens_per_step": response,
        "prompt_tokens_per_step": tokens - response,
        "gen_s": sections["gen"], "score_s": sections["score"], "update_s": sections["update"],
        "cpu_s": measured["cpu_s"][best], "step_s_all": "/".join(f"{s:.3g}" for s in measured["step_s"]),
        "threads": measured["threads"], "process_s": measured["process_s"],
    }


LABELS = {"grpo_npu_hf": "grpo_npu (rollout=hf)", "trl": "TRL GRPOTrainer", "grpo_npu_vllm": "grpo_npu (rollout=vllm)"}
TARGETS = {"grpo_npu_hf": "grpo_npu_hf_vs_trl_steps_per_s", "grpo_npu_vllm": "grpo_npu_vllm_vs_trl_steps_per_s"}


def run(quick: bool = False, model: str = "tiny", device: str = "cpu", sides: tuple[str, ...] = SIDES,
        trl_env_defaults: bool = False, overrides: tuple[str, ...] = (), **sizes) -> BenchResult:
    """End-to-end GRPO step: grpo_npu vs TRL on the same workload; ``sizes`` override Workload fields."""
    from grpo_npu.device import resolve_kind

    unknown = set(sides) - set(SIDES)
    if unknown:
        raise ValueError(f"unknown sides {sorted(unknown)}; known: {list(SIDES)}")
    base = QUICK if quick else (FULL_05B if model == "0.5b" else FULL)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"--override {bad[0]!r}: expected key=value (a grpo_npu config key)")
    work = replace(base, model=model, device=resolve_kind(device), overrides=tuple(overrides),
                   **{k: v for k, v in sizes.items() if v is not None})
    result = BenchResult(name="step_vs_trl")
    skipped = {side: why for side in sides if (why := missing_dependency(side))}
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-step-vs-trl-"))
    try:
        inputs = prepare_inputs(work, root)
        measured = {side: run_side(side, work, inputs, root, trl_env_defaults) for side in sides if side not in skipped}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()

    rows = {side: summarise(LABELS[side], m) for side, m in measured.items()}
    result.rows = list(rows.values())
    expected = {"prompt_tokens_per_step": inputs["prompt_tokens"] * work.n,
                "response_tokens_per_step": work.prompts * work.n * work.response_len}
    for side, row in rows.items():
        for key, want in expected.items():
            if row[key] != want:  # the comparison is void: say so loudly, next to the numbers
                result.notes.append(f"WORKLOAD MISMATCH: {side} counted {row[key]} {key}, expected {want}")
    if "trl" in rows:
        for side, target in TARGETS.items():
            if side in rows:
                result.add_target(target, rows[side]["steps_per_s"] / rows["trl"]["steps_per_s"], TARGET_SPEEDUP)
    result.notes += [f"{side} not run: {why}" for side, why in skipped.items()]
    result.notes += [
        f"workload: {work.model} model, {work.prompts} prompts x n={work.n}, prompts padded to "
        f"{inputs['prompt_width']} tokens, {work.response_len} new tokens per sample (EOS ignored), micro-batch "
        f"{work.micro_batch}, KL beta {work.beta}, lr {work.lr}, gradient checkpointing, fp32, device {work.device}",
        f"torch intra-op threads {work.threads} on every side (set explicitly, and OMP_NUM_THREADS); best of "
        f"{work.timed_steps} timed steps after 1 warm-up step (step_s_all: every timed step); cpu_s: process CPU "
        "seconds of the best step (less sensitive to other load than wall time)",
        "step = each trainer's own step (grpo_npu: rollout .. update; TRL: on_step_begin .. on_step_end); gen_s = "
        "generation, score_s = reward + old/ref log-probs + advantages, update_s = the rest (forward, backward, "
        "optimizer); tokens = prompt + response tokens without padding, as each trainer counts them",
        "one optimizer step per batch: both trainers take the old log-probs from the update's own forward (grpo_npu "
        "actor.old_log_prob=auto, TRL num_iterations=1), so neither runs a separate old-policy pass",
        "grpo_npu runs its linear layers through oneDNN (model.use_onednn_linear=True; tested equal to F.linear); "
        "TRL's go through torch's default fp32 matmul (MKL on this CPU)" if work.device == "cpu" else
        "both trainers' linear layers go through torch's F.linear (model.use_onednn_linear is CPU-only)",
        "grpo_npu packs each prompt once with its n responses (model.share_prompt_prefix=True; tested equal to padded "
        "rows): its actor/reference passes process fewer tokens for the same loss and gradients"
        if share_prompt_prefix(work.device) else
        "both trainers run padded rows (grpo_npu's model.share_prompt_prefix is used on CPU only: without a varlen "
        "attention kernel it loops attention per prompt)",
        "process environment: grpo_npu runs with what its entry points set before torch starts ("
        + ", ".join(f"{k}={v}" for k, v in process_env(work.device).items())
        + ", unless already set); TRL runs with "
        + ("the same (--trl-env-defaults)" if trl_env_defaults else "the caller's environment as it is "
           "(--trl-env-defaults gives it grpo_npu's defaults too)"),
        f"load average (1/5/15 min) before {_load(load_before)}, after {_load(load_after)}, on {os.cpu_count()} CPUs",
    ]
    if work.overrides:
        result.notes.append("grpo_npu sides ran with these overrides on top: " + " ".join(work.overrides))
    if quick:
        result.notes.append("quick sizes: ratios are indicative only")
    return result


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def main(argv: list[str] | None = None) -> BenchResult | None:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        worker_main([a for a in argv if a != "--worker"])
        return None
    parser = argparse.ArgumentParser(add_help=False, usage="%(prog)s [--quick] [--json PATH] [options below]")
    parser.add_argument("--model", default="tiny", choices=MODELS, help="tiny (default) or 0.5b: Qwen2.5-0.5B's shape")
    parser.add_argument("--device", default="cpu", choices=("cpu", "auto", "cuda", "npu"),
                        help="cpu (default); auto: the accelerator when there is one")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES, help="which trainers to run")
    parser.add_argument("--trl-env-defaults", action="store_true",
                        help="give TRL's process grpo_npu's process-environment defaults too")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch threads, every side (default {DEFAULT_THREADS})")
    for field in SIZE_FIELDS:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help="override the preset's size")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a grpo_npu config override for its sides (repeatable; applied after the workload's)")
    ours, rest = parser.parse_known_args(argv)
    if {"-h", "--help"} & set(rest):
        parser.print_help()
    sizes = {field: getattr(ours, field) for field in ("threads", *SIZE_FIELDS)}

    def configured(quick: bool = False) -> BenchResult:
        """End-to-end GRPO step: grpo_npu vs TRL's GRPOTrainer (steps/s, tokens/s, ratio)."""
        return run(quick=quick, model=ours.model, device=ours.device, sides=tuple(ours.sides),
                   trl_env_defaults=ours.trl_env_defaults, overrides=tuple(ours.override), **sizes)

    return bench_main(configured, rest)


if __name__ == "__main__":
    main()
