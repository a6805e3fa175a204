"""An offline arithmetic task in the gsm8k schema, small enough for a ~1M-parameter model on a CPU.

    python -m grpo_npu.data.synthetic --out_dir ~/data/arith --train_size 2048 --test_size 256 --difficulty 1 --seed 0

Writes ``train.parquet``/``test.parquet`` (RL rows, exactly the gsm8k schema: the gsm8k reward scores
them) and ``sft_train.parquet``/``sft_test.parquet`` (the same columns plus ``response``: a worked
solution ending in ``#### <answer>``) for an SFT warm start. Everything is a function of ``seed``;
every split draws from its own random stream, and no train or SFT question is a test question.

Problems are number questions ("What is 23 + 58?") or word problems ("Tom has 23 apples. Tom buys
58 more. How many apples does Tom have now?"), evaluated left to right; answers are non-negative
integers. ``difficulty`` picks the operand count, the operand size and the operators (see LEVELS).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from grpo_npu.data.parquet import write_parquet_atomic
from grpo_npu.data.schema import GSM8K_DATA_SOURCE, SYNTHETIC_DATA_SOURCE, make_row

# Attempts per requested problem before concluding a split cannot avoid the test questions.
MAX_DRAWS_PER_PROBLEM = 50


@dataclass(frozen=True)
class Level:
    """One difficulty: how many operands, how large, which operators, how often in words."""

    num_operands: int
    max_value: int  # operands are drawn from [0, max_value]
    ops: tuple[str, ...]
    word_fraction: float  # share of word problems (the rest are "What is ...?")
    max_multiplier: int = 9  # the right operand of "*" stays one digit, keeping answers small


# Calibration (tiny ~1M Qwen2 from grpo_npu.models.tiny, SFT on 4096 sft_train rows, batch 32, AdamW
# lr 2e-3, then greedy accuracy on 128 test prompts after 100 / 200 / 400 steps):
#   level 1: 10% / 26% / 34%    level 2: 5% / 9% / 9%    level 3: 1% / 2% / 1%
# Level 1 (the default) is therefore where a briefly SFT'd tiny model is right sometimes, not always,
# and RL has room to climb; levels 2+ are for longer SFT or larger models.
LEVELS = {
    1: Level(num_operands=2, max_value=9, ops=("+",), word_fraction=0.3),
    2: Level(num_operands=2, max_value=19, ops=("+", "-"), word_fraction=0.3),
    3: Level(num_operands=2, max_value=99, ops=("+", "-"), word_fraction=0.3),
    4: Level(num_operands=3, max_value=99, ops=("+", "-"), word_fraction=0.3),
    5: Level(num_operands=3, max_value=99, ops=("+", "-", "*"), word_fraction=0.3),
    6: Level(num_operands=4, max_value=999, ops=("+", "-", "*"), word_fraction=0.3),
}
DEFAULT_DIFFICULTY = 1

# Names and items come from the tiny tokenizer's training corpus where possible: short token runs.
NAMES = ("Tom", "Ana", "Sam", "Mia", "Leo", "Zoe", "Ben", "Eva")
ITEMS = ("apples", "books", "coins", "marbles", "pencils", "cookies")


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked steps ending in "#### <answer>"
    answer: int


def _operands(rng: random.Random, level: Level) -> tuple[list[int], list[str]]:
    """Operands and operators, left to right, keeping every partial result >= 0."""
    value = rng.randint(0, level.max_value)
    nums, ops = [value], []
    for _ in range(level.num_operands - 1):
        op = rng.choice(level.ops)
        if op == "-":
            b = rng.randint(0, min(value, level.max_value))
            value -= b
        elif op == "*":
            b = rng.randint(2, level.max_multiplier)
            value *= b
        else:
            b = rng.randint(0, level.max_value)
            value += b
        nums.append(b)
        ops.append(op)
    return nums, ops


def _steps(nums: list[int], ops: list[str]) -> tuple[str, int]:
    """The worked solution "a + b = c. c - d = e. #### e" and its answer."""
    value, steps = nums[0], []
    for op, b in zip(ops, nums[1:]):
        new = value + b if op == "+" else value - b if op == "-" else value * b
        steps.append(f"{value} {op} {b} = {new}.")
        value = new
    return " ".join(steps) + f" #### {value}", value


def _expression(nums: list[int], ops: list[str]) -> str:
    """Left-to-right evaluation written with parentheses where "*" would otherwise bind first."""
    text = str(nums[0])
    for i, (op, b) in enumerate(zip(ops, nums[1:])):
        if op == "*" and i > 0:
            text = f"({text})"
        text = f"{text} {op} {b}"
    return text


def _word_question(rng: random.Random, nums: list[int], ops: list[str]) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    parts = [f"{name} has {nums[0]} {item}."]
    for op, b in zip(ops, nums[1:]):
        if op == "+":
            parts.append(f"{name} buys {b} more.")
        elif op == "-":
            parts.append(f"{name} gives away {b}.")
        else:
            parts.append(f"Then {name} has {b} times as many.")
    parts.append(f"How many {item} does {name} have now?")
    return " ".join(parts)


def make_problem(rng: random.Random, level: Level) -> Problem:
    """One random problem of ``level``."""
    nums, ops = _operands(rng, level)
    solution, answer = _steps(nums, ops)
    if rng.random() < level.word_fraction:
        question = _word_question(rng, nums, ops)
    else:
        question = f"What is {_expression(nums, ops)}?"
    return Problem(question=question, solution=solution, answer=answer)


def make_problems(
    n: int, difficulty: int, seed: int, stream: str, exclude: frozenset[str] = frozenset()
) -> list[Problem]:
    """``n`` problems from the random stream (seed, stream), none of whose question is in ``exclude``."""
    if difficulty not in LEVELS:
        raise ValueError(f"difficulty={difficulty}; expected one of {sorted(LEVELS)}")
    if n < 0:
        raise ValueError(f"size {n} of split {stream!r} must be >= 0")
    level = LEVELS[difficulty]
    rng = random.Random(f"{seed}-{stream}")  # str seeds are stable across runs and platforms
    out: list[Problem] = []
    for _ in range(n * MAX_DRAWS_PER_PROBLEM):
        if len(out) == n:
            break
        problem = make_problem(rng, level)
        if problem.question not in exclude:
            out.append(problem)
    if len(out) < n:
        raise ValueError(
            f"difficulty {difficulty} has too few distinct problems to draw {n} {stream} problems that are "
            "not test problems: lower the sizes or raise the difficulty"
        )
    return out


def rl_rows(problems: list[Problem], split: str, data_source: str) -> list[dict]:
    return [make_row(p.question, p.solution, str(p.answer), split, i, data_source) for i, p in enumerate(problems)]


def sft_rows(problems: list[Problem], split: str, data_source: str) -> list[dict]:
    """RL rows plus ``response``: the worked solution the SFT warm start learns from."""
    rows = rl_rows(problems, split, data_source)
    for row, p in zip(rows, problems):
        row["response"] = p.solution
    return rows


def write_synthetic(
    out_dir: str,
    *,
    train_size: int = 2048,
    test_size: int = 256,
    difficulty: int = DEFAULT_DIFFICULTY,
    seed: int = 0,
    data_source: str = GSM8K_DATA_SOURCE,
    sft_size: int | None = None,
    write_sft: bool = True,
) -> dict[str, Path]:
    """Write the RL (and SFT) parquet files under ``out_dir``; returns name -> path."""
    if train_size < 1 or test_size < 1:
        raise ValueError(f"train_size={train_size} and test_size={test_size} must both be >= 1")
    test = make_problems(test_size, difficulty, seed, "test")
    held_out = frozenset(p.question for p in test)
    train = make_problems(train_size, difficulty, seed, "train", exclude=held_out)
    out_dir = Path(out_dir).expanduser()
    files = {
        "train": write_parquet_atomic(rl_rows(train, "train", data_source), out_dir / "train.parquet"),
        "test": write_parquet_atomic(rl_rows(test, "test", data_source), out_dir / "test.parquet"),
    }
    if write_sft:
        sft_train = make_problems(train_size if sft_size is None else sft_size, difficulty, seed, "sft", exclude=held_out)
        files["sft_train"] = write_parquet_atomic(sft_rows(sft_train, "train", data_source), out_dir / "sft_train.parquet")
        files["sft_test"] = write_parquet_atomic(sft_rows(test, "test", data_source), out_dir / "sft_test.parquet")
    return files


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description="Write the offline synthetic arithmetic task (gsm8k schema)")
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--train_size", type=int, default=2048)
    parser.add_argument("--test_size", type=int, default=256)
    parser.add_argument("--difficulty", type=int, default=DEFAULT_DIFFICULTY, choices=sorted(LEVELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data_source", default=GSM8K_DATA_SOURCE,
                        help=f"reward dispatch key of every row (gsm8k-scored: {GSM8K_DATA_SOURCE}, {SYNTHETIC_DATA_SOURCE})")
    parser.add_argument("--sft_size", type=int, default=None, help="SFT rows (default: train_size)")
    parser.add_argument("--no_sft", action="store_true", help="skip sft_train/sft_test.parquet")
    args = parser.parse_args(argv)
    options = vars(args)  # the remaining flags are named as write_synthetic's arguments
    out_dir, no_sft = options.pop("out_dir"), options.pop("no_sft")
    files = write_synthetic(out_dir, write_sft=not no_sft, **options)
    for name, path in files.items():
        print(f"{name}: {path}")
    return files


if __name__ == "__main__":
    main()
