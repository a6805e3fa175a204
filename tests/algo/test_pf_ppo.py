"""PF-PPO's resampling: verl 0.9.1's weights (written out here), draws with replacement in proportion to them,
every field following its row, and a seeded draw."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.algo.pf_ppo import resample_batch, resample_rows, resample_weights
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import load_config
from grpo_npu.errors import ConfigError


def _expected_weights(scores: list[float], method: str, weight_pow: float) -> list[float]:
    hi, lo = max(scores), min(scores)
    if method == "pow":
        raw = [abs(s) ** weight_pow for s in scores]
    elif method == "max_min":
        raw = [1.0 if s in (hi, lo) else 0.0 for s in scores]
    else:  # max_random
        raw = [0.4 if s == hi else 0.1 for s in scores]
    return [max(w + 1e-8, 1e-8) for w in raw]


@pytest.mark.parametrize("method, weight_pow", [("pow", 2.0), ("pow", 0.5), ("pow", 0.0), ("max_min", 2.0),
                                                ("max_random", 2.0)])
def test_weights_are_verls(method, weight_pow):
    scores = [1.0, -2.0, 0.0, 3.0, 3.0, -2.0, 0.5]  # ties at both ends
    got = resample_weights(torch.tensor(scores, dtype=torch.float64), method, weight_pow)
    assert got.tolist() == pytest.approx(_expected_weights(scores, method, weight_pow), rel=1e-12, abs=0)


def test_equal_scores_leave_every_row_a_chance():
    assert resample_weights(torch.zeros(4), "max_random", 2.0).tolist() == pytest.approx([0.4 + 1e-8] * 4)
    assert resample_weights(torch.zeros(4), "pow", 2.0).tolist() == pytest.approx([1e-8] * 4)


def test_draw_frequencies_follow_the_weights():
    scores = torch.tensor([1.0, 2.0, 0.0, -1.0]).repeat(5000)  # weights 1, 4, ~0, 1 under pow 2
    rows = resample_rows(scores[:, None], "pow", 2.0, torch.Generator().manual_seed(0))
    assert rows.shape == (20000,)
    share = torch.bincount(scores[rows].add(1).long(), minlength=4).double() / rows.numel()  # by score -1, 0, 1, 2
    assert share.tolist() == pytest.approx([1 / 6, 0.0, 1 / 6, 4 / 6], abs=0.015)


def _batch(scores: list[float]) -> RolloutBatch:
    b, t = len(scores), 3
    token_scores = torch.zeros(b, t)
    token_scores[:, -1] = torch.tensor(scores)
    return RolloutBatch(torch.arange(b * 2).view(b, 2), torch.ones(b, 2, dtype=torch.long),
                        torch.arange(b * t).view(b, t) + 100, torch.ones(b, t, dtype=torch.long),
                        token_level_scores=token_scores, advantages=torch.arange(b * t, dtype=torch.float).view(b, t),
                        uid=[f"u{i}" for i in range(b)])


def test_resampled_batch_keeps_each_rows_fields_together_and_is_seeded():
    batch = _batch([0.0, 1.0, 0.5, 1.0, 0.0, 0.25])
    out = resample_batch(batch, "max_random", 2.0, seed=7)
    assert len(out) == len(batch)
    for j in range(len(out)):
        i = int(out.uid[j][1:])
        assert torch.equal(out.response_ids[j], batch.response_ids[i])
        assert torch.equal(out.advantages[j], batch.advantages[i])
        assert torch.equal(out.token_level_scores[j], batch.token_level_scores[i])
    again = resample_batch(batch, "max_random", 2.0, seed=7)
    assert again.uid == out.uid
    assert any(resample_batch(batch, "max_random", 2.0, seed=s).uid != out.uid for s in range(8, 12))
    only_extremes = resample_batch(batch, "max_min", 2.0, seed=3)
    assert set(only_extremes.uid) <= {"u0", "u1", "u3", "u4"}  # the rows holding the best or worst score


BASE = ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]


@pytest.mark.parametrize("overrides, message", [
    (("algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=True"),
     "algorithm.use_pf_ppo=True with algorithm.adv_estimator=grpo: PF-PPO resamples the batch after GAE's advantages"),
    (("algorithm.pf_ppo.weight_pow=3",), r"algorithm.pf_ppo.weight_pow=3.0 is read only with algorithm.use_pf_ppo=True"),
    (("algorithm.pf_ppo.reweight_method=max_min",), "algorithm.pf_ppo.reweight_method=max_min is read only with"),
    (("algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=max_min", "algorithm.pf_ppo.weight_pow=1"),
     r"algorithm.pf_ppo.weight_pow=1.0 is read by reweight_method=pow only"),
    (("algorithm.use_pf_ppo=True", "algorithm.pf_ppo.weight_pow=-1"), "must be a finite number >= 0"),
    (("algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=top_k"), "reweight_method"),
])
def test_settings_that_would_not_act_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(BASE + list(overrides))


def test_verls_settings_load():
    cfg = load_config(BASE + ["algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=pow",
                              "algorithm.pf_ppo.weight_pow=2.0"])
    assert cfg.algorithm.use_pf_ppo and cfg.algorithm.pf_ppo.weight_pow == 2.0
