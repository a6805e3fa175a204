"""grpo_npu.input_checks: each bad input is one line naming the key and what was expected, before any model
loads; good inputs (the tiny kit) pass."""

from __future__ import annotations

import json
import shutil

import pytest

from grpo_npu.errors import UserError
from grpo_npu.input_checks import check_loggers, check_model_dir, check_reward_function, check_writable_dir

KEY = "actor_rollout_ref.model.path"


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_the_tiny_kit_passes(tiny_model_path):
    check_model_dir(KEY, tiny_model_path)


def test_missing_directory_and_hub_id(tmp_path):
    with pytest.raises(UserError) as err:
        check_model_dir(KEY, str(tmp_path / "nope"))
    assert _one_line(err).startswith(f"{KEY}={tmp_path / 'nope'}: no such directory")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UserError) as err:
        check_model_dir(KEY, str(tmp_path / "weights.bin"))
    assert _one_line(err) == f"{KEY}={tmp_path / 'weights.bin'} is a file: a Hugging Face checkpoint directory " \
                             "(config.json, weights) is expected"
    with pytest.raises(UserError) as err:
        check_model_dir(KEY, "Qwen/Qwen2.5-0.5B-Instruct")
    assert "looks like a hub id" in _one_line(err) and "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in str(err.value)


def test_empty_directory_no_config(tmp_path):
    with pytest.raises(UserError) as err:
        check_model_dir(KEY, str(tmp_path))
    assert "no config.json" in _one_line(err) and "found: nothing" in str(err.value)


def test_wrong_architecture_and_no_tokenizer(tiny_model_path, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "vit"}))
    with pytest.raises(UserError) as err:
        check_model_dir(KEY, str(model))
    assert "model_type 'vit' is not a causal language model" in _one_line(err)
    (model / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"):
        (model / name).unlink(missing_ok=True)
    with pytest.raises(UserError) as err:
        check_model_dir(KEY, str(model))
    assert "no tokenizer files" in _one_line(err)
    check_model_dir(KEY, str(model), need_tokenizer=False)


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError) as err:
        check_writable_dir("trainer.default_local_dir", str(blocker / "run"))
    assert "is a file, not a directory" in _one_line(err)
    check_writable_dir("trainer.default_local_dir", str(tmp_path / "new" / "run"))  # creatable
    assert not (tmp_path / "new").exists(), "the check leaves nothing behind"
    long_name = tmp_path / ("x" * 300) / "run"
    with pytest.raises(UserError) as err:
        check_writable_dir("trainer.default_local_dir", str(long_name))
    assert _one_line(err) == f"trainer.default_local_dir={long_name}: not a usable path (File name too long)"


def test_a_run_dir_the_system_will_not_create_is_named(monkeypatch, tmp_path):
    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(tmp_path), "mkdir", refuse)
    with pytest.raises(UserError) as err:
        check_writable_dir("trainer.default_local_dir", str(tmp_path / "run"))
    assert _one_line(err) == f"trainer.default_local_dir={tmp_path / 'run'}: cannot create it (Permission denied)"


def test_logger_package_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError) as err:
        check_loggers(["console", "wandb"])
    assert _one_line(err) == ("trainer.logger includes 'wandb' but the wandb package is not installed: "
                              "pip install wandb (or remove 'wandb' from trainer.logger)")
    check_loggers(["console", "jsonl"])


@pytest.mark.parametrize("source,expect", [
    ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n", None),
    ("def compute_score(**kwargs):\n    return 1.0\n", None),
    ("def compute_score(solution, answer):\n    return 1.0\n", "lacks data_source, solution_str, ground_truth, extra_info"),
    ("def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n", "has no function of that name"),
    ("import not_a_module_anywhere\n", "failed to import: ModuleNotFoundError"),
])
def test_reward_function_checks(tmp_path, source, expect):
    path = tmp_path / "reward.py"
    path.write_text(source)
    if expect is None:
        check_reward_function(str(path), "compute_score")
        return
    with pytest.raises(UserError) as err:
        check_reward_function(str(path), "compute_score")
    assert expect in _one_line(err)


def test_lora_without_peft_is_refused_before_workers_start(monkeypatch, tiny_model_path, tmp_path):
    import importlib.util

    from grpo_npu.config import load_config
    from grpo_npu.input_checks import check_inputs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    base = [f"actor_rollout_ref.model.path={tiny_model_path}", f"trainer.default_local_dir={tmp_path}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.n_gpus_per_node=1"]
    check_inputs(load_config(base), use_critic=False)  # full fine-tuning needs no peft
    with pytest.raises(UserError) as err:
        check_inputs(load_config(base + ["actor_rollout_ref.model.lora_rank=8"]), use_critic=False)
    assert _one_line(err) == ("actor_rollout_ref.model.lora_rank=8 needs the peft package: "
                              "pip install 'grpo_npu[lora]' (or set lora_rank=0 for full fine-tuning)")


@pytest.mark.parametrize("key, critic", [("actor_rollout_ref.model.external_lib", False),
                                         ("critic.model.external_lib", True)])
def test_an_external_lib_that_does_not_import_is_refused_before_workers_start(tiny_model_path, tmp_path, key, critic):
    from grpo_npu.config import load_config
    from grpo_npu.input_checks import check_inputs

    base = [f"actor_rollout_ref.model.path={tiny_model_path}", f"trainer.default_local_dir={tmp_path}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
            "trainer.n_gpus_per_node=1"]
    check_inputs(load_config(base + [f"{key}=json.decoder"]), use_critic=critic)  # importable
    check_inputs(load_config(base + ["critic.model.external_lib=no_such.pkg"]), use_critic=False)  # no critic: unread
    with pytest.raises(UserError) as err:
        check_inputs(load_config(base + [f"{key}=no_such.pkg"]), use_critic=critic)
    assert _one_line(err).startswith(f"{key}=no_such.pkg: no such module on the Python path")
