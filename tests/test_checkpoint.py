"""The checkpoint directory protocol: commit, retention, discovery, and a run killed mid-save."""

from __future__ import annotations

import json
import os
import zlib
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_npu import checkpoint as ckpt
import torch

from grpo_npu.checkpoint import COMPLETE_MARKER, LATEST_FILE, CheckpointManager, is_complete, load_state_file, step_of
from grpo_npu.errors import UserError


def _save(mgr: CheckpointManager, step: int, payload: str = "weights") -> Path:
    tmp = mgr.begin(step)
    (tmp / "actor").mkdir()
    for rank in range(2):  # what two ranks would write into the shared temp dir
        (tmp / "actor" / f"model_rank_{rank}.pt").write_text(f"{payload}-{step}-{rank}")
    (tmp / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    return mgr.commit(step, tmp)


def _visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def test_commit_layout_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    assert mgr.latest() is None
    final = _save(mgr, 5)
    assert final == tmp_path / "run" / "global_step_5"
    assert (final / "actor" / "model_rank_1.pt").read_text() == "weights-5-1"
    assert is_complete(final)
    assert (tmp_path / "run" / LATEST_FILE).read_text().strip() == "5"
    assert mgr.latest() == (5, final)
    _save(mgr, 10)
    assert mgr.latest() == (10, mgr.step_dir(10))
    assert _visible(tmp_path / "run") == ["global_step_10", "global_step_5", LATEST_FILE]
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]  # no temp left over


def test_retention_keeps_newest_and_never_the_committed(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        _save(mgr, step)
    assert [s for s, _ in mgr.complete_checkpoints()] == [3, 4]
    # A resumed run going back to step 2: the abandoned future (3, 4) is left alone, older ones pruned.
    mgr1 = CheckpointManager(tmp_path, max_to_keep=1)
    _save(mgr1, 2)
    assert [s for s, _ in mgr1.complete_checkpoints()] == [2, 3, 4]
    assert mgr1.latest() == (2, mgr1.step_dir(2))
    with pytest.raises(ValueError, match="max_actor_ckpt_to_keep"):
        CheckpointManager(tmp_path, max_to_keep=0)


def test_commit_replaces_a_leftover_directory(tmp_path):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 3, payload="old")
    stale = mgr.step_dir(3) / "stale_file"
    stale.write_text("from an earlier run")
    _save(mgr, 3, payload="new")
    assert (mgr.step_dir(3) / "actor" / "model_rank_0.pt").read_text() == "new-3-0"
    assert not stale.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_latest_falls_back_when_the_latest_file_is_wrong(tmp_path):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1)
    _save(mgr, 2)
    (tmp_path / LATEST_FILE).write_text("7\n")  # names a checkpoint that does not exist
    assert mgr.latest() == (2, mgr.step_dir(2))
    (tmp_path / LATEST_FILE).write_text("garbage")
    assert mgr.latest() == (2, mgr.step_dir(2))
    (mgr.step_dir(2) / COMPLETE_MARKER).unlink()  # incomplete: marker missing
    (tmp_path / LATEST_FILE).write_text("2\n")
    assert mgr.latest() == (1, mgr.step_dir(1))
    (tmp_path / "global_step_9").mkdir()  # a directory without a marker is never chosen
    assert mgr.latest() == (1, mgr.step_dir(1))


def test_latest_file_is_the_commit_point(tmp_path, monkeypatch):
    """Killed after the rename but before the latest file moved: resume from the previous step."""
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt, "write_atomic", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(mgr, 2)
    monkeypatch.undo()
    assert is_complete(mgr.step_dir(2))
    assert mgr.latest() == (1, mgr.step_dir(1))
    _save(mgr, 2, payload="redo")  # the rerun of step 2 replaces it cleanly
    assert mgr.latest() == (2, mgr.step_dir(2))
    assert (mgr.step_dir(2) / "actor" / "model_rank_0.pt").read_text() == "redo-2-0"


