"""Fixtures for the worker tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def process_group():
    """A world-size-1 gloo process group for in-process workers (left up for the module, then torn down)."""
    from grpo_npu.device import get_device
    from grpo_npu.workers import fsdp

    created = fsdp.init_distributed(get_device("cpu"), rank=0, world_size=1, master_addr="127.0.0.1",
                                    master_port=fsdp.free_port())
    yield
    if created:
        fsdp.destroy_distributed()
