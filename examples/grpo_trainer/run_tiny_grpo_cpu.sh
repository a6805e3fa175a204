#!/usr/bin/env bash
# GRPO end to end on a plain CPU with the offline tiny kit: 2 steps, 2 worker processes, a
# checkpoint after each step, metrics.jsonl + PNG curves in RUN_DIR. The pipeline check to run
# before an NPU job (same code path, same keys as run_qwen2_5_0_5b_grpo_npu.sh, tiny sizes).
#
#   bash examples/grpo_trainer/run_tiny_grpo_cpu.sh [key=value ...]           # overrides win
#
# Expected runtime on 2 CPU cores: about 1-3 minutes (plus ~10 s the first time, to build the
# tiny kit). Environment: RUN_DIR, MODEL_PATH, DATA_DIR, ROLLOUT (hf|vllm), CACHE_DIR.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../tiny_cpu_env.sh"

python3 -m grpo_npu.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/test.parquet" \
    data.train_batch_size=4 \
    data.max_prompt_length=64 \
    data.max_response_length=32 \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.name="${ROLLOUT}" \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.logger='["console","jsonl"]' \
    trainer.project_name=grpo_npu_tiny \
    trainer.experiment_name=grpo_cpu \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=2 \
    trainer.default_local_dir="${RUN_DIR}" \
    trainer.total_training_steps=2 \
    trainer.save_freq=1 \
    trainer.test_freq=2 \
    trainer.val_before_train=False \
    trainer.device=cpu \
    "$@"
