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
  holding one device through Ray's ``NPU`` / ``GPU`` resource (CPU-only: one CPU each). ``nnodes``
  means nodes: a STRICT_SPREAD placement group holds one bundle per node (that node's devices and
  CPUs), so no two bundles share a node; rank r runs in bundle r // n_gpus_per_node, and the bundle on
  the driver's node (if any) holds ranks 0.. so rank 0's files land beside the driver's. A cluster with
  fewer fitting nodes than ``nnodes`` is refused in one line. ``ray.init`` joins ``RAY_ADDRESS`` when
  set (a real multi-node cluster), else starts a local one with ``ray_init.num_cpus``.
"""

from __future__ import annotations

import abc
import datetime
import logging
import os
import signal
import socket
import time
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from grpo_npu.batch import RolloutBatch
from grpo_npu.errors import StepTimeout, UserError, WorkerError
from grpo_npu.device import get_device
from grpo_npu.workers.fsdp import destroy_distributed, free_port, init_distributed
from grpo_npu.workers.reaper import kill_snapshot, ray_node_pids, snapshot, start_reaper, started_ray_node

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# How long close() lets the workers shut down (close engines, leave the process group) before killing them:
# a rank that is hung or stopped must not hold the driver's exit for long.
CLOSE_TIMEOUT_S = 15.0


class RankHost:
    """One rank: joins the process group, builds the worker, runs its methods by name."""

    def __init__(self, rank: int, world_size: int, device_kind: str, pg_timeout_s: float | None = None):
        self.rank = rank
        self.pg_timeout_s = pg_timeout_s  # a collective waits this long before the process group fails
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
            timeout = datetime.timedelta(seconds=self.pg_timeout_s) if self.pg_timeout_s else None
            self.owns_process_group = init_distributed(dev, rank=self.rank, world_size=self.world_size,
                                                       master_addr=master_addr, master_port=master_port, timeout=timeout)
            self.worker = worker_cls(*args, **kwargs)
        except Exception as exc:
            raise WorkerError.from_exception(self.rank, f"{worker_cls.__name__}.__init__", exc) from None

    def execute(self, method: str, args: tuple, kwargs: dict) -> Any:
        """Call ``worker.method(*args, **kwargs)``; failures become WorkerError with this rank's traceback."""
        try:
            fn = getattr(self.worker, method, None)
            if fn is None or method.startswith("_"):
                raise AttributeError(f"{type(self.worker).__name__} has no public method {method!r}")
            return fn(*args, **kwargs)
        except Exception as exc:
            raise WorkerError.from_exception(self.rank, method, exc) from None

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


def _shutdown_own_cluster() -> None:
    """``ray.shutdown()`` of the local cluster this driver started, its processes stopped with SIGKILL at once.

    They run with SIGTERM blocked (RayGroup.__init__), so Ray's graceful stop, SIGTERM and up to 1 s for each of
    its five processes before SIGKILL, only waited: 5 s at the end of every run. SIGKILL is where that stop
    ended anyway. The raylet's agents (dashboard, runtime env) outlive a raylet killed at once, so whatever of
    the cluster's process tree still runs afterwards is killed too, as the reaper would. Where this Ray keeps
    its node elsewhere, its graceful stop runs as before.
    """
    tree = snapshot(ray_node_pids())
    node = started_ray_node()
    kill_all = getattr(type(node), "kill_all_processes", None)
    if node is not None and kill_all is not None:
        def kill_at_once(check_alive: bool = True, allow_graceful: bool = False, wait: bool = False) -> None:
            kill_all(node, check_alive=check_alive, allow_graceful=False, wait=wait)

        node.kill_all_processes = kill_at_once
    ray.shutdown()
    kill_snapshot(tree)


