"""Rollout rejection reaches the advantage estimator as in verl 0.9.1, which overwrites response_mask with the
rejected tokens removed before compute_advantage: REINFORCE++'s whitening leaves a rejected response out of
its statistics and gives it advantage 0 (Trainer.advantages, the driver's step)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from grpo_npu.batch import RolloutBatch
from grpo_npu.config import load_config
from grpo_npu.run_control import Timer
from grpo_npu.trainer import Trainer

KEY = "algorithm.rollout_correction"


def _batch() -> RolloutBatch:
    """4 responses of 2 tokens, groups a, a, b, b, scores 1, 0, 1, 0; row 3's engine log-probs are 3 nats off."""
    mask = torch.ones(4, 2, dtype=torch.long)
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    old = torch.full((4, 2), -1.0)
    rollout = old.clone()
    rollout[3] -= 3.0  # pi_old / pi_rollout = e^3 on both tokens: beyond any threshold below
    return RolloutBatch(prompt_ids=torch.zeros(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1, dtype=torch.long),
                        response_ids=torch.zeros(4, 2, dtype=torch.long), response_mask=mask, uid=["a", "a", "b", "b"],
                        token_level_scores=scores, old_logp=old, rollout_logp=rollout)


def _advantages(estimator: str, *rs: str) -> RolloutBatch:
    cfg = load_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.calculate_log_probs=True",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *rs])
    trainer = SimpleNamespace(cfg=cfg, kl_ctrl=None)
    return Trainer.advantages(trainer, _batch(), Timer())[0]


def _whiten(x: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten over the given values: unbiased variance, eps 1e-8."""
    return (x - x.mean()) * torch.rsqrt(x.var(unbiased=True) + 1e-8)


def test_a_rejected_response_leaves_reinforce_plus_plus_baseline_statistics():
    out = _advantages("reinforce_plus_plus_baseline", f"{KEY}.rollout_rs=seq_mean_k1", f"{KEY}.rollout_rs_threshold=2.0")
    assert out.loss_tokens()[3].sum() == 0 and out.loss_tokens()[:3].all()
    centred = torch.tensor([0.5, -0.5, 0.5]).repeat_interleave(2)  # score - group mean (group b's mean keeps row 3)
    expected = _whiten(centred).view(3, 2)
    torch.testing.assert_close(out.advantages[:3], expected)
    assert out.advantages[3].abs().sum() == 0
    everyone = _advantages("reinforce_plus_plus_baseline")  # without rejection row 3 is in the statistics
    assert not torch.allclose(everyone.advantages[:3], expected, atol=1e-3)


def test_grpo_advantages_of_kept_responses_do_not_change():
    kept = _advantages("grpo", f"{KEY}.rollout_rs=seq_mean_k1", f"{KEY}.rollout_rs_threshold=2.0")
    everyone = _advantages("grpo")
    torch.testing.assert_close(kept.advantages[:3], everyone.advantages[:3])  # scores are summed without the mask
    assert kept.advantages[3].abs().sum() == 0 and everyone.advantages[3].abs().sum() > 0

