"""Entry points: bad input is one line on stderr and exit code 2; --help and --cfg exit 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpo_npu import cli, main_ppo, main_sft
from grpo_npu import env as env_defaults
from grpo_npu.env import CPU_MALLOC_ENV, PROCESS_ENV_DEFAULTS, apply_process_env_defaults

BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]


@pytest.fixture(autouse=True)
def _keep_environ():
    """main() sets process-environment defaults; keep them from leaking into later tests' subprocesses."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("main", [main_ppo.main, main_sft.main])
def test_bad_config_is_one_line_and_exit_2(main, capsys):
    assert main(BASE + ["data.train_batch_size=abc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: data.train_batch_size")


def test_missing_data_file_is_one_line_and_exit_2(tiny_model_path, tmp_path, capsys):
    code = main_sft.main(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}",
                                 f"data.train_files={tmp_path / 'missing.parquet'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "missing.parquet" in err[-1]


def test_sigint_outside_a_training_step_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while the run starts (loading data, models, the engine) used to leave a KeyboardInterrupt traceback."""
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(main_ppo, "train", interrupted)
    assert main_ppo.main(BASE) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "stopped: SIGINT while the run was starting or closing (outside a training step)"]


def test_help_and_cfg_exit_0(capsys):
    assert main_ppo.main(["--help"]) == 0
    assert "actor_rollout_ref.rollout.name" in capsys.readouterr().out
    assert main_ppo.main(["--cfg"] + BASE) == 0
    assert "train_batch_size: 2" in capsys.readouterr().out


def test_process_env_defaults_fill_only_what_is_missing():
    env = {"THP_MEM_ALLOC_ENABLE": "0", "OTHER": "x"}
    assert apply_process_env_defaults(env) == {}
    assert env == {"THP_MEM_ALLOC_ENABLE": "0", "OTHER": "x"}  # the user's choice wins
    env = {}
    assert apply_process_env_defaults(env) == PROCESS_ENV_DEFAULTS == env


# torch's CPU allocator page-aligns (4096) buffers >= 2 MB only when it saw THP_MEM_ALLOC_ENABLE=1 at start;
# otherwise it aligns to 64 bytes, which for an mmap-backed buffer is not a page boundary.
_ALIGNMENT_PROBE = """
import contextlib, io, sys
from grpo_npu import main_ppo
with contextlib.redirect_stdout(io.StringIO()):
    assert main_ppo.main(["--help"]) == 0
import torch
print(sorted({torch.empty(1 << 20).data_ptr() % 4096 for _ in range(4)}))
"""


@pytest.mark.parametrize("preset, page_aligned", [(None, True), ("0", False)])
def test_entry_point_sets_thp_before_torch_reads_it(preset, page_aligned):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if preset is not None:
        env["THP_MEM_ALLOC_ENABLE"] = preset
    out = subprocess.run([sys.executable, "-c", _ALIGNMENT_PROBE], env=env, capture_output=True, text=True, check=True)
    assert (out.stdout.strip().splitlines()[-1] == "[0]") is page_aligned


class _FakeLibc:
    def __init__(self, result=1):
        self.calls, self.result = [], result

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.result


def test_cpu_malloc_settings_reach_children_and_this_process():
    libc, env = _FakeLibc(), {}
    assert env_defaults.retain_freed_host_memory(env, libc) == CPU_MALLOC_ENV == env
    assert libc.calls == [(-4, 0), (-1, 2**31 - 1)]  # M_MMAP_MAX = 0, M_TRIM_THRESHOLD = 2 GiB - 1
    assert env == {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


@pytest.mark.parametrize("preset", [{"MALLOC_MMAP_MAX_": "65536"}, {"MALLOC_TRIM_THRESHOLD_": "0"}])
def test_users_own_malloc_tuning_is_kept_whole(preset):
    libc, env = _FakeLibc(), dict(preset)
    assert env_defaults.retain_freed_host_memory(env, libc) == {} and env == preset and libc.calls == []


def test_cpu_malloc_settings_need_glibc_and_a_cpu_run(monkeypatch):
    monkeypatch.setattr(env_defaults, "_glibc", lambda: None)  # musl, macOS, ...
    env = {}
    assert env_defaults.retain_freed_host_memory(env) == {} and env == {}
    monkeypatch.setattr(env_defaults, "retain_freed_host_memory", lambda: dict(CPU_MALLOC_ENV))
    import grpo_npu.device as device

    assert cli.apply_device_defaults("cpu") == CPU_MALLOC_ENV
    monkeypatch.setattr(device, "resolve_kind", lambda name: "cuda")
    assert cli.apply_device_defaults("auto") == {}  # accelerator hosts hand their host memory back
    assert cli.apply_device_defaults("npu") == {}


# 256 MB, written, freed: by default glibc unmaps it (RSS drops); retained, the process keeps it for reuse.
_RETAIN_PROBE = """
import sys, torch
from grpo_npu import env
if sys.argv[1] == "retain":
    assert env.retain_freed_host_memory() == env.CPU_MALLOC_ENV
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
t = torch.ones(64 << 20)  # 256 MB
held = rss_mb()
del t
print(round(held - rss_mb()))
"""


@pytest.mark.skipif(env_defaults._glibc() is None, reason="needs glibc")
@pytest.mark.parametrize("mode, kept", [("default", False), ("retain", True)])
def test_freed_host_memory_is_kept_only_when_retained(mode, kept):
    env = {k: v for k, v in os.environ.items() if k not in CPU_MALLOC_ENV}
    out = subprocess.run([sys.executable, "-c", _RETAIN_PROBE, mode], env=env, capture_output=True, text=True,
                         check=True)
    released_mb = int(out.stdout.strip().splitlines()[-1])
    assert (released_mb < 16) is kept, f"{mode}: {released_mb} MB handed back on free"


@pytest.mark.parametrize("kind", ["npu", "cuda"], ids=["ascend_absent", "gpu_absent"])  # not skipped as hardware tests
def test_missing_device_is_one_line_naming_the_key_and_the_doctor(kind, tiny_model_path, tmp_path):
    """A subprocess, so that nothing else printed before it hides a traceback."""
    argv = BASE + [f"actor_rollout_ref.model.path={tiny_model_path}", f"trainer.device={kind}",
                   f"trainer.default_local_dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "grpo_npu.main_ppo", *argv], capture_output=True, text=True,
                          timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith(f"error: trainer.device={kind} but ") and "python -m grpo_npu.doctor" in err[0]


def test_worker_user_error_is_one_line_and_exit_2(tiny_model_path, tmp_path):
    """A bad key that only the worker can judge (a model field that does not exist) ends as one line, no traceback."""
    from grpo_npu.data.synthetic import write_synthetic

    write_synthetic(str(tmp_path / "data"), train_size=8, test_size=2, difficulty=1, seed=0, write_sft=False)
    run_dir = tmp_path / "run"
    argv = BASE + [f"actor_rollout_ref.model.path={tiny_model_path}", "trainer.device=cpu",
                   f"data.train_files={tmp_path / 'data' / 'train.parquet'}", "actor_rollout_ref.rollout.name=hf",
                   f"trainer.default_local_dir={run_dir}", "+actor_rollout_ref.model.override_config.not_a_field=1"]
    proc = subprocess.run([sys.executable, "-m", "grpo_npu.main_ppo", *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "error: model.override_config.not_a_field: Qwen2Config has no such field"
    assert "Traceback" in (run_dir / "train.log").read_text()  # the full story stays in the run's log


def test_internal_errors_are_one_line_with_exit_3_and_the_log_named(capsys, tmp_path, monkeypatch):
    from grpo_npu import logs
    from grpo_npu.errors import WorkerError

    monkeypatch.setattr(logs, "_current_log", [tmp_path / "train.log"])

    def fail_on_rank_1():
        try:
            raise RuntimeError("CUDA error: an illegal memory access\nmore details")
        except RuntimeError as exc:
            raise WorkerError.from_exception(1, "update_actor", exc) from None

    assert cli.exit_code(fail_on_rank_1) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"internal error: rank 1 in update_actor(): RuntimeError: CUDA error: an illegal memory access "
                   f"(traceback in {tmp_path / 'train.log'}; GRPO_NPU_DEBUG=1 shows it here)"]

    def crash():
        raise KeyError("x")

    assert cli.exit_code(crash) == 3
    assert capsys.readouterr().err.startswith("internal error: KeyError: 'x'")
    monkeypatch.setenv("GRPO_NPU_DEBUG", "1")
    assert cli.exit_code(crash) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_rank_that_stops_the_run_by_policy_exits_1_with_its_line(capsys):
    import pickle

    from grpo_npu.errors import SyncMismatch, WorkerError

    def stop_on_rank_1():
        try:
            raise SyncMismatch("weight-sync canary at step 3: ...; turn the check off with x.enable=False")
        except SyncMismatch as exc:
            error = WorkerError.from_exception(1, "generate", exc)
        raise pickle.loads(pickle.dumps(error))  # as it crosses the Ray boundary

    assert cli.exit_code(stop_on_rank_1) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "stopped: rank 1: weight-sync canary at step 3: ...; turn the check off with x.enable=False"]


@pytest.mark.parametrize("key", ["train_files", "val_files"])
def test_a_bad_data_file_list_names_its_key(key, tiny_model_path, tmp_path, capsys):
    """Which of the two lists is wrong is in the line (it used to say "data.train_files / data.val_files")."""
    from grpo_npu.data.synthetic import write_synthetic

    write_synthetic(str(tmp_path / "data"), train_size=8, test_size=2, difficulty=1, seed=0, write_sft=False)
    files = {"train_files": tmp_path / "data" / "train.parquet", "val_files": tmp_path / "data" / "test.parquet"}
    files[key] = tmp_path / "missing.parquet"
    argv = BASE + [f"actor_rollout_ref.model.path={tiny_model_path}", "trainer.device=cpu",
                   "actor_rollout_ref.rollout.name=hf", f"trainer.default_local_dir={tmp_path / 'run'}",
                   *(f"data.{k}={v}" for k, v in files.items())]
    assert main_ppo.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: data.{key}: {files[key]} does not exist"
    if key == "train_files":
        assert main_ppo.main(argv + ["data.train_files=[]"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "error: data.train_files is empty: expected a parquet file or a list of them")
