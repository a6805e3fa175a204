"""Process-environment defaults: the variables torch and glibc read when a process starts.

The entry points call :func:`apply_process_env_defaults` before anything imports torch, and
:func:`retain_freed_host_memory` once the configuration says the run is on CPU (see
:func:`grpo_npu.cli.apply_device_defaults`); :mod:`grpo_npu.preflight` checks the same variables.
Standard library only, so that importing it never loads torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any, MutableMapping

log = logging.getLogger(__name__)

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
        log.debug("torch was imported before grpo_npu's entry point: %s applies to child processes only (export it "
                 "before starting Python to cover this one)", ", ".join(f"{k}={v}" for k, v in missing.items()))
    return missing


# glibc malloc settings for runs on CPU (trainer.device=cpu), read by each process when it starts. By default
# glibc serves every buffer above its mmap threshold (128 KB, adapting up to 32 MB) with a fresh mapping and
# unmaps it on free, so the gigabytes a training step allocates and frees come back as new pages each time:
# page faults, zeroing and (with huge pages) compaction, all system time. With no mmap and a high trim
# threshold the process keeps freed memory and reuses it. Measured on the 0.5B shape (2 cores): the update
# went from 9.8-12.1 s (7-9 s of it system time) to 5.3-8.4 s; peak RSS rose from 12.2 to 14.8-16.4 GB.
# Accelerator runs are left alone: their host memory peaks (checkpoint gathers, weight offload) should go back.
_TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: the top of the heap is trimmed only past 2 GiB free
CPU_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(_TRIM_THRESHOLD_BYTES)}
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt() parameter numbers (glibc's malloc.h)


def cpu_malloc_defaults(environ: MutableMapping[str, str], libc: Any = None) -> dict[str, str]:
    """Add CPU_MALLOC_ENV to ``environ`` for processes started with it; returns what was set.

    Nothing where the C library is not glibc, or where the user set either variable (their malloc tuning
    is kept whole).
    """
    if any(key in environ for key in CPU_MALLOC_ENV) or (_glibc() if libc is None else libc) is None:
        return {}
    environ.update(CPU_MALLOC_ENV)
    return dict(CPU_MALLOC_ENV)


def retain_freed_host_memory(environ: MutableMapping[str, str] | None = None, libc: Any = None) -> dict[str, str]:
    """Apply CPU_MALLOC_ENV to child processes (through ``environ``) and to this one (through ``mallopt``)."""
    libc = _glibc() if libc is None else libc
    added = cpu_malloc_defaults(os.environ if environ is None else environ, libc)
    if not added:
        return added
    if not (libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1):
        log.info("mallopt refused the CPU malloc settings; child processes still get %s",
                 ", ".join(f"{k}={v}" for k, v in added.items()))
    return added


def _glibc() -> Any:
    """This process's C library when it is glibc (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None
