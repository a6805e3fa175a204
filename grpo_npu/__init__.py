"""grpo_npu: Ascend-NPU-first RL post-training (GRPO, DAPO, PPO) that also runs on CUDA and CPU."""

__version__ = "0.1.0"
