"""Run a function on several gloo ranks in spawned processes, failing the test (not hanging it) past a deadline."""

from __future__ import annotations

import time
from typing import Callable

import pytest
import torch.multiprocessing as mp


def run_ranks(fn: Callable, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """``fn(rank, *args)`` on ``nprocs`` spawned processes; a rank that raises fails the test with its error, and a
    run past ``timeout_s`` (a rank stuck in a mismatched collective) is killed and fails it."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish in {timeout_s} s")
