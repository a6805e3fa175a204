"""Distributed workers: the FSDP2 actor / reference / critic, the hybrid per-rank worker, worker groups.

- :mod:`~grpo_npu.workers.group`: ``WorkerGroup`` (``LocalGroup`` in-process | ``RayGroup``), the
  trainer's handle on its ranks;
- :mod:`~grpo_npu.workers.hybrid`: ``HybridWorker``, one rank's actor + rollout + reference + critic;
- :mod:`~grpo_npu.workers.actor` / :mod:`~grpo_npu.workers.critic`: log-probs, values and updates;
- :mod:`~grpo_npu.workers.fsdp`: sharding, loading, weight streaming, checkpoints, offload;
- :mod:`~grpo_npu.workers.micro_batch` and :mod:`~grpo_npu.workers.optim`.

Importing this package imports neither Ray nor a model.
"""

from grpo_npu.workers.group import LocalGroup, RayGroup, WorkerError, WorkerGroup

__all__ = ["LocalGroup", "RayGroup", "WorkerError", "WorkerGroup"]
