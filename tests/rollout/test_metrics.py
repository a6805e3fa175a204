"""logp_diff_metrics against a plain loop over tokens."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.rollout import logp_diff_metrics


@pytest.mark.parametrize("seed, shape", [(0, (4, 7)), (1, (1, 1)), (2, (8, 33))])
def test_matches_a_loop(seed, shape):
    gen = torch.Generator().manual_seed(seed)
    rollout_logp = -torch.rand(shape, generator=gen) * 5
    old_logp = rollout_logp + torch.randn(shape, generator=gen) * 0.1
    mask = (torch.rand(shape, generator=gen) > 0.3).long()
    mask[0, 0] = 1
    diffs = [abs(float(rollout_logp[b, t] - old_logp[b, t]))
             for b in range(shape[0]) for t in range(shape[1]) if mask[b, t]]
    got = logp_diff_metrics(rollout_logp, old_logp, mask)
    assert got["rollout/logp_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)
    assert got["rollout/logp_diff_max"] == pytest.approx(max(diffs), rel=1e-6)


def test_padding_is_ignored_and_empty_mask_is_zero():
    rollout_logp = torch.tensor([[-1.0, -100.0]])
    old_logp = torch.tensor([[-1.5, 0.0]])
    assert logp_diff_metrics(rollout_logp, old_logp, torch.tensor([[1, 0]]))["rollout/logp_diff_max"] == 0.5
    assert logp_diff_metrics(rollout_logp, old_logp, torch.zeros(1, 2)) == {
        "rollout/logp_diff_mean": 0.0, "rollout/logp_diff_max": 0.0}
    with pytest.raises(ValueError, match="same"):
        logp_diff_metrics(rollout_logp, old_logp[:, :1], torch.ones(1, 2))
