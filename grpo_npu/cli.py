"""What the command-line entry points share: logging set-up, process settings, and errors mapped to exit codes.

The environment defaults themselves live in :mod:`grpo_npu.env`, the error types and exit codes in
:mod:`grpo_npu.errors`. Importing this module does not import torch (the entry points import it first).
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

from grpo_npu import env
from grpo_npu.errors import (EXIT_BAD_INPUT, EXIT_OK, EXIT_SIGNAL_BASE, EXIT_STOPPED, ConfigError, StoppedBySignal,
                             TrainingStopped)


def apply_device_defaults(device: str) -> dict[str, str]:
    """Process settings that depend on ``trainer.device``; call once the configuration is known."""
    # Imported here, not at the top: grpo_npu.device imports torch, which must start after
    # env.apply_process_env_defaults() (the entry points import this module before calling it).
    from grpo_npu.device import DeviceError, resolve_kind

    try:
        kind = resolve_kind(device)
    except DeviceError:  # the trainer reports it, with its context
        return {}
    return env.retain_freed_host_memory() if kind == "cpu" else {}


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def exit_code(run: Callable[[], None]) -> int:
    """Run; bad configuration or input -> one line on stderr and 2; a run that stopped itself -> 1; stopped by
    signal N -> 128 + N (the checkpoint is saved first)."""
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
    except StoppedBySignal as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return EXIT_SIGNAL_BASE + exc.signum
    return EXIT_OK
