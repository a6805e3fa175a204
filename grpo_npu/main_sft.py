"""``python -m grpo_npu.main_sft key=value ...``: supervised fine-tuning on the RL workers.

Same keys as main_ppo where they apply: data.train_files (parquet with prompt + response, or
messages), data.prompt_key / data.response_key, data.train_batch_size, data.max_prompt_length /
max_response_length, actor_rollout_ref.model.*, actor_rollout_ref.actor.{optim,grad_clip,
ppo_micro_batch_size_per_gpu,fsdp_config}, trainer.{total_epochs,total_training_steps,device,
n_gpus_per_node,default_local_dir,logger}. ``export_dir=PATH`` writes the trained model in Hugging
Face format (loadable by from_pretrained and vLLM).
"""

from __future__ import annotations

import logging
import sys

from grpo_npu.config import ConfigError, config_from_argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    export = [a for a in argv if a.startswith("export_dir=")]
    argv = [a for a in argv if not a.startswith("export_dir=")]
    # SFT has no rollout: the mini-batch is the whole batch of (prompt, response) pairs.
    defaults = ["actor_rollout_ref.rollout.n=1", "critic.enable=False"]
    try:
        cfg, _ = config_from_argv(defaults + argv)
        if cfg is None:
            return 0
        from grpo_npu.sft import run_sft

        run_sft(cfg, export_dir=export[-1].split("=", 1)[1] if export else None)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
