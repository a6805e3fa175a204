"""The names ``grpo_npu.reward`` accepts, declared once and torch-free.

The config validates against these and ``--help`` lists them before torch is imported;
``tests/test_names.py`` checks them against ``manager.REWARD_MANAGERS``.
"""

# reward_model.reward_manager: naive (scores at the last token) | dapo (adds overlong shaping) | gdpo (verl's name for
# GDPO's runs: naive's scoring, every key of the scorer's result dict kept per row, as naive keeps them)
REWARD_MANAGER_NAMES = ("naive", "dapo", "gdpo")

# The reward sandbox's defaults (reward.sandbox.SandboxSettings and the reward_model.* keys of the same names).
SANDBOX_DEFAULTS = {"timeout_s": 30.0, "fallback_score": 0.0, "max_failed_fraction": 0.1, "memory_limit_mb": 4096}
