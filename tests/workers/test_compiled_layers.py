"""model.compile_layers: decoder layers through torch.compile for the update and log-prob passes, eager for decoding.

Run here through inductor's CPU backend (the switch is off by default): the compiled worker must
give the eager worker's log-probs, update metrics and weights (fp32; inductor reorders some sums), and the
decoding paths must never call the compiled function (a CUDA-graph capture cannot contain a compilation).
"""

from __future__ import annotations

import pytest
import torch

from grpo_npu.config import load_config
from grpo_npu.device import Device
from grpo_npu.workers import compiled_layers, fsdp
from grpo_npu.workers.response_model import compile_layers_on

from .helpers import full_weights, make_batch, make_cfg, make_worker, max_abs_diff


def _model(*keys):
    return load_config(["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                        *keys]).actor_rollout_ref.model


@pytest.mark.parametrize("kind", ["cpu", "cuda", "npu"], ids=lambda k: f"kind_{k}")  # not the hardware marks
def test_off_by_default_and_true_is_checked(kind, monkeypatch):
    monkeypatch.setattr(compiled_layers, "missing_compiler", lambda k: None if k in ("cpu", "cuda") else "no backend")
    assert _model().compile_layers is False
    assert compile_layers_on(_model(), Device(kind), onednn_linear=False) is False
    on = _model("actor_rollout_ref.model.compile_layers=True")
    if kind == "npu":
        with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.compile_layers=True: no backend"):
            compile_layers_on(on, Device(kind), onednn_linear=False)
        return
    assert compile_layers_on(on, Device(kind), onednn_linear=False) is True
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.compile_layers=True: .*use_onednn_linear=False"):
        compile_layers_on(on, Device(kind), onednn_linear=True)


def test_true_is_refused_on_cuda_without_triton(monkeypatch):
    monkeypatch.setattr(compiled_layers, "missing_compiler", lambda k: "triton is not installed")
    with pytest.raises(ValueError, match="triton is not installed"):
        compile_layers_on(_model("actor_rollout_ref.model.compile_layers=True"), Device("cuda"), onednn_linear=False)


def test_eager_layers_nests_and_restores():
    calls = []
    fwd = compiled_layers.LayerForward(lambda x: x)
    fwd.compiled = lambda x: calls.append("compiled") or x
    fwd.eager = lambda x: calls.append("eager") or x
    fwd(1)
    with compiled_layers.eager_layers():
        fwd(1)
        with compiled_layers.eager_layers():
            fwd(1)
        fwd(1)
    fwd(1)
    assert calls == ["compiled", "eager", "eager", "eager", "compiled"]


@pytest.mark.usefixtures("process_group")
def test_compiled_worker_equals_eager_and_decoding_stays_eager(tiny_model_path):
    batch = make_batch(seed=3)
    batch = batch.replace(ref_logp=torch.zeros_like(batch.advantages))
    runs = {}
    for on in (False, True):
        worker = make_worker(make_cfg(tiny_model_path, "actor_rollout_ref.actor.use_kl_loss=True",
                                      f"actor_rollout_ref.model.compile_layers={on}"))
        for policy in (worker.actor, worker.ref):
            assert all(compiled_layers.compiled(layer) for layer in fsdp.decoder_layers(policy.module.hf)) is on
        calls = _count_compiled_calls(worker.actor.module.hf)
        old, _, _ = worker.actor.compute_log_prob(batch)
        ref = worker.compute_ref_log_prob(batch)
        metrics = worker.update_actor(batch.replace(old_logp=old))
        runs[on] = (old, ref, metrics, full_weights(worker.actor.module.hf))
        if on:
            assert calls["n"] > 0  # the passes ran compiled
            before = calls["n"]
            with worker.actor.module.decoding() as model:  # the static-cache loop's model
                model(input_ids=batch.input_ids[:2], use_cache=False)
            worker.actor.module.generate(input_ids=batch.prompt_ids[:2], attention_mask=batch.prompt_mask[:2],
                                         max_new_tokens=2, do_sample=False, pad_token_id=0)
            assert calls["n"] == before  # decoding never touched the compiled function
    (old0, ref0, m0, w0), (old1, ref1, m1, w1) = runs[False], runs[True]
    torch.testing.assert_close(old1, old0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref1, ref0, atol=1e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key
    assert max_abs_diff(w1, w0) < 1e-6  # SGD-like first step (make_cfg's optim.eps=1): ~ lr x gradient rounding


def _count_compiled_calls(hf_model) -> dict:
    calls = {"n": 0}
    for layer in fsdp.decoder_layers(hf_model):
        if compiled_layers.compiled(layer):
            inner = layer.forward.compiled

            def counted(*args, _inner=inner, **kwargs):
                calls["n"] += 1
                return _inner(*args, **kwargs)

            layer.forward.compiled = counted
    return calls
