#!/usr/bin/env bash
# PPO (GAE + a critic built from the same tiny model) end to end on a plain CPU with the offline
# tiny kit: 2 steps, 2 worker processes, a checkpoint after each step.
#
#   bash examples/ppo_trainer/run_tiny_ppo_cpu.sh [key=value ...]             # overrides win
#
# Expected runtime on 2 CPU cores: about 1-3 minutes (plus ~10 s the first time, to build the
# tiny kit). Environment: RUN_DIR, MODEL_PATH, DATA_DIR, ROLLOUT (hf|vllm), CACHE_DIR.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../tiny_cpu_env.sh"

python3 -m grpo_npu.main_ppo \
    algorithm.adv_estimator=gae \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/test.parquet" \
    data.train_batch_size=8 \
    data.max_prompt_length=64 \
    data.max_response_length=32 \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.name="${ROLLOUT}" \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    critic.model.path="${MODEL_PATH}" \
    critic.optim.lr=1e-4 \
    critic.ppo_micro_batch_size_per_gpu=4 \
    trainer.logger='["console","jsonl"]' \
    trainer.project_name=grpo_npu_tiny \
    trainer.experiment_name=ppo_cpu \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=2 \
    trainer.default_local_dir="${RUN_DIR}" \
    trainer.total_training_steps=2 \
    trainer.save_freq=1 \
    trainer.test_freq=2 \
    trainer.val_before_train=False \
    trainer.device=cpu \
    "$@"
