#!/usr/bin/env bash
# PPO (GAE + a critic) on GSM8K, Qwen2.5-0.5B-Instruct for both actor and critic, one node of 8
# Ascend NPUs. Sizes follow verl's PPO quick start (256 prompts, mini-batch 64, critic lr 1e-5).
#
#   python3 data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k     # once
#   bash examples/ppo_trainer/run_qwen2_5_0_5b_ppo_npu.sh [key=value ...]     # overrides win
#
# Environment: MODEL_PATH (actor and critic), DATA_DIR (default ~/data/gsm8k), NNODES,
# NPUS_PER_NODE (default 8), CKPT_DIR, ENFORCE_EAGER (False: graph mode); Ascend variables as set
# in examples/npu_env.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../npu_env.sh"

MODEL_PATH="${MODEL_PATH:-${HOME}/models/Qwen2.5-0.5B-Instruct}"  # huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir ~/models/Qwen2.5-0.5B-Instruct
project_name=grpo_npu_gsm8k
experiment_name=qwen2_5_0_5b_ppo_npu
CKPT_DIR="${CKPT_DIR:-${HOME}/ckpts/${project_name}/${experiment_name}}"

python3 -m grpo_npu.main_ppo \
    algorithm.adv_estimator=gae \
    algorithm.gamma=1.0 \
    algorithm.lam=1.0 \
    algorithm.use_kl_in_reward=False \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.use_remove_padding=False \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    actor_rollout_ref.rollout.enforce_eager="${ENFORCE_EAGER}" \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    critic.model.path="${MODEL_PATH}" \
    critic.model.enable_gradient_checkpointing=True \
    critic.optim.lr=1e-5 \
    critic.ppo_micro_batch_size_per_gpu=4 \
    trainer.critic_warmup=0 \
    trainer.logger='["console","jsonl"]' \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${experiment_name}" \
    trainer.nnodes="${NNODES}" \
    trainer.n_gpus_per_node="${NPUS_PER_NODE}" \
    trainer.default_local_dir="${CKPT_DIR}" \
    trainer.resume_mode=auto \
    trainer.save_freq=10 \
    trainer.test_freq=10 \
    trainer.total_epochs=15 \
    trainer.device=npu \
    "$@"
