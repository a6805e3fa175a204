"""verl's optimizer keys end to end: torch.optim.SGD with momentum (verl's spelling, the momentum through
``+...override_optimizer_config``) resumes exactly, its momentum buffers in the checkpoint; a resume that would
load those buffers into another optimizer is refused in one line."""

from __future__ import annotations

import pytest

from grpo_npu.errors import UserError

from .test_trainer_e2e import NONDETERMINISTIC, overrides, read_metrics, run, task  # noqa: F401 (task: a fixture)

pytestmark = pytest.mark.slow

SGD = ("actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.optimizer_impl=torch.optim",
       "+actor_rollout_ref.actor.optim.override_optimizer_config.momentum=0.9",
       "actor_rollout_ref.actor.optim.lr=0.05", "actor_rollout_ref.actor.optim.lr_warmup_steps=0")


def test_sgd_with_momentum_resumes_exactly_and_refuses_another_optimizer(tiny_model_path, task, tmp_path):
    common = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf", "trainer.save_freq=2", *SGD]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(overrides(tiny_model_path, task, straight, *common, "trainer.total_training_steps=3"))
    run(overrides(tiny_model_path, task, resumed, *common, "trainer.total_training_steps=2"))
    run(overrides(tiny_model_path, task, resumed, *common, "trainer.total_training_steps=3"))
    a, b = read_metrics(straight), read_metrics(resumed)
    keys = [k for k in a[3] if not k.startswith(NONDETERMINISTIC)]
    assert "actor/pg_loss" in keys and set(keys) <= set(b[3])
    diff = {k: (a[3][k], b[3][k]) for k in keys if a[3][k] != b[3][k]}
    assert not diff, f"step 3 differs after resume: {diff}"  # momentum buffers restored, not restarted
    assert a[1]["actor/lr"] == pytest.approx(0.05)

    adamw = [a for a in common if "optimizer=" not in a and "override_optimizer_config" not in a]
    with pytest.raises(UserError) as err:
        run(overrides(tiny_model_path, task, resumed, *adamw, "trainer.total_training_steps=4"))
    assert str(err.value).startswith("actor_rollout_ref.actor.optim.optimizer=AdamW (torch.optim): the checkpoint "
                                     "holds the state of torch.optim.SGD; resume with that optimizer")
    assert max(read_metrics(resumed)) == 3  # nothing trained
