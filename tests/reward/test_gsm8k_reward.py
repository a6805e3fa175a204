"""gsm8k reward on real solutions and perturbed ones, both methods, numeric and strict-string equality."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pytest

from grpo_npu.reward import gsm8k

SHARED_GSM8K = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"
NUMBER_CHARS = set("0123456789.,")


# ------------------------------------------------------------------------------------------------
# A slow reference written from the rule in docs/algorithms.md, by character scanning (no regex).
# ------------------------------------------------------------------------------------------------
def _number_runs(text: str) -> list[str]:
    """Maximal runs of [0-9.,] with an optional "-" right before, left to right."""
    runs, i = [], 0
    while i < len(text):
        if text[i] in NUMBER_CHARS or (text[i] == "-" and i + 1 < len(text) and text[i + 1] in NUMBER_CHARS):
            j = i + 1
            while j < len(text) and text[j] in NUMBER_CHARS:
                j += 1
            runs.append(text[i:j])
            i = j
        else:
            i += 1
    return runs


def ref_extract(solution: str, method: str, strict_string: bool) -> str | None:
    tail = solution[-300:]
    if method == "strict":
        found = None
        for k in range(len(tail)):
            if tail.startswith("#### ", k):
                rest = tail[k + 5:]
                if not strict_string and rest.startswith("$"):
                    rest = rest[1:]
                runs = _number_runs(rest)
                if runs and rest.startswith(runs[0]):
                    found = runs[0].replace(",", "").replace("$", "")
        return found
    runs = [r for r in _number_runs(tail) if any(c.isdigit() for c in r)]
    if not runs:
        return None
    return runs[-1] if strict_string else runs[-1].replace(",", "")


def ref_score(solution: str, truth: str, method: str, strict_string: bool, format_score: float = 0.0) -> float:
    pred = ref_extract(solution, method, strict_string)
    if pred is None:
        return 0.0
    if strict_string:
        return 1.0 if pred == truth else format_score
    try:
        same = Decimal(pred.replace(",", "").rstrip(".")) == Decimal(truth.replace(",", ""))
    except InvalidOperation:
        same = pred == truth
    return 1.0 if same else format_score


def _solutions(n: int = 300) -> list[tuple[str, str]]:
    if not SHARED_GSM8K.is_dir():
        pytest.skip(f"shared gsm8k data not found at {SHARED_GSM8K}")
    out = []
    with open(SHARED_GSM8K / "test.jsonl") as f:
        for line in f:
            answer = json.loads(line)["answer"]
            out.append((answer, answer.split("#### ")[-1].replace(",", "")))
            if len(out) == n:
                break
    return out


def _perturbations(solution: str, truth: str) -> dict[str, tuple[str, str]]:
    """name -> (response, ground truth)."""
    body = solution.rsplit("#### ", 1)[0]
    value = int(truth)
    return {
        "exact": (solution, truth),
        "wrong": (body + f"#### {value + 1}", truth),
        "missing_marker": (body + f"The answer is {truth}", truth),
        "commas": (body + f"#### {value:,}", truth),
        "dollar": (body + f"#### ${truth}", truth),
        "trailing_text": (body + f"#### {truth} apples in all.", truth),
        "trailing_period": (body + f"#### {truth}.", truth),
        "negative_truth": (body + f"#### -{truth}", f"-{truth}"),
        "negative_wrong": (body + f"#### -{truth}", truth),
        "decimal_equal": (body + f"#### {truth}.00", truth),
        "decimal_wrong": (body + f"#### {truth}.5", truth),
        "decimal_truth": (body + "#### 2.50", "2.5"),
        "two_markers": (body + f"#### {value + 3}\nno wait\n#### {truth}", truth),
        "answer_too_early": (solution + "\n" + "and that is all I have to say about it. " * 9, truth),
        "no_number": ("I do not know.", truth),
    }


@pytest.mark.parametrize("method", gsm8k.METHODS)
@pytest.mark.parametrize("strict_string", [False, True])
def test_real_solutions_and_perturbations_match_reference(method, strict_string):
    seen = 0
    for solution, truth in _solutions():
        for name, (response, gt) in _perturbations(solution, truth).items():
            got = gsm8k.compute_score(response, gt, method=method, strict_string=strict_string, format_score=0.1)
            want = ref_score(response, gt, method, strict_string, format_score=0.1)
            assert got == want, (name, method, strict_string, response[-80:], gt)
            seen += 1
    assert seen == 300 * 15


def test_expected_verdicts_on_one_solution():
    """The headline cases spelled out, so a reference bug cannot hide a scorer bug."""
    solution = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"
    cases = _perturbations(solution, "72")
    expect = {  # name: (strict numeric, strict verl-string, flexible numeric, flexible verl-string)
        "exact": (1, 1, 1, 1),
        "wrong": (0.1, 0.1, 0.1, 0.1),
        "missing_marker": (0, 0, 1, 1),
        "dollar": (1, 0, 1, 1),
        "trailing_text": (1, 1, 1, 1),
        "trailing_period": (1, 0.1, 1, 0.1),
        "negative_truth": (1, 1, 1, 1),
        "negative_wrong": (0.1, 0.1, 0.1, 0.1),
        "decimal_equal": (1, 0.1, 1, 0.1),
        "decimal_wrong": (0.1, 0.1, 0.1, 0.1),
        "decimal_truth": (1, 0.1, 1, 0.1),
        "two_markers": (1, 1, 1, 1),
        "answer_too_early": (0, 0, 0, 0),  # digit-free filler pushes "72" out of the last 300 characters
        "no_number": (0, 0, 0, 0),
    }
    for name, verdicts in expect.items():
        response, gt = cases[name]
        got = tuple(
            gsm8k.compute_score(response, gt, method=m, strict_string=s, format_score=0.1)
            for m, s in (("strict", False), ("strict", True), ("flexible", False), ("flexible", True))
        )
        assert got == verdicts, name
    big = "x = 1000 + 234\n#### 1,234"
    assert gsm8k.compute_score(big, "1234") == 1.0
    assert gsm8k.compute_score(big, "1234", strict_string=True) == 1.0  # strict removes commas
    assert gsm8k.compute_score("it is 1,234", "1234", method="flexible") == 1.0
    assert gsm8k.compute_score("it is 1,234", "1234", method="flexible", strict_string=True) == 0.0  # verl keeps them


def test_details_and_arguments():
    assert gsm8k.score_details("so #### 18.0", "18") == {"score": 1.0, "acc": 1.0, "pred": "18.0"}
    assert gsm8k.score_details("so #### 17", "18", format_score=0.2) == {"score": 0.2, "acc": 0.0, "pred": "17"}
    assert gsm8k.score_details("nothing", "18") == {"score": 0.0, "acc": 0.0, "pred": None}
    assert gsm8k.compute_score("#### 5", 5) == 1.0  # a non-string ground truth
    assert gsm8k.compute_score("#### 5", "5", score=2.0) == 2.0
    assert gsm8k.extract_solution(". , .", method="flexible") is None
    with pytest.raises(ValueError, match="method='fuzzy'; expected one of"):
        gsm8k.compute_score("#### 5", "5", method="fuzzy")
