"""RL prompt data: parquet -> chat-templated, left-padded prompts; the offline synthetic task.

The dataset classes (torch) are imported on first use, so the preprocessing scripts stay light.
"""

from grpo_npu.data.names import TRUNCATION_MODES
from grpo_npu.data.schema import GSM8K_DATA_SOURCE, INSTRUCTION

_DATASET_NAMES = ("PromptBatch", "PromptItem", "PromptLoader", "RLDataset", "collate")


def __getattr__(name: str):
    if name in _DATASET_NAMES:
        from grpo_npu.data import rl_dataset

        return getattr(rl_dataset, name)
    raise AttributeError(f"module 'grpo_npu.data' has no attribute {name!r}")


__all__ = ["GSM8K_DATA_SOURCE", "INSTRUCTION", "TRUNCATION_MODES", *_DATASET_NAMES]
