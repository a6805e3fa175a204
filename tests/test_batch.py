"""RolloutBatch row operations: select, split/chunk, concat (including zero-row parts), views."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.batch import RolloutBatch


def make(rows: int, p: int = 3, t: int = 2, tag: str = "a") -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=torch.arange(rows * p).reshape(rows, p), prompt_mask=torch.ones(rows, p, dtype=torch.long),
        response_ids=torch.arange(rows * t).reshape(rows, t), response_mask=torch.ones(rows, t, dtype=torch.long),
        uid=[f"{tag}{i}" for i in range(rows)], data_source=["s"] * rows, ground_truth=[str(i) for i in range(rows)],
        extra_info=[{}] * rows, token_level_scores=torch.zeros(rows, t),
    )


def test_concat_skips_zero_row_batches_keeping_metadata():
    a, b = make(2, tag="a"), make(3, tag="b")
    empty = a.select(torch.zeros(2, dtype=torch.bool))
    assert len(empty) == 0 and empty.uid == []
    out = RolloutBatch.concat([a, empty, b])
    assert len(out) == 5 and out.uid == ["a0", "a1", "b0", "b1", "b2"]
    assert out.token_level_scores.shape == (5, 2)
    assert len(RolloutBatch.concat([empty])) == 0


def test_concat_pads_prompts_left_and_responses_right():
    out = RolloutBatch.concat([make(1, p=2, t=1), make(1, p=3, t=2)])
    assert out.prompt_ids.shape == (2, 3) and out.response_ids.shape == (2, 2)
    assert out.prompt_mask[0].tolist() == [0, 1, 1] and out.response_mask[0].tolist() == [1, 0]


def test_per_row_values_follow_their_rows_and_are_not_padded():
    """reward_baselines (B,): concat stacks it without the response padding; select and chunk carry it."""
    a = make(2, t=1).replace(reward_baselines=torch.tensor([1.0, 2.0]))
    b = make(1, t=3).replace(reward_baselines=torch.tensor([3.0]))
    out = RolloutBatch.concat([a, b])
    assert out.reward_baselines.tolist() == [1.0, 2.0, 3.0] and out.response_ids.shape == (3, 3)
    assert out.select([2, 0]).reward_baselines.tolist() == [3.0, 1.0]
    with pytest.raises(ValueError, match="reward_baselines has 1 rows"):
        make(2).replace(reward_baselines=torch.zeros(1))


def test_select_split_chunk_and_position_ids():
    b = make(4)
    assert b.select([3, 1]).uid == ["a3", "a1"]
    assert [len(x) for x in b.split(3)] == [3, 1]
    assert [x.uid for x in b.chunk(2)] == [["a0", "a1"], ["a2", "a3"]]
    with pytest.raises(ValueError, match="cannot split 4 rows into 3"):
        b.chunk(3)
    left = RolloutBatch(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), torch.tensor([[7]]), torch.tensor([[1]]))
    assert left.position_ids.tolist() == [[0, 0, 1, 2]]
    with pytest.raises(ValueError, match="uid has 1 rows"):
        RolloutBatch(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), uid=["x"])
