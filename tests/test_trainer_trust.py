"""What an operator relies on (issue: trust): one run per directory, save_freq as verl means it, a finished run
says so, and a signal stops the run with its own exit code after the checkpoint."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_npu.config import load_config
from grpo_npu.data.synthetic import write_synthetic
from grpo_npu.errors import UserError
from grpo_npu.trainer import Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("task")
    write_synthetic(str(out), train_size=32, test_size=4, difficulty=1, seed=0, write_sft=False)
    return out


def args(model: str, task: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={task / 'train.parquet'}",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=hf", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
        "trainer.logger=['jsonl']", f"trainer.default_local_dir={run_dir}", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.total_training_steps=2", *extra,
    ]


def fit(argv: list[str]) -> dict:
    trainer = Trainer(load_config(argv))
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_save_freq_minus_one_saves_nothing_and_says_so(tiny_model_path, task, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        fit(args(tiny_model_path, task, run_dir, "trainer.save_freq=-1"))
    assert not list(run_dir.glob("*global_step_*")) and not (run_dir / "latest_checkpointed_iteration.txt").exists()
    assert (run_dir / "metrics.jsonl").is_file()
    assert "checkpoints: none (trainer.save_freq=-1)" in caplog.text


def test_a_finished_run_rerun_trains_nothing_and_says_so(tiny_model_path, task, tmp_path, caplog):
    run_dir = tmp_path / "run"
    argv = args(tiny_model_path, task, run_dir, "trainer.save_freq=1")
    fit(argv)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    with caplog.at_level(logging.INFO):
        assert fit(argv) == {}
    assert "already complete at step 2 (trainer.total_training_steps=2)" in caplog.text
    assert (run_dir / "metrics.jsonl").read_text().splitlines() == lines  # nothing appended


def test_a_second_trainer_on_the_same_directory_refuses(tiny_model_path, task, tmp_path):
    run_dir = tmp_path / "run"
    first = Trainer(load_config(args(tiny_model_path, task, run_dir)))
    try:
        with pytest.raises(UserError, match=rf"{run_dir} is in use by another run \(pid {os.getpid()} on host"):
            Trainer(load_config(args(tiny_model_path, task, run_dir)))
    finally:
        first.close()
    Trainer(load_config(args(tiny_model_path, task, run_dir))).close()  # released on close


def test_a_failing_end_of_run_report_still_closes_everything(tiny_model_path, task, tmp_path, monkeypatch):
    """The verdict and advice are logged as the first of the closers: if they fail, the rest still run (the run
    directory's lock is released)."""
    run_dir = tmp_path / "run"
    trainer = Trainer(load_config(args(tiny_model_path, task, run_dir, "trainer.total_training_steps=1")))
    try:
        trainer.fit()
    finally:
        monkeypatch.setattr(trainer.limits, "advice", lambda: 1 / 0)
        trainer.close()
    Trainer(load_config(args(tiny_model_path, task, run_dir, "trainer.existing_run_dir=move_aside"))).close()  # lock free


def test_sigterm_checkpoints_then_exits_143_naming_the_step(tiny_model_path, task, tmp_path):
    run_dir = tmp_path / "run"
    argv = args(tiny_model_path, task, run_dir, "trainer.total_training_steps=50", "trainer.save_freq=100")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "grpo_npu.main_ppo", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = err.strip().splitlines()[-1]
    step = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    assert last == (f"stopped: stopped by SIGTERM at step {step}, checkpoint saved in {run_dir}; "
                    "resume with trainer.resume_mode=auto")
    assert (run_dir / f"global_step_{step}").is_dir()  # saved although save_freq=100: a stop always saves


def test_resume_skips_a_truncated_newest_checkpoint(tiny_model_path, task, tmp_path, caplog):
    run_dir = tmp_path / "run"
    fit(args(tiny_model_path, task, run_dir, "trainer.save_freq=1"))
    shards = sorted((run_dir / "global_step_2").rglob("*.distcp"))
    assert shards
    shards[0].write_bytes(shards[0].read_bytes()[:-7])  # a half-written file the marker still vouches for
    with caplog.at_level(logging.INFO):
        fit(args(tiny_model_path, task, run_dir, "trainer.save_freq=1", "trainer.total_training_steps=3"))
    assert "checkpoint global_step_2 is damaged" in caplog.text and "resuming from global_step_1" in caplog.text
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # step 2 retrained from step 1's state, its old line dropped


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_ranks(tiny_model_path, task, tmp_path, caplog, saved, resumed):
    """The model reaches the new ranks intact: greedy validation right after resuming equals the validation the
    writing run did at the checkpoint's step; training then continues from the saved data position."""
    run_dir = tmp_path / "run"
    common = ["trainer.save_freq=2", f"data.val_files={task / 'test.parquet'}", "ray_init.num_cpus=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
              "actor_rollout_ref.rollout.val_kwargs.do_sample=False"]
    fit(args(tiny_model_path, task, run_dir, *common, f"trainer.n_gpus_per_node={saved}", "trainer.test_freq=2"))
    with caplog.at_level(logging.WARNING):
        fit(args(tiny_model_path, task, run_dir, *common, f"trainer.n_gpus_per_node={resumed}",
                 "trainer.total_training_steps=3", "trainer.val_before_train=True"))
    assert f"resumed on {resumed} ranks from a checkpoint written by {saved}" in caplog.text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [{k: v for k, v in r.items() if k.startswith("val-core/")} for r in rows if r["step"] == 2]
    val = [v for v in val if v]
    assert len(val) == 2 and val[0] == val[1], val  # at step 2: the writer's validation, then the resumed one's
    assert sorted({r["step"] for r in rows}) == [1, 2, 3]


def test_absurdly_large_finite_rewards_are_bad_steps(tiny_model_path, task, tmp_path):
    from grpo_npu.errors import TrainingStopped

    reward = tmp_path / "huge.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1e30 if len(solution_str) % 2 else 0.0\n")
    with pytest.raises(TrainingStopped, match=r"2 consecutive bad steps \(last: non-finite rewards or rewards beyond"):
        fit(args(tiny_model_path, task, tmp_path / "run", f"custom_reward_function.path={reward}",
                 "trainer.max_bad_steps=2", "trainer.save_freq=-1"))


