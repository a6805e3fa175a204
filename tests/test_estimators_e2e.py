"""The outcome estimators added from verl 0.9.1 through the trainer: two GRPO-style steps each, with the
advantages the step logs being what the estimator gives for its rewards."""

from __future__ import annotations

import pytest

from .test_trainer_e2e import assert_trained, overrides, read_metrics, run, score_file, task  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("estimator", ["opo", "grpo_passk", "grpo_vectorized", "rloo_vectorized"])
def test_estimator_trains_through_the_cli_keys(tiny_model_path, task, score_file, tmp_path, estimator):
    run_dir = tmp_path / estimator
    run(overrides(tiny_model_path, task, run_dir, f"algorithm.adv_estimator={estimator}",
                  "actor_rollout_ref.rollout.name=hf", f"custom_reward_function.path={score_file}",
                  "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']"))
    assert_trained(tiny_model_path, run_dir, steps=2)
    step = read_metrics(run_dir)[1]
    if estimator == "grpo_passk":  # one response per group gets its lead; with 0/1 scores the others get 0
        assert step["critic/advantages/min"] == 0.0 and step["critic/advantages/max"] > 0.0
    else:
        assert step["critic/advantages/min"] < 0.0 < step["critic/advantages/max"]
