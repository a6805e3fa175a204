"""One reward call: ``fn(data_source, solution_str, ground_truth, extra_info)`` on one row, result checked.

Torch-free and light on purpose: sandbox workers import it before the user's file.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_npu.errors import TrainingStopped, UserError

Row = tuple  # (row index, data_source, solution_str, ground_truth, extra_info)


class RewardFunctionError(RuntimeError):
    """A reward function failed (raised, or returned something unusable) on one row, or on too many."""


class RewardFunctionBroken(UserError, RewardFunctionError):
    """The reward function fails on every row tried (or cannot be loaded): one line naming it and the first error."""


class TooManyRewardFailures(TrainingStopped, RewardFunctionError):
    """More than ``reward_model.max_failed_fraction`` of a batch's reward calls failed."""


def first_line(err: BaseException) -> str:
    """``Type: first line of the message`` of an exception."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def row_label(row: Row) -> str:
    """``row 7 (data_source='openai/gsm8k')``: how every per-row message starts."""
    return f"row {row[0]} (data_source={row[1]!r})"


def as_row_info(raw: Any, row: Row) -> dict:
    """A scorer's float or dict result as {"score": float, "acc": float, "pred": ..., ...}."""
    if isinstance(raw, dict):
        if "score" not in raw:
            raise RewardFunctionError(
                f"{row_label(row)}: the reward function returned a dict without 'score' (keys: {sorted(raw)})"
            )
        info = dict(raw)
    else:
        info = {"score": raw}
    try:
        info["score"] = float(info["score"])
        info["acc"] = float(info.get("acc", info["score"]))
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(
            f"{row_label(row)}: the reward function returned a non-numeric score/acc: {raw!r}"[:500]
        ) from err
    info.setdefault("pred", None)
    return info


def score_row(fn: Callable, row: Row) -> dict:
    """The checked result of ``fn`` on one row; any failure is a one-line RewardFunctionError naming the row."""
    _, data_source, text, ground_truth, extra_info = row
    try:
        raw = fn(data_source, text, ground_truth, extra_info)
    except Exception as err:
        raise RewardFunctionError(f"{row_label(row)}: the reward function raised {first_line(err)}") from err
    return as_row_info(raw, row)