def _reserve_nodes(nnodes: int, node_bundle: dict[str, float], timeout_s: float) -> Any:
    """A ready STRICT_SPREAD placement group of ``nnodes`` bundles, one per node; one line when it cannot be."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    fit = [n for n in alive if all(n["Resources"].get(k, 0) >= v for k, v in node_bundle.items())]
    if len(fit) < nnodes:  # Ray would wait for nodes that are not there
        raise UserError(
            f"trainer.nnodes={nnodes} needs {nnodes} Ray nodes with {node_bundle} each, but the cluster has "
            f"{len(fit)} such node(s) ({len(alive)} alive): join more with `ray start --address=...`, point "
            "RAY_ADDRESS at the cluster, or lower trainer.nnodes / trainer.n_gpus_per_node")
    pg = placement_group([dict(node_bundle) for _ in range(nnodes)], strategy="STRICT_SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        free = ray.available_resources()
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not place {nnodes} bundle(s) of {node_bundle}, one per node, within {timeout_s:.0f}s "
            f"(free in the cluster: {free}); check trainer.nnodes x trainer.n_gpus_per_node and what else "
            "holds the cluster's devices")
    return pg


def _driver_node_first(pg: Any, nnodes: int) -> list[int]:
    """The placement group's bundle indices, the one on the driver's node (if any) first."""
    where = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    here = ray.get_runtime_context().get_node_id()
    return sorted(range(nnodes), key=lambda b: where[b] != here)


# ================================================================================================
# The interface
# ================================================================================================
class WorkerGroup(abc.ABC):
    """``world_size`` ranks running the same worker class; calls return one result per rank.

    ``deadline`` (monotonic seconds, set by the trainer per step): a call still waiting for ranks then raises
    StepTimeout naming the method and those ranks. An in-process group cannot interrupt its own rank: the
    trainer's watchdog thread covers it.
    """

    world_size: int
    deadline: float | None = None

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

    def __init__(self, worker_cls: type, *, device_kind: str = "auto", args: tuple = (), kwargs: dict | None = None,
                 pg_timeout_s: float | None = None):
        self.world_size = 1
        self.host = RankHost(0, 1, device_kind, pg_timeout_s)
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
    """One Ray actor per rank (per device); each node's ranks share one bundle of a STRICT_SPREAD placement group.

    ``node_ids[r]`` is the Ray node id rank r runs on.
    """

    def __init__(
        self,
        worker_cls: type,
        *,
        world_size: int,
        nnodes: int = 1,
        device_kind: str = "auto",
        args: tuple = (),
        kwargs: dict | None = None,
        num_cpus_per_worker: float = 1,
        ray_num_cpus: int | None = None,
        ray_runtime_env: dict | None = None,
        pg_timeout_s: float | None = None,
        timeline_json_file: str | None = None,
        start_timeout_s: float = 300,
    ):
        if world_size < 1 or nnodes < 1 or world_size % nnodes:
            raise ValueError(f"RayGroup needs world_size >= 1 split evenly over nnodes >= 1, got {world_size} "
                             f"over {nnodes}")
        self.world_size = world_size
        self.closed = False
        self.timeline_json_file = timeline_json_file  # ray.timeline() written here on close
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            address = os.environ.get("RAY_ADDRESS")
            # num_cpus only describes a cluster we start ourselves; an existing cluster has its own. Without
            # RAY_ADDRESS a new local cluster is started ("local"), never one some other job left running here.
            # The cluster's processes start with SIGTERM blocked (Ray itself blocks SIGINT there): a signal to the
            # whole process group (a scheduler's, Ctrl-C) reaches the driver alone, which finishes the step,
            # checkpoints and shuts the cluster down itself; the reaper covers a driver that dies instead.
            unblock = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                runtime_env = {k: v for k, v in (ray_runtime_env or {}).items() if v is not None} or None
                ray.init(address=address or "local", num_cpus=None if address else ray_num_cpus,
                         runtime_env=runtime_env, ignore_reinit_error=True, log_to_driver=True)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, unblock)
            self.reaper = start_reaper(os.getpid(), ray_node_pids())  # the cluster dies with this driver
        dev = get_device(device_kind)
        resource = dev.ray_resource
        per_node = world_size // nnodes
        node_bundle: dict[str, float] = {"CPU": num_cpus_per_worker * per_node}
        if resource:
            node_bundle[resource] = per_node
        try:
            self.pg = _reserve_nodes(nnodes, node_bundle, start_timeout_s)
        except BaseException:
            if self.owns_ray:
                _shutdown_own_cluster()
                self._stop_reaper()
            raise
        options: dict[str, Any] = {"num_cpus": num_cpus_per_worker}
        if resource == "GPU":
            options["num_gpus"] = 1
        elif resource:
            options["resources"] = {resource: 1}
        remote_host = ray.remote(RankHost)
        bundles = _driver_node_first(self.pg, nnodes)
        self.actors = [
            remote_host.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=bundles[r // per_node]),
            ).remote(r, world_size, dev.kind, pg_timeout_s)
            for r in range(world_size)
        ]
        try:
            self.node_ids: list[str] = self._gather([a.node_id.remote() for a in self.actors], "node_id")
            addr, port = self._gather([self.actors[0].address.remote()], "address")[0]
            local_ranks = [self.node_ids[:r].count(self.node_ids[r]) for r in range(world_size)]
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
            wait_s = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
            done, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not done:  # the deadline passed with ranks still working (hung, stopped, or their node gone)
                ranks = sorted(rank_of[ref] for ref in pending)
                raise StepTimeout(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} did not answer "
                                  f"{method}() before the step deadline (trainer.step_timeout_s); no checkpoint of "
                                  "this step")
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, WorkerError):
                        raise WorkerError(cause.rank, cause.method, cause.details, cause.summary,
                                          cause.user_error, cause.stopped) from None
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

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        if self.closed:
            return
        self.closed = True
        if ray.is_initialized():
            refs = [a.shutdown.remote() for a in getattr(self, "actors", [])]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            if self.timeline_json_file:  # ray_init.timeline_json_file: the run's tasks, for chrome://tracing
                ray.timeline(filename=self.timeline_json_file)
                log.info("Ray timeline written to %s", self.timeline_json_file)
            for a in getattr(self, "actors", []):
                ray.kill(a)
            ray.util.remove_placement_group(self.pg)
            if self.owns_ray:
                _shutdown_own_cluster()
        self._stop_reaper()

    def _stop_reaper(self) -> None:
        """The cluster is down: nothing left to watch over (and its pids must not be killed once reused)."""
        if getattr(self, "reaper", None) is not None:
            self.reaper.kill()
            self.reaper.wait()
            self.reaper = None
