# Finds the Python that runs the examples (sourced by tiny_cpu_env.sh and npu_env.sh, not run).
#
# `python3` on PATH is used when it can import torch (an activated environment, or the system's own on an
# NPU/GPU box). Otherwise the project's own ./.venv (made by scripts/setup_env.sh) is put first on PATH.
# Neither: one line saying what to do, and the script stops (exit 1).

_grpo_npu_has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }
if ! command -v python3 >/dev/null 2>&1 || ! _grpo_npu_has_torch python3; then
    if [[ -x "${REPO_ROOT}/.venv/bin/python3" ]] && _grpo_npu_has_torch "${REPO_ROOT}/.venv/bin/python3"; then
        export PATH="${REPO_ROOT}/.venv/bin:${PATH}"
        echo "examples: using the project's environment ${REPO_ROOT}/.venv" >&2
    else
        echo "examples: no Python with torch found (python3 on PATH lacks it and ${REPO_ROOT}/.venv is missing):" \
             "run 'bash scripts/setup_env.sh' first, or activate the environment you installed grpo_npu into" >&2
        exit 1
    fi
fi
unset -f _grpo_npu_has_torch
