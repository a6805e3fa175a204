"""The gsm8k-style RL row schema (parquet writing: :mod:`grpo_npu.data.parquet`).

One row (the contract in docs/algorithms.md, the same as verl's gsm8k preprocessing)::

    data_source: "openai/gsm8k"
    prompt:      [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability:     "math"
    reward_model: {"style": "rule", "ground_truth": "72"}
    extra_info:  {"split": "train", "index": 0, "answer": <full solution text>, "question": <question>}
"""

from __future__ import annotations

GSM8K_DATA_SOURCE = "openai/gsm8k"
SYNTHETIC_DATA_SOURCE = "grpo_npu/arithmetic"  # the offline synthetic task under its own name (gsm8k-scored)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ANSWER_MARKER = "####"


def extract_ground_truth(answer: str) -> str | None:
    """The text after the last ``####`` of a gsm8k solution, commas removed; None when absent."""
    idx = answer.rfind(ANSWER_MARKER)
    if idx < 0:
        return None
    value = answer[idx + len(ANSWER_MARKER):].strip().replace(",", "")
    return value or None


def make_prompt(question: str) -> list[dict]:
    """The chat prompt of one question: a single user turn ending with the ``####`` instruction."""
    return [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def make_row(
    question: str,
    answer: str,
    ground_truth: str,
    split: str,
    index: int,
    data_source: str = GSM8K_DATA_SOURCE,
) -> dict:
    """One RL row in the gsm8k schema."""
    return {
        "data_source": data_source,
        "prompt": make_prompt(question),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }

