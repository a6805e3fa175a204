# Ascend NPU environment for the examples/*/run_*_npu.sh scripts (sourced, not run).
#
# Every variable below keeps a value the caller already exported, so a site can override any of
# them (e.g. HCCL_CONNECT_TIMEOUT=3600 bash run_....sh). Set before sourcing:
#   ENFORCE_EAGER   True (default): eager rollout; False: ACL graph mode (changes TASK_QUEUE_ENABLE).
# Exports REPO_ROOT and puts it on PYTHONPATH, so the scripts run from a plain checkout.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

# CANN: the toolkit's set_env.sh puts the Ascend libraries, ops and tools on the paths; NNAL's ATB
# set_env.sh (the Ascend Transformer Boost library, which vllm-ascend's attention and sampling ops load)
# does the same for ATB. Both are sourced when present, and the script says which were found.
ASCEND_TOOLKIT_HOME="${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit}"
ASCEND_NNAL_HOME="${ASCEND_NNAL_HOME:-$(dirname "${ASCEND_TOOLKIT_HOME}")/nnal}"
_found=()
for _set_env in "${ASCEND_TOOLKIT_HOME}/set_env.sh" "${ASCEND_NNAL_HOME}/atb/set_env.sh"; do
    if [[ -f "${_set_env}" ]]; then
        set +u  # CANN's scripts read variables that may be unset
        # shellcheck disable=SC1090
        source "${_set_env}"
        set -u
        _found+=("${_set_env}")
    else
        echo "npu_env: ${_set_env} not found; assuming its environment is already set" >&2
    fi
done
echo "npu_env: sourced ${#_found[@]} CANN environment script(s)${_found[*]:+: ${_found[*]}}" >&2
unset _found _set_env

# shellcheck source=python_env.sh
source "${REPO_ROOT}/examples/python_env.sh"

# HCCL: first collective of a large job can take minutes (rank discovery, weight loading elsewhere);
# "auto" port ranges let several processes share one device (training ranks + the rollout engine).
export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1800}"
export HCCL_HOST_SOCKET_PORT_RANGE="${HCCL_HOST_SOCKET_PORT_RANGE:-auto}"
export HCCL_NPU_SOCKET_PORT_RANGE="${HCCL_NPU_SOCKET_PORT_RANGE:-auto}"

# vllm-ascend >= 0.11 with sleep mode: NZ weight format breaks wake_up(); keep ND.
export VLLM_ASCEND_ENABLE_NZ="${VLLM_ASCEND_ENABLE_NZ:-0}"

# Task queue level 2 (faster op dispatch) in eager mode; graph mode (ACL graph) needs level 1.
ENFORCE_EAGER="${ENFORCE_EAGER:-True}"
if [[ "${ENFORCE_EAGER,,}" == "true" ]]; then
    export TASK_QUEUE_ENABLE="${TASK_QUEUE_ENABLE:-2}"
else
    export TASK_QUEUE_ENABLE="${TASK_QUEUE_ENABLE:-1}"
fi

# Bind each process's threads to the cores near its NPU.
export CPU_AFFINITY_CONF="${CPU_AFFINITY_CONF:-1}"

# jemalloc, when the machine has it, fragments host memory less over long runs (weights moved to
# the host and back every step). Set GRPO_NPU_NO_JEMALLOC=1 to skip.
if [[ -z "${GRPO_NPU_NO_JEMALLOC:-}" ]]; then
    for _lib in /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
                /usr/lib64/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2 /usr/local/lib/libjemalloc.so; do
        if [[ -f "${_lib}" ]]; then
            case ":${LD_PRELOAD:-}:" in
                *":${_lib}:"*) ;;
                *) export LD_PRELOAD="${_lib}${LD_PRELOAD:+:${LD_PRELOAD}}" ;;
            esac
            break
        fi
    done
    unset _lib
fi

# Expandable segments: vllm-ascend's sleep-mode memory pool (the examples use sleep mode) refuses to
# start when this variable says expandable_segments:True ("Expandable segments are not compatible
# with memory pool"), so it is removed. What training then runs with depends on torch_npu:
#   - 2.10.x (requirements/npu-9.1.txt) has the run-time toggle: grpo_npu turns expandable segments
#     ON for training and OFF around the rollout engine, inside each worker;
#   - 2.5.1 / 2.7.1 (npu-8.1, npu-8.3) have none: they stay OFF for the whole run (the static setting;
#     the trainer says so once at start, python -m grpo_npu.doctor too). docs/npu.md section 5.
# vllm-ascend up to 0.9.1 (npu-8.1's 0.7.3.post1) asserts on CUDA's variable instead, which torch_npu never
# reads: expandable segments are removed from both.
for _var in PYTORCH_NPU_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF; do
    _alloc_conf="${!_var:-}"
    _alloc_conf="${_alloc_conf,,}"
    if [[ "${_alloc_conf// /}" == *expandable_segments:true* ]]; then
        echo "npu_env: unsetting ${_var}=${!_var} (it conflicts with sleep mode; expandable segments are turned on for training at run time only where torch_npu has the toggle, 2.10.x)" >&2
        unset "${_var}"
    fi
done
unset _alloc_conf _var

# Data and checkpoints.
DATA_DIR="${DATA_DIR:-${HOME}/data/gsm8k}"
NNODES="${NNODES:-1}"
NPUS_PER_NODE="${NPUS_PER_NODE:-8}"
