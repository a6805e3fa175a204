"""Entry point: ``python -m grpo_npu.main_ppo [--config FILE] [key=value ...]`` (verl's main_ppo keys).

With no arguments at all it runs the embedded default job (:mod:`grpo_npu.default_job`): the
offline tiny model, the synthetic arithmetic task, a cached SFT warm start, then GRPO with a KL
loss -- the same code path as a real run, sized for two CPU cores.
"""

from __future__ import annotations

import sys

from grpo_npu.cli import apply_device_defaults, apply_process_env_defaults, exit_code, setup_logging
from grpo_npu.config import config_from_argv


def train(argv: list[str]) -> None:
    if not argv:
        from grpo_npu import default_job

        argv = default_job.prepare()
    cfg, _ = config_from_argv(argv)
    if cfg is None:  # --help or --cfg
        return
    apply_device_defaults(cfg.trainer.device)  # CPU runs keep freed host memory (cli.CPU_MALLOC_ENV)
    from grpo_npu.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    apply_process_env_defaults()  # before anything imports torch
    setup_logging()
    return exit_code(lambda: train(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
