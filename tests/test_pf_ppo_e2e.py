"""PF-PPO end to end (PPO with a critic, the transformers rollout): the update and the step's metrics see the
score-weighted resample, and the seeded draw makes a resumed run equal the uninterrupted one."""

from __future__ import annotations

import pytest

from .test_trainer_e2e import NONDETERMINISTIC, overrides, read_metrics, run, score_file, task  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def test_pf_ppo_trains_on_the_resample_and_resumes_exactly(tiny_model_path, task, score_file, tmp_path):
    common = ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=pow",
              "algorithm.pf_ppo.weight_pow=2.0", "actor_rollout_ref.rollout.name=hf", "critic.optim.lr=1e-3",
              "critic.ppo_micro_batch_size_per_gpu=4", f"custom_reward_function.path={score_file}",
              "trainer.save_freq=2"]
    straight, resumed, plain = tmp_path / "straight", tmp_path / "resumed", tmp_path / "plain"
    run(overrides(tiny_model_path, task, straight, *common, "trainer.total_training_steps=3"))
    run(overrides(tiny_model_path, task, plain, *[c for c in common if "pf_ppo" not in c], "trainer.total_training_steps=1"))
    a, p = read_metrics(straight), read_metrics(plain)
    # The parity reward scores 0 or 1: under pow a 0 weighs 1e-8 against 1, so the resample holds only score-1
    # responses while the same rollout without PF-PPO holds both.
    assert p[1]["critic/score/min"] == 0.0 and p[1]["critic/score/max"] == 1.0
    assert a[1]["critic/score/min"] == 1.0 and a[1]["critic/score/mean"] == 1.0
    run(overrides(tiny_model_path, task, resumed, *common, "trainer.total_training_steps=2"))
    run(overrides(tiny_model_path, task, resumed, *common, "trainer.total_training_steps=3"))
    b = read_metrics(resumed)
    keys = [k for k in a[3] if not k.startswith(NONDETERMINISTIC)]
    assert "critic/vf_loss" in keys and set(keys) <= set(b[3])
    diff = {k: (a[3][k], b[3][k]) for k in keys if a[3][k] != b[3][k]}
    assert not diff, f"step 3 differs after resume: {diff}"
