"""Parity by replay on CPU: a run dumps its rollouts (trainer.rollout_data_dir); a replay of the dump
(trainer.replay_rollouts_from) reproduces the run's training metrics bit for bit on one rank and within
fp32 rounding on two; a dump that does not fit the run is refused in one line before anything starts.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from grpo_npu.config import load_config
from grpo_npu.determinism import DETERMINISTIC_ENV
from grpo_npu.errors import ConfigError
from grpo_npu.tools.compare_runs import main as compare_main
from grpo_npu.trainer import Trainer

from .test_trainer_e2e import NONDETERMINISTIC, overrides, read_metrics, run, task  # noqa: F401 (task: a fixture)

pytestmark = pytest.mark.slow

STEPS = 2
# Training-side metrics a replay must reproduce.
TRAIN_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac",
              "actor/ppo_kl", "critic/score/mean", "critic/advantages/mean", "response_length/truncated_masked_frac")
# Keys only the generating run has: the engine's and the reward call's own metrics.
GENERATION_ONLY = ("rollout/", "reward/", "timing_s/gen", "timing_per_token_ms/gen", "timing_s/reward",
                   "timing_per_token_ms/reward", "training/epoch")
# fp32 sums over another split of rows between ranks.
TWO_RANK_RTOL = 1e-4


def _common(task: Path) -> tuple[str, ...]:
    return ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.rollout.calculate_log_probs=True",
            "actor_rollout_ref.actor.mask_truncated_completions=True", "trainer.save_freq=-1",
            f"trainer.total_training_steps={STEPS}", "data.val_files=[]")



@pytest.fixture(scope="module")
def dumped(tiny_model_path, task, tmp_path_factory):
    """(run directory, dump directory) of a 1-rank GRPO run that dumps its rollouts."""
    root = tmp_path_factory.mktemp("dumped")
    run_dir, dump = root / "run", root / "rollouts"
    run(overrides(tiny_model_path, task, run_dir, *_common(task), f"trainer.rollout_data_dir={dump}"))
    return run_dir, dump


def _replay(model, task, dump, run_dir, *extra) -> dict[int, dict]:
    run(overrides(model, task, run_dir, *_common(task), f"trainer.replay_rollouts_from={dump}", *extra))
    return read_metrics(run_dir)


def _compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC + GENERATION_ONLY)}


def test_dump_is_complete_and_safe(dumped):
    _, dump = dumped
    for step in range(1, STEPS + 1):
        assert (dump / f"{step}.jsonl").is_file()
        tensors = load_file(str(dump / f"{step}.safetensors"))  # tensors only: nothing to unpickle
        with safe_open(str(dump / f"{step}.safetensors"), framework="pt") as f:
            meta = f.metadata()
        rows = 4 * 4
        assert tensors["response_ids"].shape[0] == rows and tensors["prompt_ids"].shape[0] == rows
        assert tensors["rollout_logp"].shape == tensors["response_ids"].shape  # calculate_log_probs=True
        assert tensors["token_level_scores"].dtype == torch.float32
        assert tensors["group_index"].tolist() == [i // 4 for i in range(rows)]  # n=4 rows per prompt, in order
        assert meta["step"] == str(step) and meta["n"] == "4" and meta["train_batch_size"] == "4"
        uids = json.loads(meta["uid"])
        assert len(uids) == rows and len(set(uids)) == 4
        assert set(json.loads(meta["stop_reason"])) <= {"stop", "length"}


@pytest.fixture
def deterministic_preset_undone(monkeypatch):
    """trainer.deterministic=True in an in-process worker changes this process: undo it after the test."""
    for key in DETERMINISTIC_ENV:
        monkeypatch.delenv(key, raising=False)  # restored by monkeypatch after the test
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def test_replay_reproduces_the_run_bitwise(tiny_model_path, task, dumped, tmp_path, deterministic_preset_undone):
    run_dir, dump = dumped
    original = read_metrics(run_dir)
    replayed = _replay(tiny_model_path, task, dump, tmp_path / "replay", "trainer.deterministic=True")
    assert torch.are_deterministic_algorithms_enabled()  # the preset reached the (in-process) worker
    for step in range(1, STEPS + 1):
        a, b = _compared(original[step]), _compared(replayed[step])
        assert set(TRAIN_KEYS) <= set(a) and set(b) == set(a), set(a) ^ set(b)
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not diff, f"step {step}: the replay differs: {diff}"
    # and compare_runs' training-side mode says so
    assert compare_main([str(tmp_path / "replay"), str(run_dir), "--mode", "train", "--rtol", "0", "--atol", "0"]) == 0


def test_replay_on_two_ranks_agrees_with_one(tiny_model_path, task, dumped, tmp_path):
    run_dir, dump = dumped
    one = read_metrics(run_dir)
    two = _replay(tiny_model_path, task, dump, tmp_path / "two", "trainer.n_gpus_per_node=2")
    for step in range(1, STEPS + 1):
        for key in TRAIN_KEYS:
            assert two[step][key] == pytest.approx(one[step][key], rel=TWO_RANK_RTOL, abs=1e-7), (step, key)


def test_a_dump_that_does_not_fit_is_refused_in_one_line(tiny_model_path, task, dumped, tmp_path):
    _, dump = dumped
    partial = tmp_path / "partial"
    shutil.copytree(dump, partial)
    (partial / "2.safetensors").unlink()
    cases = {
        "missing step": ((f"trainer.replay_rollouts_from={partial}",), "has no rollouts for step(s) 2"),
        "another n": ((f"trainer.replay_rollouts_from={dump}", "actor_rollout_ref.rollout.n=2"),
                      "was dumped with actor_rollout_ref.rollout.n=4, this run has actor_rollout_ref.rollout.n=2"),
        "another length": ((f"trainer.replay_rollouts_from={dump}", "data.max_response_length=16"),
                           "was dumped with data.max_response_length=12"),
        "no directory": ((f"trainer.replay_rollouts_from={tmp_path / 'nowhere'}",), "not a directory"),
    }
    for name, (extra, message) in cases.items():
        cfg = load_config(overrides(tiny_model_path, task, tmp_path / name.replace(" ", "_"), *_common(task), *extra))
        with pytest.raises(ConfigError, match=re.escape(message)) as info:
            Trainer(cfg)
        assert "\n" not in str(info.value), name


@pytest.mark.parametrize("rollout_sets_it", [False, True])
def test_a_length_refusal_names_the_key_that_set_it(tiny_model_path, tmp_path, rollout_sets_it):
    """rollout.response_length overrides data.max_response_length: the refusal names the key the user set."""
    from safetensors.torch import save_file

    from grpo_npu.config import derive
    from grpo_npu.replay import DUMP_FORMAT, check_dump, dump_shape

    key = "actor_rollout_ref.rollout.response_length" if rollout_sets_it else "data.max_response_length"
    rollout_length = ["actor_rollout_ref.rollout.response_length=20"] if rollout_sets_it else []
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_path}", "trainer.device=cpu",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=16",
                       *rollout_length])
    shape = dump_shape(cfg, derive(cfg, world_size=1))
    assert shape["response_length"] == (key, 20 if rollout_sets_it else 16)
    meta = {"format": DUMP_FORMAT, "step": "1", **{k: str(v.value) for k, v in shape.items()},
            "response_length": "12"}
    save_file({"prompt_ids": torch.zeros(1, 1)}, str(tmp_path / "1.safetensors"), metadata=meta)
    with pytest.raises(ConfigError, match=re.escape(f"was dumped with {key}=12, this run has {key}=")) as info:
        check_dump(tmp_path, range(1, 2), shape)
    assert "\n" not in str(info.value)
