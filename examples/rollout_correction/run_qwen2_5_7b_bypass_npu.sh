#!/usr/bin/env bash
# Rollout correction in bypass mode on GSM8K, Qwen2.5-7B-Instruct, one node of 8 Ascend NPUs (Atlas A2/A3, 64 GB each).
# As verl's public rollout-correction example: RLOO, the engine's (vllm-ascend, bf16) log-probs as the old
# policy (no old-log-prob pass), sequence-level truncated IS weights pi_theta / pi_rollout (threshold 2,
# batch-normalised) and the REINFORCE loss -A w log pi_theta; rollout_corr/* logged by the update.
#
#   python3 data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k     # once
#   bash examples/rollout_correction/run_qwen2_5_7b_bypass_npu.sh [key=value ...]       # overrides win
#
# Environment: MODEL_PATH, DATA_DIR (default ~/data/gsm8k), NNODES, NPUS_PER_NODE (default 8),
# CKPT_DIR, ENFORCE_EAGER (False: graph mode); Ascend variables as set in examples/npu_env.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../npu_env.sh"

MODEL_PATH="${MODEL_PATH:-${HOME}/models/Qwen2.5-7B-Instruct}"  # huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir ~/models/Qwen2.5-7B-Instruct
project_name=grpo_npu_gsm8k
experiment_name=qwen2_5_7b_rloo_bypass_npu
CKPT_DIR="${CKPT_DIR:-${HOME}/ckpts/${project_name}/${experiment_name}}"

python3 -m grpo_npu.main_ppo \
    algorithm.adv_estimator=rloo \
    algorithm.gamma=1.0 \
    algorithm.rollout_correction.rollout_is=sequence \
    algorithm.rollout_correction.rollout_is_threshold=2.0 \
    algorithm.rollout_correction.rollout_is_batch_normalize=True \
    algorithm.rollout_correction.bypass_mode=True \
    algorithm.rollout_correction.loss_type=reinforce \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=left \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=5e-7 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.ppo_epochs=1 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.enforce_eager="${ENFORCE_EAGER}" \
    trainer.critic_warmup=0 \
    trainer.logger='["console","jsonl"]' \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${experiment_name}" \
    trainer.nnodes="${NNODES}" \
    trainer.n_gpus_per_node="${NPUS_PER_NODE}" \
    trainer.default_local_dir="${CKPT_DIR}" \
    trainer.resume_mode=auto \
    trainer.val_before_train=True \
    trainer.save_freq=10 \
    trainer.test_freq=5 \
    trainer.total_epochs=10 \
    trainer.device=npu \
    "$@"
