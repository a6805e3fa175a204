"""Rule rewards chosen by data_source, the custom-function hook, the reward sandbox, and reward managers.

The scorers import no torch (sandbox workers load only them), so the package exports only them; the
managers (torch) are :mod:`grpo_npu.reward.manager`.
"""

from grpo_npu.reward.call import RewardFunctionBroken, RewardFunctionError, TooManyRewardFailures
from grpo_npu.reward.custom import FileFunction, load_function
from grpo_npu.reward.parallel import Scorer
from grpo_npu.reward.sandbox import SandboxSettings
from grpo_npu.reward.score import (SYNTHETIC_DATA_SOURCE, compute_score, known_data_sources, make_compute_score,
                                   register_scorer)

__all__ = [
    "FileFunction", "RewardFunctionBroken", "RewardFunctionError", "SYNTHETIC_DATA_SOURCE", "SandboxSettings", "Scorer",
    "TooManyRewardFailures", "compute_score", "known_data_sources", "load_function", "make_compute_score",
    "register_scorer",
]
