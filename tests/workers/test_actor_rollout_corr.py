"""The actor's loss under rollout correction: rejected tokens leave the loss and its normalisation, IS weights
scale each token's term (one FSDP2 rank on the tiny model)."""

from __future__ import annotations

import pytest
import torch

from .helpers import make_cfg, make_worker
from .test_actor import _actor_grads, _ppo_batch

pytestmark = pytest.mark.usefixtures("process_group")


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _scale(grads, c):
    return {k: v * c for k, v in grads.items()}


@pytest.mark.parametrize("agg,kept_share", [("token-mean", 1.0), ("seq-mean-token-mean", 6 / 8)])
def test_rejected_sequences_leave_the_loss_and_count_as_verl_counts_them(tiny_model_path, agg, kept_share):
    """verl 0.9.1 modifies response_mask: a rejected sequence contributes nothing and leaves the token count
    (batch_num_tokens), but the seq-mean modes still divide by every row (global_batch_size = mini-batch x n)."""
    worker = make_worker(make_cfg(tiny_model_path, f"actor_rollout_ref.actor.loss_agg_mode={agg}"))
    batch = _ppo_batch(tiny_model_path, seed=4)
    loss_mask = batch.response_mask.clone()
    rejected, kept = [0, 5], [1, 2, 3, 4, 6, 7]
    loss_mask[rejected] = 0
    with_rejection = _actor_grads(worker, batch.replace(loss_mask=loss_mask))
    without_rows = _scale(_actor_grads(worker, batch.select(kept)), kept_share)
    everything = _actor_grads(worker, batch)
    assert _max_diff(with_rejection, without_rows) < 1e-6
    assert _max_diff(with_rejection, everything) > 1e-4  # the mask matters


def test_is_weights_scale_each_sequence_like_its_advantage(tiny_model_path):
    """At ratio 1 the PPO term is linear in A: weighting a sequence by c >= 0 equals scaling its advantage by c."""
    worker = make_worker(make_cfg(tiny_model_path, "actor_rollout_ref.actor.loss_agg_mode=token-mean"))
    batch = _ppo_batch(tiny_model_path, seed=5)
    c = torch.tensor([0.5, 2.0, 1.0, 0.0, 1.5, 0.25, 1.0, 3.0])[:, None]  # (B, 1)
    weights = (c * batch.response_mask).float()
    weighted = _actor_grads(worker, batch.replace(rollout_is_weights=weights))
    scaled_adv = _actor_grads(worker, batch.replace(advantages=batch.advantages * c))
    plain = _actor_grads(worker, batch)
    assert _max_diff(weighted, scaled_adv) < 1e-6
    doubled = _actor_grads(worker, batch.replace(rollout_is_weights=2.0 * batch.response_mask.float()))
    assert _max_diff(doubled, _scale(plain, 2.0)) < 1e-6
