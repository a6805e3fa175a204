"""``fsdp_config.use_no_sync_for_gradient_accumulation`` (actor; the critic shares the update loop): two gloo
ranks, four micro-batches each. With it on the update reduce-scatters gradients once instead of once per
micro-batch, and ends with the same weights and metrics as with it off."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..spawn import run_ranks
from .helpers import full_weights, make_batch, make_cfg

WORLD_SIZE = 2
TIMEOUT_S = 300


class _ReduceScatters(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "reduce_scatter" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _rank_main(rank: int, model_path: str, port: int, out_dir: str) -> None:
    from grpo_npu.device import get_device
    from grpo_npu.workers import fsdp
    from grpo_npu.workers.hybrid import HybridWorker

    torch.set_num_threads(1)
    fsdp.init_distributed(get_device("cpu"), rank=rank, world_size=WORLD_SIZE, master_addr="127.0.0.1",
                          master_port=port)
    out = {}
    try:
        rows = make_batch(seed=41)
        batch = rows.select(list(range(rank * len(rows) // WORLD_SIZE, (rank + 1) * len(rows) // WORLD_SIZE)))
        for defer in (False, True):
            cfg = make_cfg(model_path, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                           f"actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation={defer}",
                           world_size=WORLD_SIZE)
            worker = HybridWorker(cfg, with_rollout=False)
            worker.init_model(10)
            old_logp, _, _ = worker.compute_log_prob(batch)
            with _ReduceScatters() as seen:
                metrics = worker.update_actor(batch.replace(old_logp=old_logp))
            weights = full_weights(worker.actor.module)
            out[str(defer)] = {"reduce_scatters": seen.count, "metrics": metrics,
                               "weights": {k: v.flatten()[:64].tolist() for k, v in weights.items()},
                               "micro_batches": len(batch)}
    finally:
        fsdp.destroy_distributed()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def test_one_gradient_reduction_per_step_and_the_same_update(tiny_model_path, tmp_path):
    from grpo_npu.workers.fsdp import free_port

    run_ranks(_rank_main, (tiny_model_path, free_port(), str(tmp_path)), WORLD_SIZE, TIMEOUT_S, "the 2-rank run")
    for rank in range(WORLD_SIZE):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        every, once = res["False"], res["True"]
        assert every["micro_batches"] == 4
        assert once["reduce_scatters"] > 0 and every["reduce_scatters"] == 4 * once["reduce_scatters"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac"):
            assert abs(once["metrics"][key] - every["metrics"][key]) <= 1e-6 + 1e-5 * abs(every["metrics"][key]), key
        for name, w in every["weights"].items():
            torch.testing.assert_close(torch.tensor(once["weights"][name]), torch.tensor(w), atol=1e-7, rtol=0,
                                       msg=name)