def test_data_reward_fn_key_is_honoured(tiny_model_path, task, tmp_path):
    import pyarrow.parquet as pq

    table = pq.read_table(task / "train.parquet")
    renamed = table.rename_columns(["src" if c == "data_source" else c for c in table.column_names])
    pq.write_table(renamed, tmp_path / "train.parquet")
    argv = args(tiny_model_path, task, tmp_path / "run", "data.reward_fn_key=src", "trainer.total_training_steps=1")
    argv = [a for a in argv if not a.startswith("data.train_files=")] + [f"data.train_files={tmp_path / 'train.parquet'}"]
    assert "critic/score/mean" in fit(argv)


def test_the_run_says_where_things_go_and_how_to_continue_or_compare(tiny_model_path, task, tmp_path):
    run_dir = tmp_path / "run"
    argv = args(tiny_model_path, task, run_dir, "trainer.total_training_steps=1", "trainer.save_freq=1")
    proc = subprocess.run([sys.executable, "-m", "grpo_npu.main_ppo", *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert f"run directory: {run_dir} (metrics.jsonl, checkpoints, PNG curves)" in lines
    end = lines[lines.index(f"run directory: {run_dir}"):]
    assert end[1].startswith("  continue it: python -m grpo_npu.main_ppo ") and end[1].endswith(
        "trainer.resume_mode=auto trainer.total_training_steps=<more>")
    assert end[2] == f"  compare it:  python -m grpo_npu.tools.compare_runs {run_dir} <other run directory>"
    # the printed command continues the run
    cont = end[1].split("python -m grpo_npu.main_ppo ", 1)[1].replace("<more>", "2")
    proc = subprocess.run(f"{sys.executable} -m grpo_npu.main_ppo {cont}", shell=True, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_a_fresh_start_into_a_used_directory_refuses_or_moves_the_old_run_aside(tiny_model_path, task, tmp_path):
    run_dir = tmp_path / "run"
    fit(args(tiny_model_path, task, run_dir, "trainer.save_freq=1", "trainer.total_training_steps=1"))
    fresh = args(tiny_model_path, task, run_dir, "trainer.save_freq=1", "trainer.total_training_steps=2",
                 "trainer.resume_mode=disable")
    with pytest.raises(UserError, match=r"already holds another run .*global_step_1.*existing_run_dir=move_aside"):
        Trainer(load_config(fresh))
    fit(fresh + ["trainer.existing_run_dir=move_aside"])
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the new run alone
    (old,) = (run_dir / "previous_runs").iterdir()
    assert (old / "global_step_1").is_dir() and len((old / "metrics.jsonl").read_text().splitlines()) == 1
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1", "global_step_2"]


def test_a_hung_rank_ends_the_run_in_bounded_time_naming_it(tiny_model_path, task, tmp_path):
    """SIGSTOP one Ray rank mid-run: the step deadline (trainer.step_timeout_s) ends the run with one line naming
    the call and the rank, exit 1, and no checkpoint of the unfinished step."""
    from grpo_npu.workers.reaper import descendants

    run_dir = tmp_path / "run"
    argv = args(tiny_model_path, task, run_dir, "trainer.total_training_steps=50", "trainer.save_freq=1",
                "trainer.n_gpus_per_node=2", "ray_init.num_cpus=2", "trainer.step_timeout_s=15",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2")
    proc = subprocess.Popen([sys.executable, "-m", "grpo_npu.main_ppo", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    stopped = None
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 240
        while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        ranks = [pid for pid in descendants([proc.pid]) if "RankHost" in _cmdline(pid)]
        assert ranks, "no Ray rank processes found under the trainer"
        stopped = ranks[-1]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        _, err = proc.communicate(timeout=120)
        took = time.time() - stopped_at
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert took < 60, f"took {took:.0f} s"
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped: rank") and "did not answer" in last and "step deadline" in last, last
    done = max(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert sorted(int(p.name.split("_")[-1]) for p in run_dir.glob("global_step_*"))[-1] <= done


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def test_changed_optimizer_settings_on_resume_are_honoured_with_a_warning(tiny_model_path, task, tmp_path, caplog):
    run_dir = tmp_path / "run"
    fit(args(tiny_model_path, task, run_dir, "trainer.save_freq=1", "trainer.total_training_steps=1",
             "actor_rollout_ref.actor.optim.lr=1e-3"))
    with caplog.at_level(logging.WARNING):
        last = fit(args(tiny_model_path, task, run_dir, "trainer.save_freq=1", "trainer.total_training_steps=2",
                        "actor_rollout_ref.actor.optim.lr=2e-4", "actor_rollout_ref.actor.optim.weight_decay=0.05"))
    assert "resumed with changed optimizer settings, honoured from here on" in caplog.text
    assert "actor_rollout_ref.actor.optim.lr 0.001 -> 0.0002" in caplog.text
    assert "actor_rollout_ref.actor.optim.weight_decay 0.01 -> 0.05" in caplog.text
    assert last["actor/lr"] == pytest.approx(2e-4)  # constant schedule: the new peak lr, not the checkpoint's


def test_a_process_group_sigterm_under_ray_ends_promptly_as_a_signal_stop(tiny_model_path, task, tmp_path):
    """A scheduler's SIGTERM to the whole process group stops the Ray workers too: the run ends at once with
    exit 143 and one line, not after Ray's reconnect timeouts and not as an internal error."""
    run_dir = tmp_path / "run"
    argv = args(tiny_model_path, task, run_dir, "trainer.total_training_steps=50", "trainer.save_freq=100",
                "trainer.n_gpus_per_node=2", "ray_init.num_cpus=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2")
    proc = subprocess.Popen([sys.executable, "-m", "grpo_npu.main_ppo", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 240
        while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        sent = time.time()
        _, err = proc.communicate(timeout=120)
        took = time.time() - sent
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < 45, f"took {took:.0f} s"
    assert err.strip().splitlines()[-1].startswith("stopped: stopped by SIGTERM ")
