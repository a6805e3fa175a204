"""Rollout groups under tensor parallelism: every rank of a group gets the same prompts and seed, and the
driver receives each prompt's samples once (checked through the driver's own Workers.generate)."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.cluster import Workers
from grpo_npu.errors import ConfigError
from grpo_npu.rollout import SamplingConfig
from grpo_npu.rollout.layout import GROUP_SEED_STRIDE, RolloutLayout


class RecordingGroup:
    """A worker group whose ranks 'generate' one response row per prompt row, naming the rank that made it."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.calls: list = []

    def call_ranks(self, method, per_rank_args, **kwargs):
        self.calls = list(per_rank_args)
        return [(rank, ids, sampling.seed) for rank, (ids, _, sampling) in enumerate(per_rank_args)]


def _prompts(b: int):
    return torch.arange(b * 3).view(b, 3), torch.ones(b, 3, dtype=torch.long)


def test_tp_group_ranks_get_identical_prompts_and_seeds_and_samples_arrive_once():
    group = RecordingGroup(world_size=4)
    outs = Workers(group, rollout_tp=2).generate(*_prompts(6), SamplingConfig(n=2, seed=7))
    ids = [args[0] for args in group.calls]
    seeds = [args[2].seed for args in group.calls]
    assert torch.equal(ids[0], ids[1]) and torch.equal(ids[2], ids[3]) and not torch.equal(ids[0], ids[2])
    assert seeds == [7, 7, 7 + GROUP_SEED_STRIDE, 7 + GROUP_SEED_STRIDE]
    assert [rank for rank, _, _ in outs] == [0, 2]  # one copy per group: each prompt's samples once
    assert torch.equal(torch.cat([o[1] for o in outs]), _prompts(6)[0])  # every prompt, in order


def test_tp_1_is_data_parallel_as_before():
    group = RecordingGroup(world_size=2)
    outs = Workers(group).generate(*_prompts(4), SamplingConfig(seed=None))
    assert [rank for rank, _, _ in outs] == [0, 1] and all(seed is None for _, _, seed in outs)
    assert torch.equal(torch.cat([o[1] for o in outs]), _prompts(4)[0])


def test_layout_refuses_what_it_cannot_split():
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 must divide the 4 ranks"):
        RolloutLayout(4, 3)
    with pytest.raises(ValueError, match=r"5 prompts cannot be split evenly over 2 rollout groups"):
        RolloutLayout(4, 2).per_rank_inputs(*_prompts(5), SamplingConfig())
    assert RolloutLayout(4, 4).leaders() == [0] and RolloutLayout(4, 1).leaders() == [0, 1, 2, 3]
