"""An optimizer other than AdamW on FSDP2 shards: torch.optim.SGD with momentum (its buffers DTensors like the
parameters) over two gloo ranks ends two updates with the weights one unsharded rank reaches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ..spawn import run_ranks
from .helpers import full_weights, make_batch, make_cfg, make_worker

WORLD_SIZE = 2
TIMEOUT_S = 300
SGD = ("actor_rollout_ref.actor.optim.optimizer=SGD", "+actor_rollout_ref.actor.optim.override_optimizer_config.momentum=0.9",
       "actor_rollout_ref.actor.optim.eps=null", "actor_rollout_ref.actor.optim.lr=0.05")


def _updates(worker, batch, steps: int = 2) -> None:
    old_logp, _, _ = worker.compute_log_prob(batch)
    for _ in range(steps):
        worker.update_actor(batch.replace(old_logp=old_logp))


def _rank_main(rank: int, model_path: str, port: int, out: str) -> None:
    from grpo_npu.device import get_device
    from grpo_npu.workers import fsdp
    from grpo_npu.workers.hybrid import HybridWorker

    torch.set_num_threads(1)
    fsdp.init_distributed(get_device("cpu"), rank=rank, world_size=WORLD_SIZE, master_addr="127.0.0.1",
                          master_port=port)
    try:
        worker = HybridWorker(make_cfg(model_path, *SGD, world_size=WORLD_SIZE), with_rollout=False)
        worker.init_model(10)
        assert isinstance(worker.actor.loop.optimizer, torch.optim.SGD)
        rows = make_batch(seed=42)
        _updates(worker, rows.select(list(range(rank * 4, rank * 4 + 4))))
        weights = full_weights(worker.actor.module)
        if rank == 0:
            torch.save(weights, out)
    finally:
        fsdp.destroy_distributed()


@pytest.mark.usefixtures("process_group")
def test_sgd_with_momentum_on_two_ranks_equals_one_rank(tiny_model_path, tmp_path):
    from grpo_npu.workers.fsdp import free_port

    out = tmp_path / "two_ranks.pt"
    run_ranks(_rank_main, (tiny_model_path, free_port(), str(out)), WORLD_SIZE, TIMEOUT_S, "the 2-rank SGD run")
    one = make_worker(make_cfg(tiny_model_path, *SGD))
    initial = full_weights(one.actor.module)
    _updates(one, make_batch(seed=42))
    want, got = full_weights(one.actor.module), torch.load(Path(out))
    assert max(float((want[k] - initial[k]).abs().max()) for k in want) > 1e-3  # the steps moved the weights
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-6, rtol=1e-5, msg=name)
