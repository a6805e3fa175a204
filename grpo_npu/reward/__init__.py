"""Rule rewards chosen by data_source, the custom-function hook, and reward managers (naive, dapo).

The scorers import no torch (pool workers load only them), so the package exports only them; the
managers (torch) are :mod:`grpo_npu.reward.manager`.
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

__all__ = [
    "FileFunction", "RewardFunctionError", "SYNTHETIC_DATA_SOURCE", "Scorer", "compute_score", "known_data_sources",
    "load_function", "make_compute_score", "register_scorer",
]
