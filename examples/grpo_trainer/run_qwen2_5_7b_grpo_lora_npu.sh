#!/usr/bin/env bash
# LoRA GRPO on GSM8K, Qwen2.5-7B-Instruct, one node of 8 Ascend NPUs (Atlas A2/A3, 64 GB each).
# Keys follow verl's LoRA GRPO examples (lora_rank 64, lora_alpha 32, all linear layers) with a learning
# rate 30x the full fine-tuning example's (adapters need larger steps). Only the adapters train and hold optimizer state; the reference policy is
# the actor with its adapters switched off (no second copy of the model); the engine loads the base
# weights from disk (load_format=safetensors), runs with LoRA on and gets only the adapters at each sync
# (merged weights on a vLLM that cannot build an adapter from tensors: docs/lora.md). Every checkpoint
# holds actor/lora_adapter (a PEFT directory); add hf_model to save_contents for merged weights.
#
#   pip install 'grpo_npu[lora]'                                         # peft
#   python3 data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k     # once
#   bash examples/grpo_trainer/run_qwen2_5_7b_grpo_lora_npu.sh [key=value ...]    # overrides win
#
# Environment: MODEL_PATH, DATA_DIR (default ~/data/gsm8k), NNODES, NPUS_PER_NODE (default 8),
# CKPT_DIR, ENFORCE_EAGER (False: graph mode); Ascend variables as set in examples/npu_env.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../npu_env.sh"

MODEL_PATH="${MODEL_PATH:-${HOME}/models/Qwen2.5-7B-Instruct}"  # huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir ~/models/Qwen2.5-7B-Instruct
project_name=grpo_npu_gsm8k
experiment_name=qwen2_5_7b_grpo_lora_npu
CKPT_DIR="${CKPT_DIR:-${HOME}/ckpts/${project_name}/${experiment_name}}"

python3 -m grpo_npu.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.lora_rank=64 \
    actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.model.use_remove_padding=False \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=3e-5 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.load_format=safetensors \
    actor_rollout_ref.rollout.layered_summon=True \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.enable_chunked_prefill=False \
    actor_rollout_ref.rollout.enforce_eager="${ENFORCE_EAGER}" \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    trainer.critic_warmup=0 \
    trainer.logger='["console","jsonl"]' \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${experiment_name}" \
    trainer.nnodes="${NNODES}" \
    trainer.n_gpus_per_node="${NPUS_PER_NODE}" \
    trainer.default_local_dir="${CKPT_DIR}" \
    trainer.resume_mode=auto \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=5 \
    trainer.device=npu \
    "$@"
