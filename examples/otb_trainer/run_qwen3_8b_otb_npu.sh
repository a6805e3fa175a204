#!/usr/bin/env bash
# Optimal token baseline (algorithm.adv_estimator=optimal_token_baseline) on GSM8K, Qwen3-8B, one node of 8 Ascend
# NPUs (Atlas A2/A3, 64 GB each). Sizes follow verl's public OTB example: 128 prompts x 8 responses, one
# mini-batch, token-budget packing, rollout TP 2. The old-log-prob pass also returns sum pi^2 per token
# (actor.calculate_sum_pi_squared), which the baseline weighs each response by; variance_proxy/* is logged.
#
#   python3 data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k     # once
#   bash examples/otb_trainer/run_qwen3_8b_otb_npu.sh [key=value ...]       # overrides win
#
# Environment: MODEL_PATH, DATA_DIR (default ~/data/gsm8k), NNODES, NPUS_PER_NODE (default 8),
# CKPT_DIR, ENFORCE_EAGER (False: graph mode); Ascend variables as set in examples/npu_env.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../npu_env.sh"

MODEL_PATH="${MODEL_PATH:-${HOME}/models/Qwen3-8B}"  # huggingface-cli download Qwen/Qwen3-8B --local-dir ~/models/Qwen3-8B
project_name=grpo_npu_gsm8k
experiment_name=qwen3_8b_otb_npu
CKPT_DIR="${CKPT_DIR:-${HOME}/ckpts/${project_name}/${experiment_name}}"

python3 -m grpo_npu.main_ppo \
    algorithm.adv_estimator=optimal_token_baseline \
    algorithm.use_kl_in_reward=False \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.calculate_sum_pi_squared=True \
    actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.75 \
    actor_rollout_ref.rollout.enforce_eager="${ENFORCE_EAGER}" \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576 \
    trainer.critic_warmup=0 \
    trainer.logger='["console","jsonl"]' \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${experiment_name}" \
    trainer.nnodes="${NNODES}" \
    trainer.n_gpus_per_node="${NPUS_PER_NODE}" \
    trainer.default_local_dir="${CKPT_DIR}" \
    trainer.resume_mode=auto \
    trainer.val_before_train=True \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 \
    trainer.device=npu \
    "$@"
