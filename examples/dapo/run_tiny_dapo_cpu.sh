#!/usr/bin/env bash
# DAPO end to end on a plain CPU with the offline tiny kit: clip-higher, dynamic sampling,
# token-mean loss and overlong shaping, 2 steps, 2 worker processes.
#
# Dynamic sampling needs groups whose responses differ. An untrained tiny model rarely solves
# anything (acc is 0 everywhere), so groups are filtered on seq_reward, which includes the overlong
# penalty: with the buffer spanning the whole response (len = max_response_length) every length
# scores differently, and about half the groups of 4 survive. Generation rounds of 8 prompts, up
# to 8 rounds per step.
#
#   bash examples/dapo/run_tiny_dapo_cpu.sh [key=value ...]                   # overrides win
#
# Expected runtime on 2 CPU cores: about 1-3 minutes (plus ~10 s the first time, to build the
# tiny kit). Environment: RUN_DIR, MODEL_PATH, DATA_DIR, ROLLOUT (hf|vllm), CACHE_DIR.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../tiny_cpu_env.sh"

python3 -m grpo_npu.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=seq_reward \
    algorithm.filter_groups.max_num_gen_batches=8 \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/test.parquet" \
    data.train_batch_size=4 \
    data.gen_batch_size=8 \
    data.max_prompt_length=64 \
    data.max_response_length=32 \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.rollout.name="${ROLLOUT}" \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    reward_model.reward_manager=dapo \
    reward_model.overlong_buffer.enable=True \
    reward_model.overlong_buffer.len=32 \
    reward_model.overlong_buffer.penalty_factor=1.0 \
    trainer.logger='["console","jsonl"]' \
    trainer.project_name=grpo_npu_tiny \
    trainer.experiment_name=dapo_cpu \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=2 \
    trainer.default_local_dir="${RUN_DIR}" \
    trainer.total_training_steps=2 \
    trainer.save_freq=1 \
    trainer.test_freq=2 \
    trainer.val_before_train=False \
    trainer.device=cpu \
    "$@"
