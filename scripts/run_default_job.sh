#!/usr/bin/env bash
# Set up the environment (idempotent) and run the embedded default job: the offline tiny Qwen2,
# the synthetic arithmetic task, a cached SFT warm start, then GRPO with a KL loss on the CPU.
# Extra arguments are passed to grpo_npu.main_ppo (e.g. --help); with none, the default job runs.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh" || exit 1
venv="${GRPO_NPU_VENV:-$repo/.venv}"
cd "$repo"
exec "$venv/bin/python" -m grpo_npu.main_ppo "$@"
