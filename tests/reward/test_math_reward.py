r"""MATH-style \boxed{} scoring, normalisation and the DAPO-recipe variant; data_source dispatch."""

from __future__ import annotations

import pytest

from grpo_npu.reward import compute_score, known_data_sources, make_compute_score, math as math_reward


@pytest.mark.parametrize("text, boxed", [
    (r"so the answer is $\boxed{42}$.", "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\fbox{7}", "7"),
    (r"$\boxed 5$ done", "5"),
    (r"\boxed{\frac{1}{2}", None),  # cut off
    ("no box here", None),
    (r"\boxed", None),
])
def test_last_boxed(text, boxed):
    assert math_reward.last_boxed(text) == boxed


@pytest.mark.parametrize("pred, truth", [
    ("42", "42"),
    (r"\frac{1}{2}", r"\dfrac{1}{2}"),
    (r"\frac12", r"\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"),
    ("1/2", r"\tfrac{1}{2}"),
    (".5", "0.5"),
    ("-0.25", r"-\frac{1}{4}"),
    ("x = 5", "5"),
    (r"5\text{ cm}", "5"),
    ("1,000", "1000"),
    (r"10\%", "10"),
    (r"90^\circ", "90"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
    (r"\text{(A)}", "(A)"),
    (r"\sqrt2", r"\sqrt{2}"),
    ("3.0", "3"),
])
def test_equivalent(pred, truth):
    assert math_reward.is_equiv(pred, truth)
    assert math_reward.compute_score(rf"... so $\boxed{{{pred}}}$", truth) == 1.0


@pytest.mark.parametrize("pred, truth", [
    ("41", "42"),
    (r"\frac{1}{3}", "0.33"),
    ("x + 1", "x - 1"),
    ("(3, 4)", "(4, 3)"),
    ("1,2,3", "123"),
    (r"\sqrt{2}", "2"),
])
def test_not_equivalent(pred, truth):
    assert not math_reward.is_equiv(pred, truth)
    assert math_reward.compute_score(rf"\boxed{{{pred}}}", truth) == 0.0


def test_details_ground_truth_in_a_box_and_no_answer():
    assert math_reward.score_details(r"\boxed{6}", r"\boxed{6}") == {"score": 1.0, "acc": 1.0, "pred": "6"}
    assert math_reward.score_details("six", "6") == {"score": 0.0, "acc": 0.0, "pred": None}


def test_dapo_variant():
    assert math_reward.compute_score_dapo("work...\nAnswer: 42", "42") == {"score": 1.0, "acc": 1.0, "pred": "42"}
    assert math_reward.compute_score_dapo("Answer: 41\n", "42") == {"score": -1.0, "acc": 0.0, "pred": "41"}
    assert math_reward.compute_score_dapo(r"so \boxed{\frac{3}{4}}", "0.75")["score"] == 1.0
    assert math_reward.compute_score_dapo(r"Answer: $\boxed{7}$", "7")["pred"] == "7"
    assert math_reward.compute_score_dapo("nothing", "7") == {"score": -1.0, "acc": 0.0, "pred": None}
    early = "Answer: 7\n" + "and more words " * 30
    assert math_reward.compute_score_dapo(early, "7")["score"] == -1.0  # outside the last 300 characters


def test_dispatch_by_exact_data_source():
    assert compute_score("HuggingFaceH4/MATH-500", r"\boxed{2}", "2")["score"] == 1.0
    assert compute_score("lighteval/MATH", r"\boxed{2}", "3")["score"] == 0.0
    assert compute_score("math_dapo", r"\boxed{2}", "3")["score"] == -1.0
    assert compute_score("openai/gsm8k", "it is 5", "5", method="flexible")["score"] == 1.0  # kwargs reach the scorer
    assert compute_score("openai/gsm8k", "it is 5", "5")["score"] == 0.0  # strict by default
    assert {"openai/gsm8k", "lighteval/MATH", "math_dapo", "grpo_npu/arithmetic"} <= set(known_data_sources())
    with pytest.raises(NotImplementedError, match=r"data_source='OpenAI/GSM8K'; known: \[.*'openai/gsm8k'.*custom_reward_function.path"):
        compute_score("OpenAI/GSM8K", "#### 5", "5")


def test_data_without_a_built_in_scorer_is_refused_before_training():
    """An unknown data_source used to surface at the first step's rewards, after the models had loaded."""
    with pytest.raises(ValueError, match=r"^no built-in reward for data_source='my/ds' in the data \(and 1 more\); "
                                         r"known: \[.*'openai/gsm8k'.*custom_reward_function\.path"):
        make_compute_score(data_sources=["openai/gsm8k", "my/ds", "other/ds"])
    assert make_compute_score(data_sources=["openai/gsm8k"])("openai/gsm8k", "#### 5", "5")["score"] == 1.0
    make_compute_score(custom_path=__file__, custom_name="test_dispatch_by_exact_data_source",
                       data_sources=["my/ds"])  # a custom function scores whatever the data holds
