"""What the command-line entry points share: logging set-up and the mapping of errors to exit codes."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, MutableMapping

from grpo_npu.config import ConfigError

EXIT_OK, EXIT_STOPPED, EXIT_BAD_INPUT = 0, 1, 2

# Process environment the entry points set before torch is imported; a variable already set is kept.
PROCESS_ENV_DEFAULTS = {
    # torch's CPU allocator (c10 alloc_cpu) reads this once, at its first allocation: tensors of 2 MB and more
    # are then page-aligned and madvise(MADV_HUGEPAGE)d, so a fresh buffer faults in 2 MB pages instead of
    # 4 KB ones. A training step allocates and frees gigabytes of such buffers (FSDP's unsharded parameters
    # and gradients, activations, logits chunks): measured 3M -> 55k page faults and 20 s -> 16 s per update
    # of the 0.5B shape on the 2-core CPU. PyTorch's CPU tuning guides recommend it; it is off in torch by
    # default because it slightly raises memory use. Only host memory is affected. Set it to 0 to opt out.
    "THP_MEM_ALLOC_ENABLE": "1",
}


def apply_process_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the PROCESS_ENV_DEFAULTS that ``environ`` (os.environ) lacks; returns what was set.

    Child processes (Ray workers, vLLM's) inherit them. Torch reads them when it starts, so for this process
    they count only if it runs before ``import torch``, as the entry points do; otherwise it says so.
    """
    environ = os.environ if environ is None else environ
    missing = {k: v for k, v in PROCESS_ENV_DEFAULTS.items() if k not in environ}
    environ.update(missing)
    if missing and "torch" in sys.modules:
        logging.getLogger(__name__).info(
            "torch was imported before grpo_npu's entry point: %s applies to child processes only (export it "
            "before starting Python to cover this one)", ", ".join(f"{k}={v}" for k, v in missing.items()))
    return missing


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