def test_abort_and_begin_cleans_own_attempt(tmp_path):
    mgr = CheckpointManager(tmp_path)
    tmp = mgr.begin(4)
    (tmp / "partial").write_text("x")
    again = mgr.begin(4)  # same process, same step: a fresh, empty directory
    assert again == tmp and list(again.iterdir()) == []
    mgr.abort(4, again)
    assert not again.exists()
    assert mgr.latest() is None
    with pytest.raises(FileNotFoundError, match="begin"):
        mgr.commit(4, again)


def test_a_resume_path_outside_resume_path_mode_is_said_to_be_unused(tmp_path, caplog):
    """verl reads trainer.resume_from_path only with resume_mode=resume_path (10 of its example lines set it
    with auto): kept for those lines, and the run says what it does instead."""
    mgr = CheckpointManager(tmp_path / "run")
    _save(mgr, 6)
    other = str(tmp_path / "other" / "global_step_2")
    with caplog.at_level("WARNING", logger="grpo_npu.checkpoint"):
        assert mgr.resolve_resume("auto", other) == (6, mgr.step_dir(6))
        assert mgr.resolve_resume("disable", other) is None
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"trainer.resume_from_path={other} is read only with trainer.resume_mode=resume_path; this run's "
                    f"resume_mode=auto looks for checkpoints in {mgr.root}",
                    f"trainer.resume_from_path={other} is read only with trainer.resume_mode=resume_path; this run's "
                    "resume_mode=disable starts fresh"]


