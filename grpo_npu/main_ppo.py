"""Entry point: ``python -m grpo_npu.main_ppo [--config FILE] [key=value ...]`` (verl's main_ppo keys).

Parses and validates the configuration. The training loop (issue #8) is not in this build yet:
until it lands, this command validates the configuration, prints the derived batch arithmetic, and
says plainly that no training was run (exit code 3).
"""

from __future__ import annotations

import sys

from grpo_npu.config import ConfigError, config_from_argv, derive


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, _ = config_from_argv(argv)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if cfg is None:  # --help or --cfg
        return 0
    print("configuration is valid; derived per-rank sizes:", derive(cfg))
    print("grpo_npu: the training loop is not implemented in this build yet (see issue #8); nothing was trained.",
          file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
