"""algorithm.rollout_correction: verl's keys and defaults, the rollout log-probs it needs, refused values."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from grpo_npu.config import ConfigError, derive, load_config

BASE = ["trainer.n_gpus_per_node=1", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
LOGPROBS = "actor_rollout_ref.rollout.calculate_log_probs=True"
KEY = "algorithm.rollout_correction"
VERL_KEYS = Path(__file__).parent.parent / "grpo_npu" / "config" / "verl_0.9.1_keys.tsv"


def test_keys_and_defaults_are_verls():
    rows = [r for r in csv.reader((line for line in VERL_KEYS.read_text().splitlines() if not line.startswith("#")),
                                  delimiter="\t") if r and r[0].startswith(KEY + ".")]
    verl = {r[0].rpartition(".")[2]: r[1] for r in rows}
    assert len(verl) == 7
    rc = load_config(BASE).algorithm.rollout_correction
    ours = {name: getattr(rc, name) for name in verl}
    as_yaml = {k: "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in ours.items()}
    assert as_yaml == verl


@pytest.mark.parametrize("extra", [
    [f"{KEY}.rollout_is=token"], [f"{KEY}.rollout_is=sequence"],
    [f"{KEY}.rollout_rs=seq_mean_k1", f"{KEY}.rollout_rs_threshold=0.999_1.001"],
])
def test_a_correction_needs_the_rollout_log_probs_and_the_old_log_prob_pass(extra):
    with pytest.raises(ConfigError, match=r"set actor_rollout_ref\.rollout\.calculate_log_probs=True"):
        load_config(BASE + extra)
    cfg = load_config(BASE + extra + [LOGPROBS])
    assert derive(cfg, 1).old_logp_from_update is False  # the weights need old log-probs before the update
    assert derive(load_config(BASE + [LOGPROBS]), 1).old_logp_from_update is True  # metrics only: on-policy kept


def test_icepop_bounds_and_tis_numbers_are_both_accepted():
    for given, want in (("0.5_4.0", "0.5_4.0"), ("2.0", "2.0"), ("3", "3")):
        cfg = load_config(BASE + [LOGPROBS, f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold={given}"])
        assert cfg.algorithm.rollout_correction.rollout_is_threshold == want


def test_thresholds_parse_from_the_command_line():
    cfg = load_config(BASE + [LOGPROBS, f"{KEY}.rollout_rs=token_k1,seq_max_k3",
                              f"{KEY}.rollout_rs_threshold='0.5_2.0,0.01'"])
    assert cfg.algorithm.rollout_correction.rollout_rs_threshold == "0.5_2.0,0.01"
    cfg = load_config(BASE + [LOGPROBS, f"{KEY}.rollout_rs=token_k2", f"{KEY}.rollout_rs_threshold=0.02"])
    assert cfg.algorithm.rollout_correction.rollout_rs_threshold == "0.02"
    # YAML would read 0.5_2 as the number 0.52; the text key keeps "0.5_2" (ratio bounds 0.5 and 2)
    cfg = load_config(BASE + [LOGPROBS, f"{KEY}.rollout_rs=token_k1", f"{KEY}.rollout_rs_threshold=0.5_2"])
    assert cfg.algorithm.rollout_correction.rollout_rs_threshold == "0.5_2"


@pytest.mark.parametrize("extra, message", [
    ([f"{KEY}.rollout_is=geometric"], r"rollout_is='geometric' is not accepted; choose one of: token, sequence"),
    ([f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold=0"], r"rollout_is_threshold='0': expected bounds 0 < "
                                                                   r"lower <= upper"),
    ([f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold=2_1"], r"rollout_is_threshold='2_1': expected bounds"),
    ([f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold=high"], r"rollout_is_threshold='high': expected one "
                                                                      r"upper bound \(2\.0\) or 'lower_upper' bounds"),
    ([f"{KEY}.rollout_rs=token_k1"], r"rollout_rs_threshold must be set"),
    ([f"{KEY}.rollout_rs=token_k5", f"{KEY}.rollout_rs_threshold=2"], r"unknown option 'token_k5'"),
    ([f"{KEY}.rollout_rs=token_k2", f"{KEY}.rollout_rs_threshold=0.5_2"], r"token_k2 needs one upper bound"),
    ([f"{KEY}.rollout_rs_threshold=2.0"], r"rollout_rs_threshold='2.0' needs algorithm\.rollout_correction\.rollout_rs"),
    ([f"{KEY}.rollout_is_batch_normalize=True"], r"rollout_is_batch_normalize=True needs"),
    ([f"{KEY}.loss_type=reinforce"], r"^algorithm\.rollout_correction\.loss_type=reinforce is the bypass mode's loss: "
                                     r"set algorithm\.rollout_correction\.bypass_mode=True"),
    ([f"{KEY}.loss_type=pg"], r"loss_type='pg' is not accepted; choose one of: ppo_clip, reinforce"),
    ([f"{KEY}.bypass_mode=True", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     r"^algorithm\.rollout_correction\.bypass_mode=True replaces the policy loss with algorithm\.rollout_correction\."
     r"loss_type=ppo_clip \(as verl does\); actor_rollout_ref\.actor\.policy_loss\.loss_mode=gspo would not be used"),
    ([f"{KEY}.bypass_mode=True", "actor_rollout_ref.actor.old_log_prob=recompute"], r"bypass_mode=True skips the "
                                                                                    r"old-log-prob pass that"),
    ([f"{KEY}.bypass_mode=True", "actor_rollout_ref.actor.calculate_sum_pi_squared=True"], r"bypass_mode=True skips "
                                                                                           r"the old-log-prob pass, which"),
])
def test_refused_values_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(BASE + [LOGPROBS] + extra)


def test_bypass_mode_takes_the_engines_log_probs_as_the_old_ones():
    with pytest.raises(ConfigError, match=r"^algorithm\.rollout_correction\.bypass_mode=True takes the engine's "
                                          r"log-probs as the old policy: set actor_rollout_ref\.rollout\.calculate_log_probs"):
        load_config(BASE + [f"{KEY}.bypass_mode=True"])
    for extra in ([], [f"{KEY}.loss_type=reinforce", f"{KEY}.rollout_is=sequence", f"{KEY}.rollout_is_batch_normalize=True"]):
        d = derive(load_config(BASE + [LOGPROBS, f"{KEY}.bypass_mode=True", *extra]), 1)
        assert d.old_logp_from_rollout and not d.old_logp_from_update  # neither a pass nor the update's forward
    assert not derive(load_config(BASE + [LOGPROBS]), 1).old_logp_from_rollout
