"""Entry point: ``python -m grpo_npu.main_ppo [--config FILE] [key=value ...]`` (verl's main_ppo keys).

With no arguments at all it runs the embedded default job (:mod:`grpo_npu.default_job`): the
offline tiny model, the synthetic arithmetic task, a cached SFT warm start, then GRPO with a KL
loss -- the same code path as a real run, sized for two CPU cores.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

from grpo_npu.cli import apply_device_defaults, exit_code
from grpo_npu.config import config_from_argv
from grpo_npu.determinism import set_deterministic_env
from grpo_npu.env import apply_process_env_defaults
from grpo_npu.logs import setup_logging

log = logging.getLogger(__name__)


def train(argv: list[str]) -> None:
    # default_job and trainer import torch: imported here, after main() applied the process-environment
    # defaults that torch reads when it starts (and, for the trainer, after apply_device_defaults).
    if not argv:
        from grpo_npu import default_job

        argv = default_job.prepare()
    cfg, _ = config_from_argv(argv)
    if cfg is None:  # --help or --cfg
        return
    apply_device_defaults(cfg.trainer.device)  # CPU runs keep freed host memory (env.CPU_MALLOC_ENV)
    if cfg.trainer.deterministic:
        set_deterministic_env()  # before torch and Ray start: the workers and the engine inherit it
    from grpo_npu.trainer import Trainer

    run_dir = os.path.abspath(os.path.expanduser(cfg.trainer.default_local_dir))
    trainer = Trainer(cfg)  # checks the inputs, takes the run directory's lock, starts the workers
    print(f"run directory: {run_dir} (metrics.jsonl, checkpoints, PNG curves)", file=sys.stderr)
    try:
        trainer.fit()
    except BaseException as exc:
        log.debug("the run ended with an error", exc_info=exc)  # into train.log, before close() detaches it
        raise
    finally:
        trainer.close()
    print(where_things_went(run_dir, argv), file=sys.stderr)


def where_things_went(run_dir: str, argv: list[str]) -> str:
    """The end-of-run lines: where the run is, how to continue it, how to compare it with another run."""
    again = " ".join(shlex.quote(a) for a in argv if not a.startswith(("trainer.resume_mode=", "trainer.total_training_steps=")))
    return (f"run directory: {run_dir}\n"
            f"  continue it: python -m grpo_npu.main_ppo {again} trainer.resume_mode=auto "
            "trainer.total_training_steps=<more>\n"
            f"  compare it:  python -m grpo_npu.tools.compare_runs {shlex.quote(run_dir)} <other run directory>")


def main(argv: list[str] | None = None) -> int:
    apply_process_env_defaults()  # before anything imports torch
    setup_logging()
    return exit_code(lambda: train(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