def test_resolve_resume_modes(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    assert mgr.resolve_resume("auto") is None  # nothing yet: start from scratch
    _save(mgr, 6)
    assert mgr.resolve_resume("auto") == (6, mgr.step_dir(6))
    assert mgr.resolve_resume("disable") is None
    assert mgr.resolve_resume("resume_path", str(mgr.step_dir(6))) == (6, mgr.step_dir(6))
    with pytest.raises(ValueError, match="trainer.resume_from_path"):
        mgr.resolve_resume("resume_path", None)
    missing = tmp_path / "elsewhere" / "global_step_3"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        mgr.resolve_resume("resume_path", str(missing))
    partial = tmp_path / "run" / "global_step_8"
    partial.mkdir()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        mgr.resolve_resume("resume_path", str(partial))
    with pytest.raises(ValueError, match="global_step_"):
        mgr.resolve_resume("resume_path", str(tmp_path / "run"))
    with pytest.raises(ValueError, match="auto, disable, resume_path"):
        mgr.resolve_resume("latest")


def test_step_of():
    assert step_of("/a/b/global_step_12") == 12
    with pytest.raises(ValueError, match="global_step_"):
        step_of("/a/b/step_12")


_WRITER = textwrap.dedent(
    """
    import sys, time
    from grpo_npu.checkpoint import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], max_to_keep=1)
    tmp = mgr.begin(1)
    (tmp / "model.pt").write_bytes(b"step1" * 1000)
    mgr.commit(1, tmp)
    tmp = mgr.begin(2)
    with open(tmp / "model.pt", "wb") as f:
        for i in range(10_000):
            f.write(b"x" * 65536)
            f.flush()
            if i == 3:
                print("writing", flush=True)
            time.sleep(0.01)
    mgr.commit(2, tmp)
    print("committed", flush=True)
    """
)


def test_kill_9_mid_save_resumes_from_the_previous_checkpoint(tmp_path):
    root = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", f"writer did not start: {line!r}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    stale = [p for p in root.iterdir() if p.name.startswith(".tmp_global_step_2_")]
    assert len(stale) == 1 and (stale[0] / "model.pt").stat().st_size > 0  # it died mid-write

    mgr = CheckpointManager(root, max_to_keep=1)
    assert mgr.latest() == (1, root / "global_step_1")
    assert mgr.resolve_resume("auto") == (1, root / "global_step_1")
    assert (root / "global_step_1" / "model.pt").read_bytes() == b"step1" * 1000

    # The next run cleans the dead writer's scratch when it starts saving, and carries on.
    tmp = mgr.begin(2)
    assert not stale[0].exists()
    (tmp / "model.pt").write_bytes(b"step2")
    mgr.commit(2, tmp)
    assert mgr.latest() == (2, root / "global_step_2")
    assert _visible(root) == ["global_step_2", LATEST_FILE]  # max_to_keep=1 pruned step 1


class _Payload:
    """Unpickling this runs code: it writes a marker file (what an attacker's payload would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


@pytest.mark.parametrize("name", ["trainer_state.pt", "extra_rank0.pt"])
def test_a_planted_pickle_payload_is_refused_not_run(tmp_path, name):
    marker = tmp_path / "payload_ran"
    planted = tmp_path / name
    torch.save({"global_step": 3, "loader": _Payload(marker)}, planted)
    with pytest.raises(UserError) as err:
        load_state_file(planted)
    assert not marker.exists(), "the payload ran"
    assert "\n" not in str(err.value) and str(planted) in str(err.value) and "foreign code" in str(err.value)


def test_device_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np

    from grpo_npu.device import get_device

    dev = get_device("cpu")
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save({"rng": dev.get_rng_state()}, tmp_path / "s.pt")
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    dev.set_rng_state(load_state_file(tmp_path / "s.pt")["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def _committed(manager: CheckpointManager, step: int, payload: bytes = b"weights" * 100) -> Path:
    tmp = manager.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "shard.bin").write_bytes(payload)
    (tmp / "trainer_state.pt").write_bytes(b"state")
    return manager.commit(step, tmp)


def test_manifest_lists_every_file_with_size_and_crc(tmp_path):
    path = _committed(CheckpointManager(tmp_path), 1)
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    assert marker["files"] == {"actor/shard.bin": [700, zlib.crc32(b"weights" * 100)],
                               "trainer_state.pt": [5, zlib.crc32(b"state")]}
    assert ckpt.damage(path) is None


@pytest.mark.parametrize("how", ["truncate", "flip_in_place", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog, how):
    manager = CheckpointManager(tmp_path)
    _committed(manager, 1), _committed(manager, 2)
    shard = tmp_path / "global_step_2" / "actor" / "shard.bin"
    if how == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "flip_in_place":  # same size: only the checksum can tell
        data = bytearray(shard.read_bytes())
        data[10] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    with caplog.at_level("WARNING"):
        step, path = manager.resolve_resume("auto")
    assert (step, path.name) == (1, "global_step_1")
    warning = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warning) == 1 and "global_step_2" in warning[0] and "global_step_1" in warning[0]
    assert str(shard) in warning[0]


def test_no_intact_checkpoint_is_one_line_naming_the_file(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = _committed(manager, 3)
    (path / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(UserError) as err:
        manager.resolve_resume("auto")
    assert "\n" not in str(err.value) and str(path / "trainer_state.pt") in str(err.value)


def test_resume_from_path_at_a_damaged_checkpoint_is_refused_without_fallback(tmp_path):
    manager = CheckpointManager(tmp_path)
    _committed(manager, 1)
    path = _committed(manager, 2)
    (path / "trainer_state.pt").write_bytes(b"STATE")  # same size, other bytes
    with pytest.raises(UserError, match=r"resume_from_path=.*global_step_2 is damaged: .*trainer_state.pt does not match"):
        manager.resolve_resume("resume_path", str(path))


def test_checkpoint_without_a_manifest_resumes_unverified(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    path = _committed(manager, 1)
    (path / COMPLETE_MARKER).write_text(json.dumps({"step": 1}) + "\n")  # as older versions wrote it
    with caplog.at_level("WARNING"):
        assert manager.resolve_resume("auto") == (1, path)
    assert "no file manifest" in caplog.text
