"""What the command-line entry points share: logging set-up and the mapping of errors to exit codes."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from grpo_npu.config import ConfigError

EXIT_OK, EXIT_STOPPED, EXIT_BAD_INPUT = 0, 1, 2


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def exit_code(run: Callable[[], None]) -> int:
    """Run; bad configuration or input -> one line on stderr and 2; a run that stopped itself -> 1."""
    from grpo_npu.trainer import TrainingStopped

    try:
        run()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OSError, ValueError) as exc:  # missing files, unloadable model paths, bad data rows
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingStopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    return EXIT_OK
