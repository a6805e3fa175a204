"""The LOCAL_RANK a worker exports is the one vLLM's external launcher needs: its device among the visible ones."""

from __future__ import annotations

import os

import pytest

from grpo_npu import device as D
from grpo_npu.workers import group as G


class _OneVisibleNpu:
    """torch.npu inside a Ray actor given one NPU (Ray set ASCEND_RT_VISIBLE_DEVICES to it)."""

    selected: list = []

    def device_count(self):
        return 1

    def set_device(self, index):
        self.selected.append(index)


def test_ray_isolated_worker_exports_local_rank_0(monkeypatch):
    npu = _OneVisibleNpu()
    monkeypatch.setattr(D.Device, "module", property(lambda self: npu))
    monkeypatch.setattr(G, "get_device", lambda kind: D.Device("npu"))
    monkeypatch.setattr(G, "init_distributed", lambda dev, **kw: False)
    monkeypatch.setenv("LOCAL_RANK", "unset")
    host = G.RankHost(rank=3, world_size=4, device_kind="npu")
    host.setup("127.0.0.1", 1, 3, dict, (), {})  # the fourth rank of the node
    assert npu.selected == [0]
    assert os.environ["LOCAL_RANK"] == "0"  # was "3": vLLM would have opened npu:3, which this actor cannot see


def test_bad_local_rank_reaches_the_driver_as_a_worker_error(monkeypatch):
    class FourVisible(_OneVisibleNpu):
        def device_count(self):
            return 4

    monkeypatch.setattr(D.Device, "module", property(lambda self: FourVisible()))
    monkeypatch.setattr(G, "get_device", lambda kind: D.Device("npu"))
    with pytest.raises(G.WorkerError, match="local rank 6 but only 4 npu devices"):
        G.RankHost(rank=6, world_size=8, device_kind="npu").setup("127.0.0.1", 1, 6, dict, (), {})
