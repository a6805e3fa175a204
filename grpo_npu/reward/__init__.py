"""Rule rewards chosen by data_source, the custom-function hook, and reward managers (naive, dapo).

The scorers import no torch (pool workers load only them); the managers are imported on first use.
"""

from grpo_npu.reward.custom import FileFunction, load_function
from grpo_npu.reward.parallel import RewardFunctionError, Scorer
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
    "FileFunction", "RewardFunctionError", "SYNTHETIC_DATA_SOURCE", "Scorer", "compute_score", "known_data_sources",
    "load_function", "make_compute_score", "register_scorer", *_MANAGER_NAMES,
]
