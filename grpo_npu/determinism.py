"""``trainer.deterministic=True``: the settings under which the same inputs give the same bits, run after run.

Seeds are fixed whether or not the preset is on (``trainer.seed`` for model init and every worker RNG,
``data.seed`` for the prompt order, ``actor_rollout_ref.rollout.seed`` for the engine, vLLM's included, with one
seed per prompt and step), so a plain run already samples reproducibly as far as its kernels allow. The
preset adds what the kernels need:

- ``DETERMINISTIC_ENV``, read by libraries when they create their handles and communicators: set by the entry
  point before torch starts (:func:`set_deterministic_env`, inherited by Ray workers and the engine) and again
  by each worker before it builds its models;
- :func:`make_deterministic` in each worker process: ``torch.use_deterministic_algorithms(True)`` (an op with
  no deterministic kernel then raises instead of varying), cuDNN's deterministic mode without autotuning.

What it cannot fix: a different device, library version or number of ranks still changes reduction orders
(docs/parity.md: replay the rollouts and compare the training side within a tolerance).
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping

log = logging.getLogger(__name__)

DETERMINISTIC_ENV = {
    # cuBLAS: a fixed workspace configuration, without which torch's deterministic mode refuses cuBLAS GEMMs
    # on CUDA >= 10.2 (torch's reproducibility notes).
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    # HCCL (Ascend): all-reduce / reduce-scatter in a fixed reduction order.
    "HCCL_DETERMINISTIC": "true",
    # vllm-ascend's LCCL collectives likewise.
    "LCCL_DETERMINISTIC": "1",
    # Child processes: a fixed str hash, so set and dict orders built from strings repeat.
    "PYTHONHASHSEED": "0",
}


def set_deterministic_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put DETERMINISTIC_ENV into ``environ`` (os.environ); returns the variables changed. A different value
    already there is replaced, and said so: the preset is what the user asked for."""
    environ = os.environ if environ is None else environ
    changed = {k: v for k, v in DETERMINISTIC_ENV.items() if environ.get(k) != v}
    for key, value in changed.items():
        if key in environ:
            log.warning("trainer.deterministic=True: %s=%s replaced by %s", key, environ[key], value)
        environ[key] = value
    return changed


def make_deterministic() -> None:
    """This process: DETERMINISTIC_ENV, deterministic torch algorithms, cuDNN without autotuning."""
    import torch  # here, so that the entry point can import this module before torch starts

    set_deterministic_env()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
