"""Every actor_rollout_ref.actor.policy_loss.loss_mode through the actor's update: the key reaches the loss with
the settings it reads, the loss is the hand-computed one, and the logged metrics are the ones the mode gives."""

from __future__ import annotations

import pytest
import torch

from .helpers import full_weights, make_cfg, make_worker, max_abs_diff
from .test_actor import _ppo_batch, _reference_logp

pytestmark = pytest.mark.usefixtures("process_group")

ALL = {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
# mode -> (its settings, the policy metrics it logs, its per-token loss at ratio 1 as a function of (A, logp))
MODES = {
    "gpg": ((), set(), lambda a, lp: -a * lp),
    "cispo": (("actor_rollout_ref.actor.clip_ratio_low=10",), ALL, lambda a, lp: -a * lp),
    "dro": (("actor_rollout_ref.actor.policy_loss.dro_beta=0.5",), {"actor/ppo_kl"}, lambda a, lp: -a * lp),
    "dppo_tv": (("actor_rollout_ref.actor.clip_ratio_c=10.0",), ALL, lambda a, lp: -a * lp),
    "dppo_kl": ((), ALL, lambda a, lp: -a * lp),
    "sapo": (("actor_rollout_ref.actor.tau_pos=2.0",), ALL, None),  # 4/tau * sigmoid(0) = 2/tau per token
    "geo_mean": ((), ALL, None),  # -mean over responses of the response's mean advantage
    # the ratio form -A rho at rho = 1; kl_cov's penalty |log rho| is 0 there; clip_cov with bounds no covariance
    # reaches takes no token out
    "kl_cov": (("actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.5",), {"actor/ppo_kl"}, lambda a, lp: -a + 0 * lp),
    "clip_cov": (("actor_rollout_ref.actor.policy_loss.clip_cov_lb=100", "actor_rollout_ref.actor.policy_loss.clip_cov_ub=200"),
                 {"actor/pg_clipfrac", "actor/ppo_kl"}, lambda a, lp: -a + 0 * lp),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_loss_mode_trains_through_the_actor(tiny_model_path, mode):
    settings, logged, per_token = MODES[mode]
    batch = _ppo_batch(tiny_model_path, seed=5)  # old_logp = the current policy: ratio 1
    logp, _, _ = _reference_logp(tiny_model_path, batch)
    mask = batch.response_mask.bool()
    adv = batch.advantages.double()
    if per_token is not None:
        expected = float(per_token(adv, logp)[mask].sum() / mask.sum())  # token-mean
    elif mode == "sapo":
        tau = torch.where(adv > 0, 2.0, 1.05).double()
        per_row = ((-adv * 2.0 / tau) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        expected = float(per_row.sum() / len(batch))  # seq-mean-token-mean, whatever loss_agg_mode says
    else:
        expected = float((-(adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / len(batch))
    worker = make_worker(make_cfg(tiny_model_path, f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *settings,
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"))
    before = full_weights(worker.actor.module.hf)
    metrics = worker.update_actor(batch)
    assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert {k for k in metrics if k in ALL} == logged
    assert max_abs_diff(full_weights(worker.actor.module.hf), before) > 1e-4
