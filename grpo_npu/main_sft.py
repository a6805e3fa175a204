"""``python -m grpo_npu.main_sft key=value ...``: supervised fine-tuning on the RL workers.

Same keys as main_ppo where they apply: data.train_files (parquet with prompt + response, or
messages), data.prompt_key / data.response_key, data.train_batch_size, data.max_prompt_length /
max_response_length, actor_rollout_ref.model.*, actor_rollout_ref.actor.{optim,grad_clip,
ppo_micro_batch_size_per_gpu,fsdp_config}, trainer.{total_epochs,total_training_steps,device,
n_gpus_per_node,default_local_dir,logger}. ``export_dir=PATH`` writes the trained model in Hugging
Face format (loadable by from_pretrained and vLLM).
"""

from __future__ import annotations

import sys

from grpo_npu.cli import apply_device_defaults, exit_code
from grpo_npu.logs import setup_logging
from grpo_npu.config import config_from_argv
from grpo_npu.env import apply_process_env_defaults

# SFT has no rollout and no critic: one response per prompt, the policy alone.
SFT_DEFAULTS = ["actor_rollout_ref.rollout.n=1", "critic.enable=False"]


def sft(argv: list[str]) -> None:
    export = [a.split("=", 1)[1] for a in argv if a.startswith("export_dir=")]
    cfg, _ = config_from_argv(SFT_DEFAULTS + [a for a in argv if not a.startswith("export_dir=")])
    if cfg is None:
        return
    apply_device_defaults(cfg.trainer.device)  # CPU runs keep freed host memory (env.CPU_MALLOC_ENV)
    from grpo_npu.sft import run_sft  # imports torch: only after the process settings above

    run_sft(cfg, export_dir=export[-1] if export else None)


def main(argv: list[str] | None = None) -> int:
    apply_process_env_defaults()  # before anything imports torch
    setup_logging()
    return exit_code(lambda: sft(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
