"""The names ``grpo_npu.reward`` accepts, declared once and torch-free.

The config validates against these and ``--help`` lists them before torch is imported;
``tests/test_names.py`` checks them against ``manager.REWARD_MANAGERS``.
"""

# reward_model.reward_manager: naive (scores at the last token) | dapo (adds overlong shaping)
REWARD_MANAGER_NAMES = ("naive", "dapo")
