"""Pure RL algorithms over (B, T) tensors: advantages, KL, policy/value losses, aggregation, DAPO pieces."""

from grpo_npu.algo import advantages, dapo, kl, losses

__all__ = ["advantages", "dapo", "kl", "losses"]
