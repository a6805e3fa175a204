"""*.checkpoint.save_contents / load_contents (actor and critic): verl's default (what is loaded follows what is
saved), the refusals, and a resume from checkpoints that leave optimizers out; trainer.checkpoint_callback_class."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint import FileSystemReader

from grpo_npu.config import load_config, loaded_contents
from grpo_npu.errors import ConfigError

from .test_trainer_e2e import overrides, read_metrics, run, task  # noqa: F401 (task: a fixture)

BASE = ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]


def test_what_is_loaded_follows_what_is_saved_unless_set():
    cfg = load_config(BASE)
    assert loaded_contents(cfg.actor_rollout_ref.actor.checkpoint) == ("model", "optimizer", "extra")
    cfg = load_config(BASE + ["actor_rollout_ref.actor.checkpoint.save_contents=[model,extra,hf_model]",
                              "critic.checkpoint.save_contents=[model,extra]"])
    assert loaded_contents(cfg.actor_rollout_ref.actor.checkpoint) == ("model", "extra", "hf_model")
    assert loaded_contents(cfg.critic.checkpoint) == ("model", "extra")
    cfg = load_config(BASE + ["critic.checkpoint.load_contents=[model]"])
    assert loaded_contents(cfg.critic.checkpoint) == ("model",)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer]",
     r"actor_rollout_ref.actor.checkpoint.save_contents=\['model', 'optimizer'\]: grpo_npu's checkpoints always hold "
     r"the model and extra"),
    ("critic.checkpoint.save_contents=[optimizer,extra]", r"critic.checkpoint.save_contents=.*always hold the model"),
    ("critic.checkpoint.save_contents=[model,extra,hf_model]", "hf_model .* is written for the actor only"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,extra,weights]", "'weights' is not accepted"),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[optimizer,extra]", "a resume loads the model; list it"),
    ("critic.checkpoint.load_contents=[model,rng]", r"critic.checkpoint.load_contents=\['model', 'rng'\]: 'rng' is not"),
])
def test_contents_grpo_npu_cannot_honour_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(BASE + [override])


@pytest.mark.slow
def test_resume_from_checkpoints_without_optimizer_state(tiny_model_path, task, tmp_path):
    """PPO saving neither optimizer: the resume loads what was saved (verl's default) and trains on with fresh
    optimizer state, where a fixed load list would have asked for state the checkpoint does not hold."""
    common = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.name=hf", "critic.optim.lr=1e-3",
              "critic.ppo_micro_batch_size_per_gpu=4", "trainer.save_freq=2",
              "actor_rollout_ref.actor.checkpoint.save_contents=[model,extra]", "critic.checkpoint.save_contents=[model,extra]"]
    run_dir = tmp_path / "run"
    run(overrides(tiny_model_path, task, run_dir, *common, "trainer.total_training_steps=2"))
    for role in ("actor", "critic"):
        keys = FileSystemReader(str(run_dir / "global_step_2" / role / "dcp")).read_metadata().state_dict_metadata
        assert any(k.startswith("model") for k in keys) and not any(k.startswith("optimizer") for k in keys), role
    run(overrides(tiny_model_path, task, run_dir, *common, "trainer.total_training_steps=3"))
    assert max(read_metrics(run_dir)) == 3


CALLBACK = '''
import json, os

class RecordSaves:
    def __init__(self, config=None):
        self.out = os.path.join(config.trainer.default_local_dir, "..", "saves.jsonl")

    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        complete = os.path.exists(os.path.join(checkpoint_dir, "COMPLETE"))
        with open(self.out, "a") as f:
            f.write(json.dumps([global_step, os.path.basename(checkpoint_dir), complete, async_save,
                                trainer.global_step]) + "\\n")
'''


@pytest.mark.slow
def test_checkpoint_callback_runs_after_each_committed_save(tiny_model_path, task, tmp_path, monkeypatch):
    """verl's trainer.checkpoint_callback_class: built with config=, its on_save called on the driver after each
    checkpoint is committed (the COMPLETE marker is there)."""
    import json
    import sys

    (tmp_path / "save_hooks.py").write_text(CALLBACK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "save_hooks", raising=False)
    run(overrides(tiny_model_path, task, tmp_path / "run", "algorithm.adv_estimator=grpo",
                  "actor_rollout_ref.rollout.name=hf", "trainer.checkpoint_callback_class=save_hooks.RecordSaves"))
    saves = [json.loads(line) for line in (tmp_path / "saves.jsonl").read_text().splitlines()]
    assert saves == [[1, "global_step_1", True, False, 1], [2, "global_step_2", True, False, 2]]


@pytest.mark.parametrize("name, message", [
    ("RecordSaves", "expected a fully qualified class name"),
    ("no_such_pkg.Hook", "cannot import no_such_pkg"),
    ("json.NoSuchHook", "json has no NoSuchHook"),
    ("json.JSONDecoder", "JSONDecoder has no on_save"),
])
def test_a_checkpoint_callback_that_does_not_load_is_one_line(name, message):
    from grpo_npu.checkpoint import checkpoint_hook
    from grpo_npu.errors import UserError

    with pytest.raises(UserError, match=f"^trainer.checkpoint_callback_class={name}: {message}") as err:
        checkpoint_hook(name, load_config(BASE), trainer=None)
    assert "\n" not in str(err.value)
    assert checkpoint_hook(None, load_config(BASE), trainer=None) is None
