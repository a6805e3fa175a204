"""The PPO critic in one process: values at the right positions, packing invariance, the value update."""

from __future__ import annotations

import pytest
import torch

from .helpers import make_batch, make_cfg, make_worker

pytestmark = pytest.mark.usefixtures("process_group")

PPO = ("algorithm.adv_estimator=gae", "critic.optim.lr=1e-4", "critic.optim.weight_decay=0.0")


def _reference_values(worker, batch) -> torch.Tensor:
    """Values from the critic's own HF module run the plain way: full sequence, head on every position."""
    hf = worker.critic.module.hf
    from grpo_npu.workers import fsdp

    weights = dict(fsdp.iter_full_state_dict(hf))
    from transformers import AutoModelForTokenClassification

    plain = AutoModelForTokenClassification.from_config(hf.config)
    plain.load_state_dict(weights)
    plain.eval()
    p = batch.prompt_ids.shape[1]
    with torch.no_grad():
        logits = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits  # (B, L, 1)
    return logits[:, p - 1 : -1, 0] * batch.response_mask


@pytest.mark.parametrize("onednn", [False, True])  # True: the critic's linears and value head through oneDNN
def test_critic_only_for_gae_and_values_match_plain_model(tiny_model_path, onednn):
    assert make_worker(make_cfg(tiny_model_path)).critic is None  # grpo: no critic
    worker = make_worker(make_cfg(tiny_model_path, *PPO, f"actor_rollout_ref.model.use_onednn_linear={onednn}"))
    assert ("forward" in worker.critic.module.hf.score.__dict__) == onednn
    batch = make_batch(seed=11)
    values = worker.compute_values(batch)
    assert values.shape == batch.response_ids.shape and values.dtype == torch.float32
    torch.testing.assert_close(values, _reference_values(worker, batch), atol=1e-5, rtol=0)
    worker.critic.remove_padding = True
    torch.testing.assert_close(worker.compute_values(batch), values, atol=1e-5, rtol=0)


def test_critic_update_fits_returns_and_is_micro_batch_invariant(tiny_model_path):
    batch = make_batch(seed=12)
    returns = (torch.linspace(-1, 1, batch.response_ids.shape[1]).expand_as(batch.advantages) * batch.response_mask).contiguous()
    results = {}
    for micro in (8, 4):
        worker = make_worker(make_cfg(tiny_model_path, *PPO, f"critic.ppo_micro_batch_size_per_gpu={micro}",
                                      "critic.model.enable_gradient_checkpointing=False"))
        results[micro] = []
        for _ in range(4):  # as in PPO, each step's old values come from the critic before its update
            b = batch.replace(values=worker.compute_values(batch), returns=returns)
            results[micro].append(worker.update_critic(b))
    losses = [m["critic/vf_loss"] for m in results[8]]
    assert losses[-1] < 0.5 * losses[0]  # the value head learns the returns
    for a, b in zip(results[8], results[4]):
        assert b["critic/vf_loss"] == pytest.approx(a["critic/vf_loss"], rel=1e-4)
        assert b["critic/grad_norm"] == pytest.approx(a["critic/grad_norm"], rel=1e-4)
    with pytest.raises(ValueError, match="needs values and returns"):
        worker.update_critic(batch)


def test_each_models_external_lib_is_imported_before_it_loads(tiny_model_path, tmp_path, monkeypatch):
    import sys

    for name in ("ext_for_actor", "ext_for_critic"):
        (tmp_path / f"{name}.py").write_text("LOADED = True\n")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    make_worker(make_cfg(tiny_model_path, *PPO, "actor_rollout_ref.model.external_lib=ext_for_actor",
                         "critic.model.external_lib=ext_for_critic"))
    assert sys.modules["ext_for_actor"].LOADED and sys.modules["ext_for_critic"].LOADED
