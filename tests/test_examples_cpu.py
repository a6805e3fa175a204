"""Every examples/**/run_*_cpu.sh runs end to end on the tiny kit (2 steps) and leaves its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_SCRIPTS = sorted(REPO.glob("examples/**/run_*_cpu.sh"))

pytestmark = pytest.mark.slow


def test_there_are_cpu_examples():
    assert len(CPU_SCRIPTS) >= 3


@pytest.mark.parametrize("script", CPU_SCRIPTS, ids=lambda p: p.name)
def test_cpu_example_runs(script, tiny_model_path, tmp_path):
    env = {
        **os.environ,
        # the scripts call python3: make it this interpreter (the venv's), whatever PATH CI has
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MODEL_PATH": tiny_model_path,
        "CACHE_DIR": str(tmp_path / "cache"),
        "RUN_DIR": str(tmp_path / "run"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stderr[-4000:]}"
    steps = {json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()}
    assert {1, 2} <= steps
