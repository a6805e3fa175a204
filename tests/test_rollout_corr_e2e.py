"""End to end on CPU: a tiny GRPO run with verl's rollout correction on reports its metrics and trains.

The transformers rollout returns its log-probs (rollout.calculate_log_probs=True); engine and actor run the
same fp32 weights, so the IS weights sit at 1 and no sequence is rejected by sane bounds.
"""

from __future__ import annotations

import math

import pytest


from .test_trainer_e2e import assert_trained, overrides, read_metrics, run, score_file, task  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

KEY = "algorithm.rollout_correction"




def test_grpo_with_rollout_correction_reports_verls_metrics(tiny_model_path, task, score_file, tmp_path):
    run_dir = tmp_path / "rcorr"
    last = run(overrides(
        tiny_model_path, task, run_dir,
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"{KEY}.rollout_is=sequence", f"{KEY}.rollout_is_threshold=2.0", f"{KEY}.rollout_is_batch_normalize=True",
        f"{KEY}.rollout_rs=token_k1,seq_mean_k3", f"{KEY}.rollout_rs_threshold=0.5_2.0,0.01",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']",
        f"custom_reward_function.path={score_file}",
    ))
    # the correction needs old log-probs before the update: the on-policy shortcut is off
    assert "timing_s/old_log_prob" in last
    for key in ("rollout_is_mean", "rollout_is_max", "rollout_is_ratio_fraction_high", "rollout_is_eff_sample_size",
                "rollout_is_batch_norm_factor", "rollout_rs_token_k1_masked_fraction", "rollout_rs_masked_fraction",
                "rollout_rs_seq_mean_k3_mean", "kl", "k3_kl", "training_ppl", "rollout_ppl", "log_ppl_diff",
                "chi2_token", "chi2_seq"):
        assert f"rollout_corr/{key}" in last, key
    for key in ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "rollout/logp_diff_max"):
        assert key in last, key
    # same fp32 weights in engine and actor: weights ~1, nothing rejected, tiny KL
    assert last["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-2)
    assert last["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert abs(last["rollout_corr/kl"]) < 1e-3 and last["training/rollout_probs_diff_max"] < 1e-2
    for step, row in read_metrics(run_dir).items():
        if step > 0:
            assert all(math.isfinite(v) for k, v in row.items() if k.startswith("rollout_corr/")), step
    assert_trained(tiny_model_path, run_dir, steps=2)


def test_rejection_that_drops_every_token_gives_zero_loss_and_gradient(tiny_model_path, task, score_file, tmp_path):
    """Bounds no token meets (k2 below any real mismatch): every token leaves the loss and the normaliser."""
    run_dir = tmp_path / "all_rejected"
    last = run(overrides(
        tiny_model_path, task, run_dir,
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.calculate_log_probs=True", "trainer.total_training_steps=1",
        f"{KEY}.rollout_rs=token_k1", f"{KEY}.rollout_rs_threshold=1.5_2.0",  # ratio in [1/2, 1/1.5]: none at r ~ 1
        f"custom_reward_function.path={score_file}",
    ))
    assert last["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert last["actor/pg_loss"] == 0.0 and last["actor/grad_norm"] == 0.0


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_mode_trains_on_the_engines_log_probs(tiny_model_path, task, score_file, tmp_path, loss_type):
    """verl's examples/rollout_correction shape (RLOO, sequence IS, batch-normalised, bypass): no old-log-prob pass,
    the correction measured in the update (rollout_corr/* there, the decoupled mode's driver metrics absent)."""
    run_dir = tmp_path / f"bypass_{loss_type}"
    last = run(overrides(
        tiny_model_path, task, run_dir,
        "algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"{KEY}.rollout_is=sequence", f"{KEY}.rollout_is_threshold=2.0", f"{KEY}.rollout_is_batch_normalize=True",
        f"{KEY}.bypass_mode=True", f"{KEY}.loss_type={loss_type}",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']",
        f"custom_reward_function.path={score_file}",
    ))
    assert "timing_s/old_log_prob" not in last and "actor/entropy" not in last  # no old-log-prob pass
    assert "training/rollout_probs_diff_mean" not in last and "rollout/logp_diff_max" not in last
    # the same fp32 weights in engine and actor: on the first mini-batch of a step the policy is the engine's
    assert last["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=0.1)
    assert abs(last["rollout_corr/kl"]) < 0.1 and "rollout_corr/rollout_is_batch_norm_factor" in last
    assert ("actor/pg_clipfrac" in last) == (loss_type == "ppo_clip")
    assert_trained(tiny_model_path, run_dir, steps=2)
