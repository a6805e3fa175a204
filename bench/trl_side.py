"""The baseline side of ``bench.step_vs_trl``: TRL's ``GRPOTrainer`` on the shared workload, in its own process.

Run by the driver as ``python -m bench.trl_side --work JSON --inputs JSON --out DIR``; writes DIR/side.json.
TRL is a benchmark-only dependency (``pip install -e '.[bench]'``); it may also live in a folder of its own
(``pip install --target DIR trl``), which the driver then puts on this process's PYTHONPATH only.

TRL is configured to do grpo_npu's default work: grpo_npu's default lr, weight decay, clip ratio, grad-norm
clip, KL coefficient and token-mean loss, so that both sides differ only in how they do it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

RESULT_FILE = "side.json"
# grpo_npu's defaults for what the workload leaves open (grpo_npu/config/actor_rollout_ref.py); TRL gets the same.
GRPO_NPU_DEFAULTS = {"lr": 1e-6, "weight_decay": 0.01, "clip_ratio": 0.2, "grad_clip": 1.0, "kl_loss_coef": 0.001}


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


def trl_config_kwargs(work: dict, out_dir: Path) -> dict:
    """GRPOConfig arguments for the shared workload (one optimizer step per B x n generation batch)."""
    samples = work["prompts"] * work["n"]
    d = GRPO_NPU_DEFAULTS
    return dict(
        output_dir=str(out_dir / "trl"), seed=work["seed"], use_cpu=work["device"] == "cpu",
        bf16=work["device"] != "cpu", fp16=False,  # as grpo_npu's default: bf16 compute on accelerators, fp32 on CPU
        per_device_train_batch_size=work["micro_batch"], gradient_accumulation_steps=samples // work["micro_batch"],
        num_generations=work["n"], num_iterations=1, max_completion_length=work["response_len"],
        # fixed length: EOS suppressed until T; natural EOS: generation stops at the tokenizer's EOS
        generation_kwargs={} if work["natural_eos"] else {"min_new_tokens": work["response_len"]},
        temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False,
        beta=d["kl_loss_coef"], epsilon=d["clip_ratio"], loss_type="dapo",  # dapo = token-mean over the batch
        scale_rewards="group", learning_rate=d["lr"], lr_scheduler_type="constant", weight_decay=d["weight_decay"],
        max_grad_norm=d["grad_clip"], warmup_steps=0, gradient_checkpointing=True, max_steps=1 + work["timed_steps"],
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0,
    )


def run_trl(work: dict, inputs: dict, out_dir: Path) -> dict:
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

    clock, hooks = StepClock(work["device"]), Hooks()
    tokenizer = AutoTokenizer.from_pretrained(inputs["model"])
    model = AutoModelForCausalLM.from_pretrained(inputs["model"], dtype=torch.float32)
    args = GRPOConfig(**trl_config_kwargs(work, out_dir))
    trainer = TimedGRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=args, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[hooks])
    trainer.train()
    tokens = [b - a for a, b in zip([0.0] + hooks.num_tokens, hooks.num_tokens)]  # num_tokens is cumulative
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    samples = work["prompts"] * work["n"]
    sections = [{"gen": c["gen"], "score": c["gen_and_score"] - c["gen"], "update": wall - c["gen_and_score"],
                 "other": 0.0} for c, wall in zip(hooks.sections, clock.wall_s)]
    return {"step_s": clock.wall_s[1:], "cpu_s": clock.cpu_s[1:], "sections": sections[1:], "tokens": tokens[1:],
            "response_tokens": [length * samples for length in lengths][1:], "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch

    work = json.loads(args.work)
    torch.set_num_threads(work["threads"])
    torch.manual_seed(work["seed"])
    out = Path(args.out)
    measured = run_trl(work, json.loads(args.inputs), out)
    tmp = out / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(measured))
    os.replace(tmp, out / RESULT_FILE)


if __name__ == "__main__":
    main()
