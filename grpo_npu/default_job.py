"""The embedded default job: what ``python -m grpo_npu.main_ppo`` runs with no arguments.

1. the offline tiny Qwen2 + tokenizer (:mod:`grpo_npu.models.tiny`);
2. the synthetic arithmetic task in the gsm8k schema (:mod:`grpo_npu.data.synthetic`);
3. an SFT warm start of the tiny model on worked solutions, cached after the first run
   (RL from random weights cannot learn: the model must first produce "#### <n>" answers);
4. GRPO with a low_var_kl KL loss on the same task, through the same trainer, workers, rollout and
   reward code as a real run, validating before training, every 20 steps and at the end.

The task (difficulty 1: single-digit addition, as numbers or word problems) has only 100 distinct
sums, so the validation prompts are a separate draw of the *same* distribution rather than held-out
facts: the validation reward measures how well the policy solves the task (the quantity RL
optimises), not generalisation to unseen facts. Validation samples 4 answers per prompt at the
training temperature (``val-core/openai/gsm8k/reward/mean@4``).

Everything lives under ``$GRPO_NPU_CACHE/default_job`` (default ``~/.cache/grpo_npu/default_job``);
``GRPO_NPU_DEFAULT_RUN_DIR`` moves the GRPO run directory (metrics.jsonl, plots, checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from grpo_npu.config import load_config
from grpo_npu.data.parquet import write_parquet_atomic
from grpo_npu.data.schema import GSM8K_DATA_SOURCE
from grpo_npu.data.synthetic import make_problems, rl_rows, sft_rows
from grpo_npu.io import commit_dir
from grpo_npu.models.tiny import build_tiny_model, default_cache_dir
from grpo_npu.sft import run_sft

log = logging.getLogger(__name__)

DIFFICULTY = 1  # single-digit addition: a ~1M-parameter model learns it on two cores in minutes
TRAIN_SIZE, TEST_SIZE, SFT_SIZE = 2048, 128, 512
SFT_STEPS = int(os.environ.get("GRPO_NPU_SFT_STEPS", 150))  # short on purpose: leaves headroom for RL
GRPO_STEPS = 60
SFT_OVERRIDES = [
    "data.train_batch_size=32", "data.max_prompt_length=64", "data.max_response_length=48",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.actor.optim.lr=3e-3", "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.grad_clip=1.0", "critic.enable=False", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
    "trainer.project_name=grpo_npu_default", "trainer.experiment_name=sft", "trainer.logger=['jsonl']",
    f"trainer.total_training_steps={SFT_STEPS}",
]


def grpo_overrides(model: str, data: Path, run_dir: Path, rollout: str) -> list[str]:
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.train_batch_size=32", "data.max_prompt_length=64", "data.max_response_length=24",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=5e-4", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        f"actor_rollout_ref.rollout.name={rollout}", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.load_format=dummy",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.project_name=grpo_npu_default", "trainer.experiment_name=tiny_grpo",
        f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
        "trainer.existing_run_dir=move_aside",  # starts clean every time; earlier runs go to previous_runs/
        # validation samples like training (4 per prompt): it measures the policy RL optimises, with
        # 4x less noise than one greedy answer per prompt
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        f"trainer.total_training_steps={GRPO_STEPS}", "trainer.test_freq=20",
        f"trainer.save_freq={GRPO_STEPS}",  # one checkpoint, at the end (save_freq <= 0 saves none)
        "trainer.val_before_train=True", "trainer.logger=['console','jsonl']", "trainer.log_val_generations=2",
    ]


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401 - optional dependency, probed here
    except Exception:  # noqa: BLE001 - any import failure means: use the transformers rollout
        return False
    return True


def write_task(out: Path) -> None:
    """Train, SFT and validation draws of the same distribution (see the module docstring)."""

    def draw(n: int, stream: str):
        return make_problems(n, DIFFICULTY, seed=0, stream=stream)

    write_parquet_atomic(sft_rows(draw(SFT_SIZE, "sft"), "train", GSM8K_DATA_SOURCE), out / "sft_train.parquet")
    write_parquet_atomic(rl_rows(draw(TRAIN_SIZE, "train"), "train", GSM8K_DATA_SOURCE), out / "train.parquet")
    write_parquet_atomic(rl_rows(draw(TEST_SIZE, "val"), "test", GSM8K_DATA_SOURCE), out / "test.parquet")


def prepare(cache_dir: str | os.PathLike | None = None, rollout: str | None = None) -> list[str]:
    """Build (or reuse) model, data and SFT warm start; return the GRPO command line."""
    root = Path(cache_dir) if cache_dir else default_cache_dir() / "default_job"
    root.mkdir(parents=True, exist_ok=True)
    base = build_tiny_model(root)
    data = root / f"task-d{DIFFICULTY}"
    if not (data / "test.parquet").exists():
        write_task(data)
    sft = root / "tiny-sft"
    stamp = json.dumps({"base": str(base), "steps": SFT_STEPS, "overrides": SFT_OVERRIDES, "difficulty": DIFFICULTY})
    if not (sft / "SFT_DONE").exists() or (sft / "SFT_DONE").read_text() != stamp:
        log.info("default job: SFT warm start of the tiny model (first run only, about a minute)")
        shutil.rmtree(sft, ignore_errors=True)
        cfg = load_config(SFT_OVERRIDES + [f"actor_rollout_ref.model.path={base}",
                                           f"data.train_files={data / 'sft_train.parquet'}",
                                           f"trainer.default_local_dir={root / 'sft_run'}"])
        tmp = root / "tiny-sft.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        run_sft(cfg, export_dir=str(tmp))
        (tmp / "SFT_DONE").write_text(stamp)
        commit_dir(tmp, sft)
    run_dir = Path(os.environ.get("GRPO_NPU_DEFAULT_RUN_DIR") or root / "runs" / "tiny_grpo")
    return grpo_overrides(str(sft), data, run_dir, rollout or ("vllm" if _vllm_available() else "hf"))
