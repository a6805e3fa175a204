"""Distributed workers: the FSDP2 actor / reference / critic, the hybrid per-rank worker, worker groups.

- :mod:`~grpo_npu.workers.group`: ``WorkerGroup`` (``LocalGroup`` in-process | ``RayGroup``), the
  trainer's handle on its ranks;
- :mod:`~grpo_npu.workers.hybrid`: ``HybridWorker``, one rank's actor + rollout + reference + critic;
- :mod:`~grpo_npu.workers.actor` / :mod:`~grpo_npu.workers.critic`: log-probs and values, and each one's
  loss and metrics for the update;
- :mod:`~grpo_npu.workers.update_loop`: the one update loop (mini/micro-batches, accumulation, clip,
  step, offload phases, metric reduction) the actor, the critic and SFT share;
- :mod:`~grpo_npu.workers.model_inputs` (padded / packed / shared-prompt inputs) and
  :mod:`~grpo_npu.workers.response_model` (the sharded models and how they are built);
- :mod:`~grpo_npu.workers.fsdp`: sharding, loading, weight streaming, checkpoints, offload;
- :mod:`~grpo_npu.workers.micro_batch` and :mod:`~grpo_npu.workers.optim`.

Importing this package imports neither Ray nor a model, nor torch: the config reads the torch-free
:mod:`~grpo_npu.workers.names` before torch loads; the worker groups load on first use.
"""

import importlib

_GROUP_NAMES = ("LocalGroup", "RayGroup", "WorkerError", "WorkerGroup")


def __getattr__(name: str):
    if name in _GROUP_NAMES:
        return getattr(importlib.import_module("grpo_npu.workers.group"), name)
    raise AttributeError(f"module 'grpo_npu.workers' has no attribute {name!r}")


__all__ = list(_GROUP_NAMES)
