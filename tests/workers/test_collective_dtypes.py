"""No float64 tensor in any collective of the log-prob, value and update paths (HCCL has no fp64 all-reduce).

Two gloo ranks in spawned processes build every role (actor, reference, critic) and run the old-policy,
reference and value passes, an actor update with old log-probs, one that takes them from its own
forward, a critic update and an SFT step, while every collective is recorded twice over: the
``torch.distributed`` and functional-collective Python functions are wrapped (this catches DTensor's
collectives, issued inside its own dispatch), and a dispatch mode sees every ``c10d`` op (this catches
callers that bound a collective function before it was wrapped, FSDP's all-gathers included).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from ..spawn import run_ranks
from .helpers import make_batch, make_cfg

WORLD_SIZE = 2
TIMEOUT_S = 300  # a rank stuck in a mismatched collective must not hang the suite

# The collective entry points of each module that are wrapped (names a torch version lacks are skipped).
C10D_NAMES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
              "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "reduce",
              "broadcast", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv")
FUNCOL_NAMES = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
                "all_gather_single", "all_gather_inplace", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                "reduce_scatter_tensor_autograd", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
                "all_to_all_single", "broadcast")
DISPATCH_NAMESPACES = ("c10d", "_c10d_functional")


def _dtypes(obj) -> list[str]:
    """dtypes of every tensor in nested args / kwargs."""
    if isinstance(obj, torch.Tensor):
        return [str(obj.dtype).removeprefix("torch.")]
    if isinstance(obj, (list, tuple)):
        return [d for x in obj for d in _dtypes(x)]
    if isinstance(obj, dict):
        return [d for x in obj.values() for d in _dtypes(x)]
    return []


class CollectiveRecorder(TorchDispatchMode):
    """Records (phase, collective, dtypes) for every collective while active; ``phase`` labels the records."""

    def __init__(self):
        super().__init__()
        self.phase = "setup"
        self.records: list[tuple[str, str, list[str]]] = []
        self._saved: list[tuple[object, str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in DISPATCH_NAMESPACES:
            self.records.append((self.phase, f"op:{func}", _dtypes((args, kwargs))))
        return func(*args, **kwargs)

    def _wrap(self, module, name: str) -> None:
        real = getattr(module, name, None)
        if real is None:
            return

        @functools.wraps(real)
        def recording(*args, **kwargs):
            self.records.append((self.phase, f"{module.__name__}.{name}", _dtypes((args, kwargs))))
            return real(*args, **kwargs)

        self._saved.append((module, name, real))
        setattr(module, name, recording)

    def __enter__(self):
        for module, names in ((dist, C10D_NAMES), (c10d, C10D_NAMES), (funcol, FUNCOL_NAMES)):
            for name in names:
                self._wrap(module, name)
        return super().__enter__()

    def __exit__(self, *exc):
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()
        return super().__exit__(*exc)


def _rank_main(rank: int, model_path: str, port: int, out_dir: str) -> None:
    """One rank: every role, every pass and update under the recorder; records written as JSON."""
    from grpo_npu.device import get_device
    from grpo_npu.sft import sft_step
    from grpo_npu.workers import fsdp
    from grpo_npu.workers.hybrid import HybridWorker

    torch.set_num_threads(1)
    fsdp.init_distributed(get_device("cpu"), rank=rank, world_size=WORLD_SIZE, master_addr="127.0.0.1",
                          master_port=port)
    recorder = CollectiveRecorder()
    try:
        with recorder:
            recorder.phase = "probe"  # proves the recorder sees a float64 all-reduce
            dist.all_reduce(torch.zeros(1, dtype=torch.float64))
            recorder.phase = "build"
            cfg = make_cfg(model_path, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=True",
                           "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.use_dynamic_bsz=True",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",
                           "actor_rollout_ref.model.use_remove_padding=True", "critic.use_dynamic_bsz=False",
                           "critic.ppo_micro_batch_size_per_gpu=2", world_size=WORLD_SIZE)
            worker = HybridWorker(cfg, with_rollout=False)
            worker.init_model(10)
            rows = make_batch(seed=40)
            batch = rows.select(list(range(rank * len(rows) // WORLD_SIZE, (rank + 1) * len(rows) // WORLD_SIZE)))
            mask = batch.response_mask
            recorder.phase = "log_prob"
            old_logp, _, _ = worker.compute_log_prob(batch)
            ref_logp = worker.compute_ref_log_prob(batch)
            values = worker.compute_values(batch)
            returns = (torch.linspace(-1, 1, mask.shape[1]) * mask).contiguous()
            train = batch.replace(ref_logp=ref_logp - 0.05 * mask, rollout_logp=old_logp + 0.01 * mask, values=values,
                                  returns=returns)
            recorder.phase = "update_actor"
            worker.update_actor(train.replace(old_logp=old_logp))
            recorder.phase = "update_actor_old_logp_from_update"
            worker.update_actor(train)
            recorder.phase = "update_critic"
            worker.update_critic(train)
            recorder.phase = "sft_step"
            sft_step(worker.actor, batch)
    finally:
        fsdp.destroy_distributed()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(recorder.records))


def _run_two_ranks(model_path: str, out_dir: Path) -> list[list]:
    from grpo_npu.workers.fsdp import free_port

    run_ranks(_rank_main, (model_path, free_port(), str(out_dir)), WORLD_SIZE, TIMEOUT_S, f"the {WORLD_SIZE}-rank run")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def test_no_float64_in_any_collective(tiny_model_path, tmp_path):
    for records in _run_two_ranks(tiny_model_path, tmp_path):
        probe = [r for r in records if r[0] == "probe"]
        assert probe and all("float64" in dtypes for _, _, dtypes in probe), probe
        wide = [r for r in records if r[0] != "probe" and "float64" in r[2]]
        assert not wide, f"float64 collectives: {wide[:5]}"
        seen = {(phase, dtype) for phase, _, dtypes in records for dtype in dtypes}
        for phase in ("update_actor", "update_actor_old_logp_from_update", "update_critic", "sft_step"):
            # metric sums in float32, global token counts in int64: the loop's own reductions were seen
            assert {(phase, "float32"), (phase, "int64")} <= seen, phase
        names = {name for _, name, _ in records}
        assert any("allgather" in n or "all_gather" in n for n in names)  # FSDP's parameter gathers
        assert any(n.startswith("torch.distributed._functional_collectives.") for n in names)  # DTensor's
