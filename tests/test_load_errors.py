"""Bad input found after the run directory exists: one line, exit 2, no traceback, nothing half written.

The fast tests check the pieces in-process (the checkpoint protocol on a full disk, the metrics file); the
slow ones run the CLI end to end: a resume into a model of another shape, a truncated weights file, a full
disk (a 64 KiB tmpfs: needs root, skipped without).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import uuid
from collections import namedtuple
from pathlib import Path

import pytest

from grpo_npu import checkpoint as ckpt_lib
from grpo_npu.checkpoint import CheckpointManager
from grpo_npu.errors import UserError
from grpo_npu.tracking import Tracker
from grpo_npu.tracking.sinks import METRICS_FILE

_Usage = namedtuple("_Usage", "total used free")


# -- a full disk while committing a checkpoint (in-process) ----------------------------------------------------
def test_a_full_disk_at_commit_keeps_nothing_a_resume_would_pick(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    tmp = mgr.begin(1)
    (tmp / "trainer_state.pt").write_bytes(b"x" * 100)
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == ckpt_lib.COMPLETE_MARKER:
            real(self, "{", encoding="utf-8")  # a marker written half
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(UserError) as info:
        mgr.commit(1, tmp)
    assert str(info.value).startswith(f"checkpoint {tmp_path / 'global_step_1'}: no space left on the device")
    assert "\n" not in str(info.value)
    assert not tmp.exists() and not (tmp_path / "global_step_1").exists()
    assert mgr.latest() is None and mgr.complete_checkpoints() == []


def test_abort_says_out_of_space_only_when_the_disk_is_full(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(ckpt_lib.shutil, "disk_usage", lambda p: _Usage(1 << 40, 0, 1 << 40))
    tmp = mgr.begin(2)
    assert mgr.abort(2, tmp, torn) is torn and not tmp.exists()  # plenty of space: the error as it is
    stop = KeyboardInterrupt()
    assert mgr.abort(2, mgr.begin(2), stop) is stop
    monkeypatch.setattr(ckpt_lib.shutil, "disk_usage", lambda p: _Usage(65536, 65536, 0))
    tmp = mgr.begin(2)
    full = mgr.abort(2, tmp, torn)
    assert isinstance(full, UserError) and not tmp.exists()
    assert str(full).startswith(f"checkpoint {tmp_path / 'global_step_2'}: no space left on the device (0 bytes free")
    assert mgr.abort(2, mgr.begin(2), stop) is stop  # Ctrl-C is never a disk error
    assert mgr.abort(2, mgr.begin(2)) is None  # the old call


# -- no empty metrics.jsonl ---------------------------------------------------------------------------------
def test_a_tracker_that_logged_nothing_leaves_no_metrics_file(tmp_path):
    tracker = Tracker(tmp_path, ("console", "jsonl"), project="p", experiment="e", total_steps=2, progress=False)
    tracker.truncate_after(0)  # a resume before anything was logged
    tracker.close()
    assert not (tmp_path / METRICS_FILE).exists()


def test_metrics_file_appears_at_the_first_record_and_survives_a_resume(tmp_path):
    tracker = Tracker(tmp_path, ("jsonl",), project="p", experiment="e", progress=False)
    assert not (tmp_path / METRICS_FILE).exists()
    tracker.log({"a": 1.0}, step=1)
    tracker.log({"a": 2.0}, step=2)
    assert (tmp_path / METRICS_FILE).read_text().count("\n") == 2  # flushed as written
    tracker.close()
    resumed = Tracker(tmp_path, ("jsonl",), project="p", experiment="e", progress=False)
    resumed.truncate_after(1)
    assert (tmp_path / METRICS_FILE).read_text() == '{"step": 1, "a": 1.0}\n'
    resumed.log({"a": 3.0}, step=2)
    resumed.close()
    assert (tmp_path / METRICS_FILE).read_text() == '{"step": 1, "a": 1.0}\n{"step": 2, "a": 3.0}\n'


# -- end to end ---------------------------------------------------------------------------------------------
def _base(tiny_model_path: str, data: Path) -> list[str]:
    return ["algorithm.adv_estimator=grpo", f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}", "data.train_batch_size=2", "data.max_prompt_length=64",
            "data.max_response_length=8", f"actor_rollout_ref.model.path={tiny_model_path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2", 'trainer.logger=["console","jsonl"]',
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_training_steps=1", "trainer.save_freq=1",
            "trainer.test_freq=-1", "trainer.val_before_train=False", "trainer.device=cpu"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from grpo_npu.data.synthetic import write_synthetic

    out = tmp_path_factory.mktemp("data")
    write_synthetic(str(out), train_size=32, test_size=8, difficulty=1, seed=0, write_sft=False)
    return out


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_npu.main_ppo", *args], capture_output=True, text=True,
                          timeout=600)


def _one_line_exit_2(proc: subprocess.CompletedProcess, run_dir: Path) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / METRICS_FILE).exists()  # nothing was logged: no empty metrics file
    assert (run_dir / "train.log").is_file()
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_resume_into_a_model_of_another_shape(tiny_model_path, data, tmp_path):
    import transformers

    base = _base(tiny_model_path, data)
    first = _run(base + [f"trainer.default_local_dir={tmp_path / 'base'}"])
    assert first.returncode == 0, first.stderr[-3000:]
    wide = tmp_path / "model_wide"
    shutil.copytree(tiny_model_path, wide)
    config = transformers.AutoConfig.from_pretrained(tiny_model_path)
    config.hidden_size, config.intermediate_size = 2 * config.hidden_size, 2 * config.intermediate_size
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(wide)
    ckpt = tmp_path / "base" / "global_step_1"
    proc = _run(base + [f"trainer.default_local_dir={tmp_path / 'F2'}", "trainer.resume_mode=resume_path",
                        f"trainer.resume_from_path={ckpt}", "trainer.total_training_steps=2",
                        f"actor_rollout_ref.model.path={wide}"])
    last = _one_line_exit_2(proc, tmp_path / "F2")
    assert last.startswith(f"error: resume: checkpoint {ckpt} holds weights of another shape than "
                           f"actor_rollout_ref.model.path={wide} (model.embed_tokens.weight: saved ["), last


@pytest.mark.slow
def test_truncated_weights_name_the_key_and_the_file(tiny_model_path, data, tmp_path):
    bad = tmp_path / "mt"
    shutil.copytree(tiny_model_path, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    proc = _run(_base(tiny_model_path, data) + [f"trainer.default_local_dir={tmp_path / 'F12'}",
                                                f"actor_rollout_ref.model.path={bad}"])
    last = _one_line_exit_2(proc, tmp_path / "F12")
    assert last == (f"error: actor_rollout_ref.model.path={bad}: cannot read its weights "
                    f"({bad / 'model.safetensors'}: invalid header length)")


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (root only; skipped elsewhere: the in-process tests above simulate ENOSPC)."""
    where = tmp_path / f"small_{uuid.uuid4().hex[:8]}"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield where
    subprocess.run(["umount", str(where)], check=False)


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_nothing(tiny_model_path, data, small_disk):
    run_dir = small_disk / "run"
    proc = _run(_base(tiny_model_path, data) + [f"trainer.default_local_dir={run_dir}"])
    last = _one_line_exit_2(proc, run_dir)
    assert last.startswith(f"error: checkpoint {run_dir / 'global_step_1'}: no space left on the device"), last
    assert sorted(p.name for p in run_dir.iterdir()) == [".grpo_npu.lock", "train.log"]  # no partial checkpoint
    assert CheckpointManager(run_dir).latest() is None
