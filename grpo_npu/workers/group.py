"""Worker groups: the one interface the trainer uses to talk to its ranks, in-process or on Ray.

    group = RayGroup(HybridWorker, world_size=4, device_kind="cpu", args=(cfg,))   # or LocalGroup(...)
    group.call("init_model")                          # same arguments to every rank
    logps = group.chunk_and_call("compute_log_prob", batch)   # rank r gets chunk r of the batch
    group.close()

Every rank runs inside a :class:`RankHost`, which first joins the torch.distributed process group
(the device layer's backend: hccl / nccl / gloo) and then builds the worker object. A worker's
exception reaches the driver as :class:`WorkerError` naming the rank and method, with the worker's
traceback, as soon as the first rank fails (the other ranks may be stuck in a collective).

- :class:`LocalGroup`: one rank in this process (a world-size-1 process group), so the same code
  path runs without Ray.
- :class:`RayGroup`: one Ray actor per device (``trainer.nnodes x trainer.n_gpus_per_node``), each
  holding one device through Ray's ``NPU`` / ``GPU`` resource (CPU-only: one CPU each), placed with
  a PACK placement group so ranks fill nodes in order. ``ray.init`` joins ``RAY_ADDRESS`` when set
  (a real multi-node cluster), else starts a local one with ``ray_init.num_cpus``.
"""

from __future__ import annotations

import abc
import logging
import os
import socket
import traceback
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from grpo_npu.batch import RolloutBatch
from grpo_npu.device import get_device
from grpo_npu.workers.fsdp import destroy_distributed, free_port, init_distributed

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class WorkerError(RuntimeError):
    """A worker raised: carries the rank, the method and the worker-side traceback."""

    def __init__(self, rank: int, method: str, details: str):
        super().__init__(f"rank {rank} failed in {method}():\n{details}")
        self.rank = rank
        self.method = method
        self.details = details

    def __reduce__(self):  # picklable across the Ray boundary
        return (WorkerError, (self.rank, self.method, self.details))


class RankHost:
    """One rank: joins the process group, builds the worker, runs its methods by name."""

    def __init__(self, rank: int, world_size: int, device_kind: str):
        self.rank = rank
        self.world_size = world_size
        self.device_kind = device_kind
        self.worker: Any = None
        self.owns_process_group = False

    def address(self) -> tuple[str, int]:
        """(host IP, a free port) for the rendezvous; asked of rank 0."""
        ip = LOOPBACK if self.world_size == 1 else _node_ip()
        return ip, free_port()

    def node_id(self) -> str:
        return _node_id()

    def setup(self, master_addr: str, master_port: int, local_rank: int, worker_cls: type, args: tuple,
              kwargs: dict) -> None:
        """Select the local device, initialise torch.distributed, construct ``worker_cls(*args, **kwargs)``."""
        try:
            dev = get_device(self.device_kind)
            # vLLM's external launcher picks its device from LOCAL_RANK: the index among the visible devices
            os.environ["LOCAL_RANK"] = str(dev.bind_local_rank(local_rank))
            self.owns_process_group = init_distributed(dev, rank=self.rank, world_size=self.world_size,
                                                       master_addr=master_addr, master_port=master_port)
            self.worker = worker_cls(*args, **kwargs)
        except Exception:
            raise WorkerError(self.rank, f"{worker_cls.__name__}.__init__", traceback.format_exc()) from None

    def execute(self, method: str, args: tuple, kwargs: dict) -> Any:
        """Call ``worker.method(*args, **kwargs)``; failures become WorkerError with this rank's traceback."""
        try:
            fn = getattr(self.worker, method, None)
            if fn is None or method.startswith("_"):
                raise AttributeError(f"{type(self.worker).__name__} has no public method {method!r}")
            return fn(*args, **kwargs)
        except Exception:
            raise WorkerError(self.rank, method, traceback.format_exc()) from None

    def shutdown(self) -> None:
        """Close the worker and leave the process group (if this host created it)."""
        close = getattr(self.worker, "close", None)
        self.worker = None
        if close is not None:
            close()
        if self.owns_process_group:
            destroy_distributed()


def _node_ip() -> str:
    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def _node_id() -> str:
    if ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()


