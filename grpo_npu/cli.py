"""What the command-line entry points share: logging set-up, process settings, and errors mapped to exit codes.

The environment defaults themselves live in :mod:`grpo_npu.env`, the error types and exit codes in
:mod:`grpo_npu.errors`. Importing this module does not import torch (the entry points import it first).
"""

from __future__ import annotations

import signal
import sys
import traceback
from typing import Callable

from grpo_npu import env
from grpo_npu.errors import (EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_SIGNAL_BASE, EXIT_STOPPED, ConfigError,
                             StoppedBySignal, TrainingStopped, WorkerError)
from grpo_npu.logs import current_log, debug_mode

# The exit-code table (README "What happens when things go wrong"):
#   0 complete | 1 stopped by policy (bad steps, too many failed rewards) | 2 bad input (one line naming the
#   key/file/row) | 3 internal error (one line; traceback in the run's train.log) | 128 + N stopped by signal N.


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


def exit_code(run: Callable[[], None]) -> int:
    """Run; every error leaves as one line on stderr and an exit code (the table above)."""
    try:
        run()
    except KeyboardInterrupt:  # SIGINT while the training loop does not handle it (start-up, loading, closing)
        print("stopped: SIGINT while the run was starting or closing (outside a training step)", file=sys.stderr)
        return EXIT_SIGNAL_BASE + signal.SIGINT
    except Exception as exc:  # noqa: BLE001 - every error leaves as one line and an exit code
        return _report(exc)
    return EXIT_OK


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _report(exc: Exception) -> int:
    """One line on stderr for ``exc`` and its exit code; the traceback goes to the run log (and the console
    with GRPO_NPU_DEBUG=1)."""
    if debug_mode():
        traceback.print_exception(exc)
    where = current_log()
    more = f" (traceback in {where}; GRPO_NPU_DEBUG=1 shows it here)" if where else " (GRPO_NPU_DEBUG=1 shows the traceback)"
    if isinstance(exc, WorkerError):  # raised on a rank: its own exception, one line
        if exc.user_error:
            print(f"error: {exc.summary.split(': ', 1)[-1]}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if exc.stopped:  # the rank stopped the run by policy (e.g. the weight-sync canary)
            print(f"stopped: rank {exc.rank}: {exc.summary.split(': ', 1)[-1]}", file=sys.stderr)
            return EXIT_STOPPED
        print(f"internal error: rank {exc.rank} in {exc.method}(): {exc.summary}{more}", file=sys.stderr)
        return EXIT_INTERNAL
    if isinstance(exc, ConfigError):
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if isinstance(exc, (OSError, ValueError)):  # missing files, unloadable model paths, bad data rows, a full disk
        print(f"error: {_first_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if isinstance(exc, TrainingStopped):
        print(f"stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    if isinstance(exc, StoppedBySignal):
        print(f"stopped: {exc}", file=sys.stderr)
        return EXIT_SIGNAL_BASE + exc.signum
    print(f"internal error: {type(exc).__name__}: {_first_line(exc)}{more}", file=sys.stderr)
    return EXIT_INTERNAL
