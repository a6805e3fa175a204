"""grpo_npu.rundir: a second trainer on a locked run directory refuses; a dead holder's lock is taken over;
a fresh start into a directory holding another run refuses or moves the old run aside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from grpo_npu.errors import UserError
from grpo_npu.rundir import LOCK_FILE, PREVIOUS_RUNS, RunDirLock, prepare_fresh_start, read_holder

HOLD = textwrap.dedent("""
    import sys, time
    from grpo_npu.rundir import RunDirLock
    lock = RunDirLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(60)
""")


def _holder_process(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_on_a_locked_directory_refuses_naming_the_holder(tmp_path):
    proc = _holder_process(tmp_path)
    try:
        with pytest.raises(UserError) as err:
            RunDirLock(tmp_path).acquire()
        msg = str(err.value)
        assert "\n" not in msg and str(tmp_path) in msg and f"pid {proc.pid}" in msg and "host" in msg
    finally:
        proc.kill()
        proc.wait()


def test_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    proc = _holder_process(tmp_path)
    proc.kill()  # kill -9: no clean-up ran, the file still names the dead pid
    proc.wait()
    assert read_holder(tmp_path / LOCK_FILE)["pid"] == proc.pid
    with caplog.at_level("WARNING"), RunDirLock(tmp_path) as lock:
        assert read_holder(lock.path)["pid"] == os.getpid()
    assert f"pid {proc.pid}" in caplog.text and "no longer running" in caplog.text
    assert read_holder(tmp_path / LOCK_FILE) == {}  # released cleanly: nothing to take over next time


def test_lock_is_exclusive_within_one_process_too(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(UserError, match="in use by another run"):
            RunDirLock(tmp_path).acquire()
    RunDirLock(tmp_path).acquire().release()


def _old_run(run_dir):
    (run_dir / "global_step_30").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "x": 1.0}) + "\n")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("30")
    (run_dir / "reward.png").write_bytes(b"png")
    (run_dir / "notes.txt").write_text("the user's own file")


def test_fresh_start_into_a_used_directory_refuses_by_default(tmp_path):
    _old_run(tmp_path)
    with pytest.raises(UserError) as err:
        prepare_fresh_start(tmp_path, "refuse")
    msg = str(err.value)
    assert "\n" not in msg and "global_step_30" in msg and "trainer.existing_run_dir=move_aside" in msg
    assert (tmp_path / "metrics.jsonl").exists()  # nothing touched


def test_fresh_start_moves_the_old_run_aside(tmp_path):
    _old_run(tmp_path)
    dest = prepare_fresh_start(tmp_path, "move_aside")
    assert dest.parent == tmp_path / PREVIOUS_RUNS
    assert sorted(p.name for p in dest.iterdir()) == ["global_step_30", "latest_checkpointed_iteration.txt",
                                                       "metrics.jsonl", "reward.png"]
    assert not (tmp_path / "metrics.jsonl").exists() and (tmp_path / "notes.txt").exists()
    assert prepare_fresh_start(tmp_path, "refuse") is None  # clean now; previous_runs/ itself is not a run


def test_unknown_policy_is_refused(tmp_path):
    with pytest.raises(UserError, match="trainer.existing_run_dir='keep'; supported values: refuse, move_aside"):
        prepare_fresh_start(tmp_path, "keep")
