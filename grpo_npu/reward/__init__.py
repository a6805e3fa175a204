"""Rule rewards chosen by data_source, the custom-function hook, the reward sandbox, and reward managers.

The scorers import no torch (sandbox workers load only them); the managers are imported on first use.
"""

from grpo_npu.reward.call import RewardFunctionBroken, RewardFunctionError, TooManyRewardFailures
from grpo_npu.reward.custom import FileFunction, load_function
from grpo_npu.reward.parallel import Scorer
from grpo_npu.reward.sandbox import SandboxSettings
from grpo_npu.reward.score import (
    SYNTHETIC_DATA_SOURCE,
    compute_score,
    known_data_sources,
    make_compute_score,
    register_scorer,
)

_MANAGER_NAMES = ("REWARD_MANAGERS", "DAPORewardManager", "NaiveRewardManager", "RewardOutput", "get_reward_manager")


def __getattr__(name: str):
    if name in _MANAGER_NAMES:
        from grpo_npu.reward import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'grpo_npu.reward' has no attribute {name!r}")


__all__ = [
    "FileFunction", "RewardFunctionBroken", "RewardFunctionError", "SYNTHETIC_DATA_SOURCE", "SandboxSettings", "Scorer",
    "TooManyRewardFailures", "compute_score", "known_data_sources", "load_function", "make_compute_score",
    "register_scorer", *_MANAGER_NAMES,
]
