"""docs/algorithms.md stays complete and true: every registered name is described, every function it names exists.

That every file and grpo_npu name it mentions exists, and that it points at nothing outside the
repository, is checked for every doc by tests/test_docs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import grpo_npu
from grpo_npu import metrics
from grpo_npu.algo import advantages, cov_losses, dapo, groups, kl, loss_base, losses, masked, pf_ppo, rollout_corr
from grpo_npu.algo import names as algo_names
from grpo_npu.reward import custom, gsm8k, manager, math as math_reward, parallel, score
from grpo_npu.reward import known_data_sources
from grpo_npu.reward.manager import REWARD_MANAGERS

ROOT = Path(grpo_npu.__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8")
PROSE = re.sub(r"^```.*?^```", "", DOC, flags=re.S | re.M)  # code blocks out: their backticks do not pair
QUOTED = set(re.findall(r"`([^`\n]+)`", PROSE))


@pytest.mark.parametrize(
    "kind, names",
    [
        ("algorithm.adv_estimator", advantages.ADVANTAGE_ESTIMATORS.names()),
        ("kl_loss_type / kl_penalty", kl.KL_ESTIMATORS.names()),
        ("policy_loss.loss_mode", losses.POLICY_LOSSES.names()),
        ("loss_agg_mode", list(losses.AGG_MODES)),
        ("rollout_correction.rollout_is", list(algo_names.ROLLOUT_IS_LEVELS)),
        ("rollout_correction.rollout_rs", list(algo_names.ROLLOUT_RS_OPTIONS)),
        ("pf_ppo.reweight_method", list(algo_names.PF_PPO_REWEIGHT_METHODS)),
        ("reward_manager", list(REWARD_MANAGERS)),
        ("data_source", known_data_sources()),
    ],
)
def test_every_registered_name_is_described(kind, names):
    missing = [name for name in names if name not in QUOTED]
    assert missing == [], f"docs/algorithms.md does not describe these {kind} values: {missing}"


@pytest.mark.parametrize(
    "module, names",
    [
        (advantages, ["compute_advantage", "grpo_advantage", "rloo_advantage", "reinforce_plus_plus_advantage",
                      "gpg_advantage", "remax_advantage", "opo_advantage", "grpo_passk_advantage",
                      "reinforce_plus_plus_baseline_advantage", "gae_advantage", "GRPO_EPS"]),
        (kl, ["kl_penalty", "apply_kl_in_reward", "make_kl_controller", "FixedKLController", "AdaptiveKLController",
              "K3_LOG_RATIO_CLAMP", "K3_VALUE_CLAMP", "ADAPTIVE_ERROR_CLIP"]),
        (losses, ["ppo_clip_loss", "gspo_loss", "value_loss", "agg_loss", "agg_counts", "get_policy_loss_fn",
                  "GSPO_LOG_RATIO_MAX", "gpg_loss", "cispo_loss", "sapo_loss", "dro_loss",
                  "dppo_tv_loss", "dppo_kl_loss", "geo_mean_loss", "SAPO_AGG_MODE", "DPPO_KL_EPS", "GEO_MEAN_IS_EPS"]),
        (loss_base, ["LOG_RATIO_CLAMP"]),
        (cov_losses, ["clip_cov_loss", "kl_cov_loss"]),
        (masked, ["masked_values", "masked_sum", "masked_mean", "masked_whiten", "WHITEN_EPS"]),
        (rollout_corr, ["compute_rollout_correction", "rollout_is_weights", "rollout_rejection_mask", "offpolicy_metrics",
                        "probs_diff_metrics", "correct_batch", "SAFETY_BOUND"]),
        (groups, ["group_stats"]),
        (dapo, ["filter_groups", "overlong_penalty"]),
        (pf_ppo, ["resample_batch"]),
        (manager, ["NaiveRewardManager", "DAPORewardManager"]),
        (score, ["compute_score"]),
        (custom, ["load_function", "FileFunction"]),
        (parallel, ["Scorer"]),
        (gsm8k, ["compute_score", "score_details", "extract_solution", "answers_match", "CLIP_CHARS"]),
        (math_reward, ["compute_score", "score_details", "compute_score_dapo", "last_boxed", "normalize_answer",
                       "is_equiv", "as_number", "DAPO_CLIP_CHARS"]),
        (metrics, ["compute_data_metrics", "compute_timing_metrics", "compute_throughput_metrics", "reduce_metrics"]),
    ],
)
def test_named_functions_exist(module, names):
    for name in names:
        assert re.search(rf"\b{name}\b", DOC), f"docs/algorithms.md no longer names {name}"
        assert hasattr(module, name), f"{module.__name__}.{name} is named in docs/algorithms.md but does not exist"
