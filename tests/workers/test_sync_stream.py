"""The weight stream a sync sends the engine: cast by the actor only where the engine cannot cast it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_npu.workers import fsdp

from .helpers import make_cfg, make_worker

pytestmark = pytest.mark.usefixtures("process_group")


@pytest.mark.parametrize("casts", [True, False], ids=["engine-casts", "engine-takes-its-dtype"])
def test_the_sync_stream_is_cast_only_for_an_engine_that_cannot_cast(tiny_model_path, monkeypatch, casts):
    """A whole (one-rank CPU) actor sends its fp32 tensors to an engine that casts as it copies; an engine that
    cannot cast gets its own dtype. The tied pair stays one tensor either way."""
    cfg = make_cfg(tiny_model_path, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bfloat16")
    worker = make_worker(cfg)
    assert not fsdp.is_sharded(worker.actor.module.hf)  # one CPU rank, fp32: not wrapped
    monkeypatch.setattr(worker, "rollout", SimpleNamespace(casts_weights=casts), raising=False)
    sent = dict(worker.engine_weights())
    assert {t.dtype for t in sent.values()} == {torch.float32 if casts else torch.bfloat16}
    assert sent["lm_head.weight"].data_ptr() == sent["model.embed_tokens.weight"].data_ptr()
