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
