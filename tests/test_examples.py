"""examples/: every script parses (bash -n); every run script's main_ppo command line is a valid config.

The command line is captured by running the script with a stub ``python3`` first on PATH: for
``-m grpo_npu.main_ppo`` it records argv and the environment and exits; anything else (building the
tiny kit, writing the synthetic data) runs in the real interpreter. CANN's set_env.sh is skipped by
pointing ASCEND_TOOLKIT_HOME at a folder without it. Config parsing never touches a device, so the
NPU scripts are checked here with trainer.device left as npu. The CPU scripts run end to end in
the trainer's own tests; here only their configuration is checked.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_npu.config import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
ALL_SCRIPTS = sorted(EXAMPLES.rglob("*.sh"))
NPU_SCRIPTS = sorted(EXAMPLES.rglob("run_*_npu.sh"))
CPU_SCRIPTS = sorted(EXAMPLES.rglob("run_*_cpu.sh"))

STUB = """#!/usr/bin/env bash
if [[ "${1:-}" == "-m" && "${2:-}" == "grpo_npu.main_ppo" ]]; then
    shift 2
    printf '%s\\0' "$@" > "${STUB_ARGV_OUT}"
    env -0 > "${STUB_ENV_OUT}"
    exit 0
fi
exec "${STUB_REAL_PYTHON}" "$@"
"""

# Variables the scripts read: cleared so the test sees the scripts' own defaults.
SCRIPT_INPUTS = ("MODEL_PATH", "DATA_DIR", "CKPT_DIR", "RUN_DIR", "NNODES", "NPUS_PER_NODE", "ENFORCE_EAGER",
                 "ROLLOUT", "CACHE_DIR", "GRPO_NPU_CACHE", "HCCL_CONNECT_TIMEOUT", "HCCL_HOST_SOCKET_PORT_RANGE",
                 "HCCL_NPU_SOCKET_PORT_RANGE", "VLLM_ASCEND_ENABLE_NZ", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF",
                 "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "LD_PRELOAD", "ASCEND_NNAL_HOME")


def capture(script: Path, tmp_path: Path, *extra: str, env: dict[str, str] | None = None):
    """Run ``script`` with the stub python3; returns (main_ppo argv, its environment, stderr)."""
    stub_dir = tmp_path / "stub_bin"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "python3"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    argv_out, env_out = tmp_path / "argv.bin", tmp_path / "env.bin"
    argv_out.unlink(missing_ok=True)
    full_env = {k: v for k, v in os.environ.items() if k not in SCRIPT_INPUTS}
    full_env |= {
        "PATH": f"{stub_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "ASCEND_TOOLKIT_HOME": str(tmp_path / "no_cann"),
        "STUB_ARGV_OUT": str(argv_out),
        "STUB_ENV_OUT": str(env_out),
        "STUB_REAL_PYTHON": sys.executable,
        **(env or {}),
    }
    proc = subprocess.run(["bash", str(script), *extra], env=full_env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stderr}"
    assert argv_out.is_file(), f"{script.name} never ran python3 -m grpo_npu.main_ppo"
    argv = argv_out.read_bytes().decode().split("\0")[:-1]
    script_env = dict(item.split("=", 1) for item in env_out.read_bytes().decode().split("\0") if "=" in item)
    return argv, script_env, proc.stderr


def test_scripts_found():
    names = {p.name for p in ALL_SCRIPTS}
    assert {"run_qwen2_5_0_5b_grpo_npu.sh", "run_qwen2_5_7b_grpo_npu.sh", "run_qwen3_8b_grpo_npu.sh",
            "run_qwen2_5_7b_dapo_npu.sh", "run_qwen2_5_0_5b_ppo_npu.sh", "run_tiny_grpo_cpu.sh",
            "run_tiny_dapo_cpu.sh", "run_tiny_ppo_cpu.sh", "run_qwen3_8b_otb_npu.sh", "run_qwen2_5_7b_bypass_npu.sh"} <= names


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if script.name.startswith("run_"):
        assert "set -euo pipefail" in script.read_text()
        assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script", NPU_SCRIPTS, ids=lambda p: p.name)
def test_npu_script_config_and_environment(script, tmp_path):
    argv, env, stderr = capture(script, tmp_path, env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
                                                       "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    cfg = load_config(argv)
    assert cfg.trainer.device == "npu"
    assert cfg.actor_rollout_ref.model.path.startswith((str(tmp_path / "home/models/Qwen2.5-"), str(tmp_path / "home/models/Qwen3-")))
    home = tmp_path / "home"
    assert cfg.data.train_files == (str(home / "data/gsm8k/train.parquet"),)
    assert cfg.data.val_files == (str(home / "data/gsm8k/test.parquet"),)
    assert cfg.trainer.default_local_dir.startswith(str(home / "ckpts"))
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 8
    assert cfg.actor_rollout_ref.rollout.enforce_eager is True
    assert tuple(cfg.trainer.logger) == ("console", "jsonl")
    # Ascend environment
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == "auto" and env["HCCL_NPU_SOCKET_PORT_RANGE"] == "auto"
    assert env["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert env["TASK_QUEUE_ENABLE"] == "2"
    assert env["CPU_AFFINITY_CONF"] == "1"
    assert "PYTORCH_NPU_ALLOC_CONF" not in env and "unsetting PYTORCH_NPU_ALLOC_CONF" in stderr
    # vllm-ascend 0.7.3.post1's sleep pool asserts on CUDA's variable (device_allocator/camem.py:155)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and "unsetting PYTORCH_CUDA_ALLOC_CONF" in stderr
    assert str(REPO) in env["PYTHONPATH"].split(os.pathsep)
    assert "set_env.sh not found" in stderr


def test_npu_script_overrides(tmp_path):
    script = EXAMPLES / "grpo_trainer" / "run_qwen2_5_7b_grpo_npu.sh"
    env = {"MODEL_PATH": "/models/qwen7b", "DATA_DIR": "/data/gsm", "NNODES": "2", "ENFORCE_EAGER": "False",
           "PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:256", "HCCL_CONNECT_TIMEOUT": "3600"}
    argv, script_env, _ = capture(script, tmp_path, "trainer.total_epochs=2", "data.train_batch_size=512", env=env)
    cfg = load_config(argv)
    assert cfg.actor_rollout_ref.model.path == "/models/qwen7b"
    assert cfg.data.train_files == ("/data/gsm/train.parquet",)
    assert cfg.trainer.nnodes == 2
    assert cfg.trainer.total_epochs == 2 and cfg.data.train_batch_size == 512  # "$@" comes last and wins
    assert cfg.actor_rollout_ref.rollout.enforce_eager is False
    assert script_env["TASK_QUEUE_ENABLE"] == "1"  # graph mode
    assert script_env["HCCL_CONNECT_TIMEOUT"] == "3600"  # a site's own value is kept
    assert script_env["PYTORCH_NPU_ALLOC_CONF"] == "max_split_size_mb:256"  # only expandable segments are removed


def test_cann_set_env_is_sourced_when_present(tmp_path):
    cann = tmp_path / "cann"
    cann.mkdir()
    (cann / "set_env.sh").write_text('export ASCEND_FAKE_SOURCED=yes\necho "${SOME_UNSET_VAR}" >/dev/null\n')
    _, env, stderr = capture(EXAMPLES / "ppo_trainer" / "run_qwen2_5_0_5b_ppo_npu.sh", tmp_path,
                             env={"ASCEND_TOOLKIT_HOME": str(cann)})
    assert env["ASCEND_FAKE_SOURCED"] == "yes" and f"{cann}/set_env.sh not found" not in stderr


def test_nnal_atb_set_env_is_sourced_too(tmp_path):
    ascend = tmp_path / "Ascend"
    (ascend / "ascend-toolkit").mkdir(parents=True)
    (ascend / "nnal" / "atb").mkdir(parents=True)
    (ascend / "ascend-toolkit" / "set_env.sh").write_text("export ASCEND_FAKE_TOOLKIT=yes\n")
    (ascend / "nnal" / "atb" / "set_env.sh").write_text("export ASCEND_FAKE_ATB=yes\n")
    _, env, stderr = capture(EXAMPLES / "grpo_trainer" / "run_qwen2_5_0_5b_grpo_npu.sh", tmp_path,
                             env={"ASCEND_TOOLKIT_HOME": str(ascend / "ascend-toolkit")})
    assert env["ASCEND_FAKE_TOOLKIT"] == "yes" and env["ASCEND_FAKE_ATB"] == "yes"
    assert "sourced 2 CANN environment script(s)" in stderr and "not found" not in stderr
    _, env, stderr = capture(EXAMPLES / "grpo_trainer" / "run_qwen2_5_0_5b_grpo_npu.sh", tmp_path)
    assert "atb/set_env.sh not found" in stderr and "sourced 0" in stderr


def _copy_examples_without_venv(tmp_path: Path) -> Path:
    """A checkout-like copy of examples/ (REPO_ROOT = its parent) with no .venv beside it."""
    import shutil

    root = tmp_path / "checkout"
    shutil.copytree(EXAMPLES, root / "examples")
    return root


def test_scripts_say_in_one_line_when_no_python_environment_is_found(tmp_path):
    root = _copy_examples_without_venv(tmp_path)
    no_torch = tmp_path / "no_torch_bin"
    no_torch.mkdir()
    (no_torch / "python3").write_text("#!/usr/bin/env bash\nexit 1\n")
    (no_torch / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_INPUTS}
    env |= {"PATH": f"{no_torch}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path / "home")}
    proc = subprocess.run(["bash", str(root / "examples/grpo_trainer/run_tiny_grpo_cpu.sh")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run 'bash scripts/setup_env.sh' first" in lines[0], proc.stderr


def test_scripts_use_the_project_venv_when_python3_lacks_torch(tmp_path):
    root = _copy_examples_without_venv(tmp_path)
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python3").write_text(f"#!/usr/bin/env bash\n"
                                      f"if [[ \"${{1:-}}\" == -m && \"${{2:-}}\" == grpo_npu.main_ppo ]]; then\n"
                                      f"  echo VENV_PYTHON_RAN; exit 0\nfi\nexec {sys.executable} \"$@\"\n")
    (venv_bin / "python3").chmod(0o755)
    no_torch = tmp_path / "no_torch_bin"
    no_torch.mkdir()
    (no_torch / "python3").write_text("#!/usr/bin/env bash\nexit 1\n")
    (no_torch / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_INPUTS}
    env |= {"PATH": f"{no_torch}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path / "home"),
            "ASCEND_TOOLKIT_HOME": str(tmp_path / "no_cann")}
    proc = subprocess.run(["bash", str(root / "examples/grpo_trainer/run_qwen2_5_0_5b_grpo_npu.sh")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "VENV_PYTHON_RAN" in proc.stdout and "using the project's environment" in proc.stderr


def test_dapo_and_ppo_npu_scripts_turn_on_their_algorithms(tmp_path):
    dapo = load_config(capture(EXAMPLES / "dapo" / "run_qwen2_5_7b_dapo_npu.sh", tmp_path)[0])
    assert dapo.algorithm.filter_groups.enable and dapo.reward_model.reward_manager == "dapo"
    assert dapo.reward_model.overlong_buffer.enable
    assert dapo.actor_rollout_ref.actor.clip_ratio_high > dapo.actor_rollout_ref.actor.clip_ratio_low
    assert dapo.actor_rollout_ref.actor.loss_agg_mode == "token-mean"
    ppo = load_config(capture(EXAMPLES / "ppo_trainer" / "run_qwen2_5_0_5b_ppo_npu.sh", tmp_path)[0])
    assert ppo.algorithm.adv_estimator == "gae" and ppo.critic.model.path == ppo.actor_rollout_ref.model.path


def test_cpu_scripts_build_the_kit_and_parse(tiny_model_path, tmp_path):
    cache = Path(tiny_model_path).parent  # the kit is rebuilt only if missing: reused here
    for i, script in enumerate(CPU_SCRIPTS):
        run_dir = tmp_path / f"run_{script.stem}"
        env = {"CACHE_DIR": str(cache), "DATA_DIR": str(tmp_path / "arith"), "RUN_DIR": str(run_dir)}
        if i:  # the first script finds the kit through grpo_npu.models.tiny; the rest are given it
            env["MODEL_PATH"] = tiny_model_path
        argv, script_env, _ = capture(script, tmp_path, env=env)
        cfg = load_config(argv)
        assert cfg.trainer.device == "cpu", script.name
        assert cfg.actor_rollout_ref.model.path == tiny_model_path
        assert cfg.trainer.default_local_dir == str(run_dir)
        assert cfg.trainer.total_training_steps == 2 and cfg.trainer.save_freq == 1
        assert Path(cfg.data.train_files[0]).is_file() and Path(cfg.data.val_files[0]).is_file()
        assert script_env["HF_HUB_OFFLINE"] == "1"
