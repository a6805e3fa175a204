"""The worker group acts on verl's process settings: actor_rollout_ref.nccl_timeout (the process group's
timeout), ray_init.runtime_env (ray_kwargs.ray_init.runtime_env in newer verl) and ray_init.timeline_json_file."""

from __future__ import annotations

import datetime
import json

import pytest
import torch.distributed as dist

from grpo_npu import cluster
from grpo_npu.config import load_config
from grpo_npu.workers import LocalGroup, RayGroup, group

BASE = ["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1"]


class Echo:
    """A worker with nothing to load."""

    def ping(self) -> str:
        return "pong"


def test_nccl_timeout_reaches_the_process_group(monkeypatch):
    seen = {}
    real = group.init_distributed

    def spy(dev, **kwargs):
        seen.update(kwargs)
        return real(dev, **kwargs)

    monkeypatch.setattr(group, "init_distributed", spy)
    with LocalGroup(Echo, device_kind="cpu", pg_timeout_s=42) as g:
        assert g.call("ping") == ["pong"] and dist.is_initialized()
    assert seen["timeout"] == datetime.timedelta(seconds=42)


def test_make_group_passes_the_settings(monkeypatch):
    made = []
    monkeypatch.setattr(cluster, "LocalGroup", lambda *a, **kw: made.append(("local", kw)))
    monkeypatch.setattr(cluster, "RayGroup", lambda *a, **kw: made.append(("ray", kw)))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster.make_group(load_config(BASE + ["actor_rollout_ref.nccl_timeout=77"]), Echo, ())
    cluster.make_group(load_config(BASE + ["ray_kwargs.timeline_json_file=/tmp/t.json",
                                           "ray_kwargs.ray_init.runtime_env.py_executable=python3"]), Echo, ())
    (kind1, kw1), (kind2, kw2) = made
    assert kind1 == "local" and kw1["pg_timeout_s"] == 77
    # a timeline needs Ray: one rank then runs under Ray too
    assert kind2 == "ray" and kw2["timeline_json_file"] == "/tmp/t.json" and kw2["pg_timeout_s"] == 600
    assert kw2["ray_runtime_env"] == {"py_executable": "python3"}


@pytest.mark.slow
def test_ray_timeline_is_written(tmp_path):
    path = tmp_path / "timeline.json"
    g = RayGroup(Echo, world_size=1, device_kind="cpu", ray_num_cpus=1, timeline_json_file=str(path))
    try:
        assert g.call("ping") == ["pong"]
    finally:
        g.close()
    events = json.loads(path.read_text())
    assert isinstance(events, list) and events
