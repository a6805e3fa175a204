"""Entry point: ``python -m grpo_npu.main_ppo [--config FILE] [key=value ...]`` (verl's main_ppo keys).

With no arguments at all it runs the embedded default job (:mod:`grpo_npu.default_job`): the
offline tiny model, the synthetic arithmetic task, a cached SFT warm start, then GRPO with a KL
loss -- the same code path as a real run, sized for two CPU cores.
"""

from __future__ import annotations

import logging
import sys

from grpo_npu.config import ConfigError, config_from_argv

log = logging.getLogger("grpo_npu")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if not argv:
            from grpo_npu import default_job

            argv = default_job.prepare()
        cfg, _ = config_from_argv(argv)
        if cfg is None:  # --help or --cfg
            return 0
        from grpo_npu.trainer import Trainer

        trainer = Trainer(cfg)
        try:
            trainer.fit()
        finally:
            trainer.close()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
