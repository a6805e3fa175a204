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


BYPASS = ("actor_rollout_ref.rollout.calculate_log_probs=True", "algorithm.rollout_correction.bypass_mode=True",
          "actor_rollout_ref.actor.loss_agg_mode=token-mean")


def test_bypass_reinforce_gradient_is_the_is_weighted_policy_gradient(tiny_model_path):
    """verl's bypass mode, loss_type=reinforce, sequence IS weights: the batch's old log-probs are the engine's, the
    weight of each row is min(prod_t pi_theta / pi_rollout, 1.5) from the policy being trained, and the gradient is
    -sum_t w A grad log pi_theta / tokens, written here against the plain HF model."""
    from .test_actor import _reference_logp

    batch = _ppo_batch(tiny_model_path, seed=6)
    logp, _, model = _reference_logp(tiny_model_path, batch, grad=True)
    mask = batch.response_mask.bool()
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    rollout = (logp.detach() + 0.2 * noise) * mask  # the engine's log-probs: another kernel, another policy
    w = torch.exp(((logp.detach() - rollout) * mask).sum(-1)).clamp(max=1.5)[:, None]  # (B, 1)
    assert float(w.min()) < 1.0 and float(w.max()) == 1.5  # both sides of 1, one row truncated
    (-(batch.advantages.double() * w * logp)[mask].sum() / mask.sum()).backward()
    expected = {n: p.grad.float() for n, p in model.named_parameters()}
    worker = make_worker(make_cfg(tiny_model_path, *BYPASS, "algorithm.rollout_correction.loss_type=reinforce",
                                  "algorithm.rollout_correction.rollout_is=sequence",
                                  "algorithm.rollout_correction.rollout_is_threshold=1.5"))
    got = _actor_grads(worker, batch.replace(old_logp=rollout.float()))
    assert _max_diff(got, expected) < 1e-5


def test_bypass_ppo_clip_is_micro_batch_invariant_and_reports_the_correction(tiny_model_path):
    """ppo_clip with token IS weights (metrics only there) and token rejection: 1 micro-batch of 8 == 8 of 1 in
    weights after the update; the update reports verl's rollout_corr/* metrics; rejection changes the gradient."""
    batch = _ppo_batch(tiny_model_path, seed=7)
    noise = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(3))
    batch = batch.replace(old_logp=(batch.old_logp + 0.3 * noise) * batch.response_mask)
    keys = (*BYPASS, "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.8_1.25")
    grads = {}
    for micro in (8, 1):
        worker = make_worker(make_cfg(tiny_model_path, *keys, f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}"))
        grads[micro] = _actor_grads(worker, batch)
    assert _max_diff(grads[8], grads[1]) < 1e-6
    plain = make_worker(make_cfg(tiny_model_path, *BYPASS))
    assert _max_diff(_actor_grads(plain, batch), grads[8]) > 1e-4  # the rejected tokens left the loss
    metrics = make_worker(make_cfg(tiny_model_path, *keys)).update_actor(batch)
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    for name in ("rollout_corr/rollout_is_mean", "rollout_corr/kl", "rollout_corr/rollout_rs_token_k1_mean",
                 "actor/ppo_kl", "actor/pg_clipfrac"):
        assert name in metrics, name