# ================================================================================================
# The interface
# ================================================================================================
class WorkerGroup(abc.ABC):
    """``world_size`` ranks running the same worker class; calls return one result per rank."""

    world_size: int

    @abc.abstractmethod
    def call_ranks(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """Rank r runs ``method(*per_rank_args[r], **kwargs)``; results in rank order."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Every rank runs ``method(*args, **kwargs)``; results in rank order."""
        return self.call_ranks(method, [args] * self.world_size, **kwargs)

    def chunk_and_call(self, method: str, batch: RolloutBatch, *args: Any, **kwargs: Any) -> list[Any]:
        """Split ``batch`` into world_size equal consecutive chunks; rank r gets chunk r (then ``args``)."""
        return self.call_ranks(method, [(chunk, *args) for chunk in batch.chunk(self.world_size)], **kwargs)

    @abc.abstractmethod
    def close(self) -> None:
        """Shut the workers down (idempotent)."""

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalGroup(WorkerGroup):
    """A single rank in this process, behind the same interface (no Ray)."""

    def __init__(self, worker_cls: type, *, device_kind: str = "auto", args: tuple = (), kwargs: dict | None = None):
        self.world_size = 1
        self.host = RankHost(0, 1, device_kind)
        addr, port = self.host.address()
        self.host.setup(addr, port, 0, worker_cls, args, kwargs or {})
        self.closed = False

    def call_ranks(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        if len(per_rank_args) != 1:
            raise ValueError(f"LocalGroup has 1 rank, got {len(per_rank_args)} argument tuples")
        if self.closed:
            raise RuntimeError("the worker group is closed")
        return [self.host.execute(method, tuple(per_rank_args[0]), kwargs)]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.host.shutdown()


class RayGroup(WorkerGroup):
    """One Ray actor per rank (per device), in a PACK placement group."""

    def __init__(
        self,
        worker_cls: type,
        *,
        world_size: int,
        device_kind: str = "auto",
        args: tuple = (),
        kwargs: dict | None = None,
        num_cpus_per_worker: float = 1,
        ray_num_cpus: int | None = None,
        start_timeout_s: float = 300,
    ):
        if world_size < 1:
            raise ValueError(f"RayGroup needs world_size >= 1, got {world_size}")
        self.world_size = world_size
        self.closed = False
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            address = os.environ.get("RAY_ADDRESS")
            # num_cpus only describes a cluster we start ourselves; an existing cluster has its own.
            ray.init(address=address, num_cpus=None if address else ray_num_cpus, ignore_reinit_error=True,
                     log_to_driver=True)
        dev = get_device(device_kind)
        resource = dev.ray_resource
        bundle: dict[str, float] = {"CPU": num_cpus_per_worker}
        if resource:
            bundle[resource] = 1
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=start_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(
                f"Ray could not place {world_size} workers with {bundle} each within {start_timeout_s:.0f}s "
                f"(cluster resources: {ray.cluster_resources()}); check trainer.nnodes x trainer.n_gpus_per_node"
            )
        options: dict[str, Any] = {"num_cpus": num_cpus_per_worker}
        if resource == "GPU":
            options["num_gpus"] = 1
        elif resource:
            options["resources"] = {resource: 1}
        remote_host = ray.remote(RankHost)
        self.actors = [
            remote_host.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote(r, world_size, dev.kind)
            for r in range(world_size)
        ]
        try:
            node_ids = self._gather([a.node_id.remote() for a in self.actors], "node_id")
            addr, port = self._gather([self.actors[0].address.remote()], "address")[0]
            local_ranks = [node_ids[:r].count(node_ids[r]) for r in range(world_size)]
            self._gather(
                [a.setup.remote(addr, port, local_ranks[r], worker_cls, args, kwargs or {}) for r, a in enumerate(self.actors)],
                "setup",
            )
        except BaseException:
            self.close()
            raise

    def _gather(self, refs: list, method: str) -> list[Any]:
        """Results in order; the first failing rank raises WorkerError at once."""
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, WorkerError):
                        raise WorkerError(cause.rank, cause.method, cause.details) from None
                    raise WorkerError(rank_of[ref], method, str(exc)) from None
                except ray.exceptions.RayActorError as exc:
                    raise WorkerError(rank_of[ref], method, f"the worker process died: {exc}") from None
        return ray.get(refs)

    def call_ranks(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"RayGroup has {self.world_size} ranks, got {len(per_rank_args)} argument tuples")
        if self.closed:
            raise RuntimeError("the worker group is closed")
        refs = [a.execute.remote(method, tuple(args), kwargs) for a, args in zip(self.actors, per_rank_args)]
        return self._gather(refs, method)

    def close(self, timeout_s: float = 60) -> None:
        if self.closed:
            return
        self.closed = True
        if ray.is_initialized():
            refs = [a.shutdown.remote() for a in getattr(self, "actors", [])]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for a in getattr(self, "actors", []):
                ray.kill(a)
            ray.util.remove_placement_group(self.pg)
            if self.owns_ray:
                ray.shutdown()
