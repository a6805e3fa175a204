"""The offline synthetic task: schema, correctness of every answer, determinism, difficulty, splits."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from grpo_npu.data import synthetic
from grpo_npu.data.schema import INSTRUCTION
from grpo_npu.reward import compute_score

STEP = re.compile(r"(-?\d+) ([+\-*]) (\d+) = (-?\d+)\.")
WORD_OPS = {"buys": "+", "gives": "-", "times": "*"}


def check_problem(question: str, solution: str, answer: int, level: synthetic.Level) -> None:
    """Recompute the problem from its text with a slow, independent reading."""
    steps = STEP.findall(solution)
    assert solution.endswith(f" #### {answer}")
    assert len(steps) == level.num_operands - 1
    value = int(steps[0][0])
    operands = [value]
    for a, op, b, c in steps:
        assert int(a) == value  # chained
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert value == int(c) >= 0
        assert op in level.ops
        operands.append(int(b))
    assert value == answer
    assert all(0 <= x <= max(level.max_value, level.max_multiplier) for x in operands)
    # the question holds the same operands in the same order
    assert [int(x) for x in re.findall(r"\d+", question)] == operands
    if question.startswith("What is "):
        expression = question[len("What is "):-1]
        assert eval(expression) == answer  # parentheses make left-to-right explicit (Python precedence)
    else:
        ops = [WORD_OPS[w] for w in re.findall(r"\b(buys|gives|times)\b", question)]
        assert ops == [s[1] for s in steps]


@pytest.mark.parametrize("difficulty", sorted(synthetic.LEVELS))
def test_every_problem_is_right(difficulty):
    level = synthetic.LEVELS[difficulty]
    problems = synthetic.make_problems(300, difficulty, seed=difficulty, stream="check")
    for p in problems:
        check_problem(p.question, p.solution, p.answer, level)
    words = sum(not p.question.startswith("What is") for p in problems)
    assert 0 < words < len(problems)  # both forms appear


def test_files_schema_determinism_and_disjoint_splits(tmp_path):
    a = synthetic.write_synthetic(str(tmp_path / "a"), train_size=200, test_size=50, seed=3)
    b = synthetic.main(["--out_dir", str(tmp_path / "b"), "--train_size", "200", "--test_size", "50", "--seed", "3"])
    c = synthetic.write_synthetic(str(tmp_path / "c"), train_size=200, test_size=50, seed=4)
    assert set(a) == {"train", "test", "sft_train", "sft_test"}
    for name in a:
        assert pq.read_table(a[name]).to_pylist() == pq.read_table(b[name]).to_pylist()
    assert pq.read_table(a["train"]).to_pylist() != pq.read_table(c["train"]).to_pylist()

    train = pq.read_table(a["train"]).to_pylist()
    test = pq.read_table(a["test"]).to_pylist()
    sft_train = pq.read_table(a["sft_train"]).to_pylist()
    assert (len(train), len(test), len(sft_train)) == (200, 50, 200)
    held_out = {r["extra_info"]["question"] for r in test}
    assert not held_out & {r["extra_info"]["question"] for r in train + sft_train}

    row = train[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["question"] + " " + INSTRUCTION}]
    assert row["reward_model"]["style"] == "rule"
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 0
    for r in sft_train:
        assert r["response"] == r["extra_info"]["answer"]
        assert r["response"].endswith("#### " + r["reward_model"]["ground_truth"])
    # the default data_source is scored by the gsm8k reward: a worked solution earns 1.0
    for r in train[:50] + test[:50]:
        truth = r["reward_model"]["ground_truth"]
        assert compute_score(r["data_source"], r["extra_info"]["answer"], truth)["score"] == 1.0
        assert compute_score(r["data_source"], f"#### {int(truth) + 1}", truth)["score"] == 0.0


def test_own_data_source_and_no_sft(tmp_path):
    files = synthetic.write_synthetic(str(tmp_path), train_size=10, test_size=5, difficulty=3,
                                      data_source=synthetic.SYNTHETIC_DATA_SOURCE, write_sft=False)
    assert set(files) == {"train", "test"}
    rows = pq.read_table(files["train"]).to_pylist()
    assert {r["data_source"] for r in rows} == {"grpo_npu/arithmetic"}
    r = rows[0]
    assert compute_score(r["data_source"], r["extra_info"]["answer"], r["reward_model"]["ground_truth"])["score"] == 1.0


def test_difficulty_grows(tmp_path):
    mean_answer = {d: sum(p.answer for p in synthetic.make_problems(400, d, 0, "x")) / 400 for d in synthetic.LEVELS}
    assert mean_answer[1] < mean_answer[2] < mean_answer[3] < mean_answer[5] < mean_answer[6]
    assert [synthetic.LEVELS[d].num_operands for d in sorted(synthetic.LEVELS)] == sorted(
        synthetic.LEVELS[d].num_operands for d in synthetic.LEVELS)


def test_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="difficulty=9; expected one of"):
        synthetic.make_problems(3, 9, 0, "train")
    with pytest.raises(ValueError, match="must both be >= 1"):
        synthetic.write_synthetic(str(tmp_path), train_size=10, test_size=0)
    monkeypatch.setitem(synthetic.LEVELS, 99, synthetic.Level(num_operands=2, max_value=0, ops=("+",), word_fraction=0.0))
    with pytest.raises(ValueError, match="too few distinct problems"):
        synthetic.write_synthetic(str(tmp_path), train_size=2, test_size=1, difficulty=99)
