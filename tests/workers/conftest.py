"""Fixtures for the worker tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def process_group():
    """A world-size-1 gloo process group for in-process workers (left up for the module, then torn down)."""
    from grpo_npu.workers import fsdp

    from .helpers import start_process_group

    created = start_process_group()
    yield
    if created:
        fsdp.destroy_distributed()


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One intra-op thread: these tiny models run fastest that way, and a 2-core machine shared with
    other test processes otherwise spends most of its time in spinning OpenMP workers (measured: an
    8-micro-batch update 0.09 s with one thread, 0.5-7 s with two under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
