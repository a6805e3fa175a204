"""The process group the workers join: mixed on accelerators, so host-side tensors have a backend too."""

from __future__ import annotations

import pytest

from grpo_npu.device import Device
from grpo_npu.workers import fsdp


@pytest.mark.parametrize("kind, backend", [("npu", "cpu:gloo,npu:hccl"), ("cuda", "cpu:gloo,cuda:nccl"),
                                           ("cpu", "gloo")])
def test_process_group_backend(monkeypatch, kind, backend):
    """Param/optimizer offload moves shards to the host between phases; hccl alone has no CPU collectives."""
    seen = {}
    monkeypatch.setattr(fsdp.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(fsdp.dist, "init_process_group", lambda **kw: seen.update(kw))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # set by init_distributed: restored after
        monkeypatch.setenv(key, "")
    assert fsdp.init_distributed(Device(kind), rank=1, world_size=2, master_addr="10.0.0.1", master_port=1234)
    assert seen == {"backend": backend, "init_method": "tcp://10.0.0.1:1234", "rank": 1, "world_size": 2}
