"""GSM8K rule reward: find the final answer near the end of a response and compare it with the truth.

Only the last ``CLIP_CHARS`` characters of the response are searched.

- ``method="strict"``: the last ``#### <number>``; ``method="flexible"``: the last number anywhere
  (a run of digits, ".", "," with an optional leading "-", holding at least one digit).
- Score: ``score`` (1.0) when the answer equals the ground truth, ``format_score`` (0.0) when an
  answer was found but differs, 0.0 when none was found.

Equality. By default (``strict_string=False``) answers compare as numbers after removing "," and
"$": "18.0" == "18", "1,000" == "1000", "18." == "18", "-3" == "-3.00"; non-numbers compare as
text. The strict pattern also accepts a "$" right after "#### " ("#### $18").
``strict_string=True`` reproduces verl's rule exactly: the pattern ``#### (\\-?[0-9\\.\\,]+)``
and an exact string compare of the extracted text (commas removed for strict) with the ground
truth, so "18.0" != "18" and "#### $18" finds nothing. Degenerate matches without a digit (".",
",") are never answers, in either mode.
"""

from __future__ import annotations

import re
from fractions import Fraction

CLIP_CHARS = 300  # the final answer sits at the end; scanning all of a long response is wasted regex time
METHODS = ("strict", "flexible")

_STRICT_VERL = re.compile(r"#### (\-?[0-9\.\,]+)")
_STRICT = re.compile(r"#### \$?(\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_HAS_DIGIT = re.compile(r"[0-9]")


def extract_solution(solution_str: str, method: str = "strict", strict_string: bool = False) -> str | None:
    """The final answer text of ``solution_str`` (from its last CLIP_CHARS characters), or None."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method={method!r}; expected one of {METHODS}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        matches = (_STRICT_VERL if strict_string else _STRICT).findall(tail)
        return matches[-1].replace(",", "").replace("$", "") if matches else None
    for candidate in reversed(_NUMBER.findall(tail)):
        if _HAS_DIGIT.search(candidate):
            return candidate if strict_string else candidate.replace(",", "")
    return None


def to_number(text: str) -> Fraction | None:
    """``text`` as an exact number ("1,000" -> 1000, "18." -> 18, "$-2.50" -> -5/2), or None."""
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str, ground_truth, strict_string: bool = False) -> bool:
    """Whether an extracted answer equals the ground truth (numerically unless ``strict_string``)."""
    truth = str(ground_truth)
    if strict_string:
        return answer == truth
    a, b = to_number(answer), to_number(truth)
    if a is not None and b is not None:
        return a == b
    return answer.replace(",", "").strip() == truth.replace(",", "").strip()


def score_details(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0, strict_string: bool = False) -> dict:
    """{"score", "acc" (1.0 right / 0.0 not), "pred" (the extracted answer or None)}."""
    answer = extract_solution(solution_str, method=method, strict_string=strict_string)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "pred": None}
    correct = answers_match(answer, ground_truth, strict_string=strict_string)
    return {"score": float(score if correct else format_score), "acc": float(correct), "pred": answer}


def compute_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0, strict_string: bool = False) -> float:
    """The gsm8k reward of one response."""
    return score_details(solution_str, ground_truth, method, format_score, score, strict_string)["score"]
