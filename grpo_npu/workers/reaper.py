"""Ray's processes die with the driver that started them, however the driver ends (kill -9 included).

``ray.init`` starts a local cluster (GCS server, raylet, dashboard, log monitor; the raylet then starts
the worker processes) in the driver's process group. A driver that exits normally shuts it down; one killed
with SIGKILL leaves it running, holding memory and devices. :func:`start_reaper` starts a small watcher in
its own session (so a process-group signal does not take it down first) that polls the driver and, once the
driver is gone, kills the cluster's processes and everything they started.

Run as ``python -m grpo_npu.workers.reaper DRIVER_PID PID [PID ...]``; the standard library only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the watcher checks that the driver is alive


def start_reaper(driver_pid: int, pids: list[int]) -> subprocess.Popen | None:
    """Watch ``driver_pid``; when it is gone, kill ``pids`` and their descendants. None when nothing to watch."""
    if not pids:
        return None
    return subprocess.Popen([sys.executable, "-m", "grpo_npu.workers.reaper", str(driver_pid), *map(str, pids)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def started_ray_node():
    """The Ray node (``ray._private.node.Node``) this driver started; None when it joined an existing cluster."""
    import ray  # an optional dependency: only RayGroup calls this, with ray imported

    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    return node if getattr(node, "head", False) else None


def ray_node_pids() -> list[int]:
    """The processes of the Ray node this driver started (empty when it joined an existing cluster)."""
    node = started_ray_node()
    if node is None:
        return []
    return [info.process.pid for infos in node.all_processes.values() for info in infos]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (Linux /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop(0)
        if pid not in out:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc stat field 22): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def snapshot(pids: list[int]) -> dict[int, int | None]:
    """``pids`` and their descendants, each with its start time (see :func:`kill_snapshot`)."""
    return {pid: start_time(pid) for pid in descendants(pids)}


def kill_snapshot(tree: dict[int, int | None]) -> None:
    """SIGKILL every process of ``tree`` still running: the same pid with the same start time (not a reused pid)."""
    for pid, started in tree.items():
        if started is not None and start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def watch(driver_pid: int, pids: list[int]) -> None:
    """Poll the driver; meanwhile keep a snapshot of the cluster's process tree (when the driver dies the kernel
    may kill the raylet first, orphaning its agents, so the tree must be known before); then kill the snapshot."""
    tree: dict[int, int | None] = {}
    while alive(driver_pid):
        tree = snapshot(pids)
        time.sleep(POLL_S)
    for pid, started in snapshot(pids).items():  # whatever is still attached
        tree.setdefault(pid, started)
    kill_snapshot(tree)


if __name__ == "__main__":
    watch(int(sys.argv[1]), [int(p) for p in sys.argv[2:]])
