"""On one rank the actor's gradients are reduced once per mini-batch, not once per micro-batch, with the
same result: weights after an update equal (bitwise) those of the per-micro-batch reduction."""

from __future__ import annotations

import pytest

from grpo_npu.workers.update_loop import UpdateLoop

from .helpers import full_weights, make_batch, make_cfg, make_worker, max_abs_diff


def _update(tiny_model_path, monkeypatch, *, deferred: bool):
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    reduces = []
    real = _fsdp_param_group.foreach_reduce

    def counting(*args, **kwargs):
        reduces.append(1)
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(_fsdp_param_group, "foreach_reduce", counting)
        if not deferred:
            m.setattr(UpdateLoop, "deferred_reduce_units", lambda self: [])
        worker = make_worker(make_cfg(tiny_model_path, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"))
        before = full_weights(worker.actor.module.hf)
        batch = make_batch(seed=4)
        old_logp, _ = worker.compute_log_prob(batch)
        metrics = worker.update_actor(batch.replace(old_logp=old_logp))
    units = len(worker.actor.module.hf.model.layers) + 1
    return metrics, before, full_weights(worker.actor.module.hf), len(reduces), units


@pytest.mark.usefixtures("process_group")
def test_one_reduction_per_mini_batch_same_weights(tiny_model_path, monkeypatch):
    m_ref, before, w_ref, n_ref, units = _update(tiny_model_path, monkeypatch, deferred=False)
    m_new, _, w_new, n_new, _ = _update(tiny_model_path, monkeypatch, deferred=True)
    assert n_ref == 4 * units  # 8 rows in micro-batches of 2: every unit reduced after each backward
    assert n_new == units  # once, after the last micro-batch
    assert max_abs_diff(w_ref, before) > 1e-4  # the update moved the weights
    assert max_abs_diff(w_new, w_ref) == 0.0
    assert m_new["actor/grad_norm"] == m_ref["actor/grad_norm"]
