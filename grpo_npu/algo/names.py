"""The names ``grpo_npu.algo`` accepts, declared once and torch-free.

The config validates against these tuples and ``--help`` lists them, without importing torch (the
entry points set process-environment defaults before torch loads). The registries in
:mod:`~grpo_npu.algo.advantages`, :mod:`~grpo_npu.algo.kl` and :mod:`~grpo_npu.algo.losses` refuse a
registration that is not declared here, and ``tests/test_names.py`` checks that every declared name
is registered.
"""

# algorithm.adv_estimator: advantages.ADVANTAGE_ESTIMATORS
ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "remax", "gdpo",
                  "optimal_token_baseline", "tir_optimal_token_baseline", "opo", "grpo_passk", "grpo_vectorized",
                  "rloo_vectorized")
# The estimators that read algorithm.norm_adv_by_std_in_grpo (their registration uses norm_by_std); validation
# refuses the key at False with any other, which would not read it
NORM_BY_STD_READERS = ("grpo", "gdpo", "grpo_passk", "grpo_vectorized")
# actor.kl_loss_type and algorithm.kl_penalty: kl.KL_ESTIMATORS (kl = k1, mse = k2, low_var_kl = k3); a "+" suffix:
# the estimate's value with k2's gradient (straight-through, verl's)
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+")
# algorithm.kl_ctrl.type: kl.make_kl_controller
KL_CTRL_TYPES = ("fixed", "adaptive")
# actor.policy_loss.loss_mode: losses.POLICY_LOSSES
POLICY_LOSS_MODES = ("vanilla", "gspo", "gpg", "cispo", "sapo", "dro", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov",
                     "kl_cov")
# The policy losses' settings: each actor key (under actor_rollout_ref.actor) and the keyword it reaches the loss
# function as. clip_ratio_low/high are the ends after clip_ratio filled a null one.
POLICY_LOSS_PARAMS = {"clip_ratio_low": "clip_low", "clip_ratio_high": "clip_high", "clip_ratio_c": "clip_c",
                      "tau_pos": "tau_pos", "tau_neg": "tau_neg", "policy_loss.dro_beta": "dro_beta",
                      "policy_loss.clip_cov_ratio": "clip_cov_ratio", "policy_loss.clip_cov_lb": "clip_cov_lb",
                      "policy_loss.clip_cov_ub": "clip_cov_ub", "policy_loss.kl_cov_ratio": "kl_cov_ratio",
                      "policy_loss.ppo_kl_coef": "ppo_kl_coef"}
# The ones each loss mode reads, as verl 0.9.1's functions read them; validation refuses another mode's at a
# value other than its default.
_CLIP = ("clip_ratio_low", "clip_ratio_high")
POLICY_LOSS_READS = {
    "vanilla": (*_CLIP, "clip_ratio_c"),
    "gspo": _CLIP,
    "gpg": (),
    "cispo": _CLIP,
    "sapo": ("tau_pos", "tau_neg"),
    "dro": ("policy_loss.dro_beta",),
    "dppo_tv": (*_CLIP, "clip_ratio_c"),
    "dppo_kl": (*_CLIP, "clip_ratio_c"),
    "geo_mean": _CLIP,
    "clip_cov": (*_CLIP, "policy_loss.clip_cov_ratio", "policy_loss.clip_cov_lb", "policy_loss.clip_cov_ub"),
    "kl_cov": ("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef"),
}
# algorithm.rollout_correction.loss_type: the bypass mode's losses (rollout_corr.bypass_policy_loss)
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
# actor.loss_agg_mode (and critic.loss_agg_mode): losses.agg_loss
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# algorithm.pf_ppo.reweight_method: the resampling weight of PF-PPO (pf_ppo.resample_weights)
PF_PPO_REWEIGHT_METHODS = ("pow", "max_min", "max_random")
# algorithm.filter_groups.metric: the per-response value whose std within a group DAPO's
# dynamic sampling (dapo.filter_groups) tests; the trainer reads it from the batch
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")

# algorithm.rollout_correction (verl's names; rollout_corr.py acts on them).
# rollout_is: the level of the truncated importance-sampling weight pi_old / pi_rollout (None: no weights)
ROLLOUT_IS_LEVELS = ("token", "sequence")
# rollout_rs: rejection-sampling criteria, a comma-separated list; <level>_<estimator> with level token,
# seq_sum, seq_mean (the geometric mean of the ratio for k1) or seq_max and estimator k1 = -log r,
# k2 = (log r)^2 / 2, k3 = r - 1 - log r (r = pi_old / pi_rollout). k1 takes "lower_upper" ratio bounds,
# k2 / k3 an upper bound.
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _bounds(spec: str) -> tuple[float | None, float]:
    """(lower or None, upper) of a "lower_upper" or "upper" threshold; ValueError if either is not a number."""
    lower, _, upper = spec.partition("_") if "_" in spec else ("", "", spec)
    return (float(lower) if lower else None), float(upper)


def parse_rollout_is_threshold(threshold) -> tuple[float, float | None]:
    """``rollout_is_threshold`` as (upper, lower or None), in verl 0.9.1's way: one number is truncated IS (TIS:
    weights clamped to it); "lower_upper" is IcePop (weights outside [lower, upper] set to 0). ValueError naming the
    key otherwise."""
    key = "algorithm.rollout_correction.rollout_is_threshold"
    spec = str(threshold).strip()
    try:
        lower, upper = _bounds(spec)
    except ValueError:
        raise ValueError(f"{key}={threshold!r}: expected one upper bound (2.0) or 'lower_upper' bounds (0.5_2.0)") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{key}={threshold!r}: expected bounds 0 < lower <= upper")
    return upper, lower


def parse_rollout_rs(rollout_rs: str, threshold) -> tuple[tuple[str, float | None, float], ...]:
    """``rollout_rs`` and ``rollout_rs_threshold`` as ((option, lower, upper), ...), in verl's way.

    Options are comma-separated, duplicates dropped in order. Thresholds: one per option, comma-separated,
    or one shared by all. A k1 option takes "lower_upper" ratio bounds, or one number (the upper bound,
    lower = 1 / upper); k2 / k3 options take one positive upper bound (lower None). ValueError naming the
    key otherwise.
    """
    key = "algorithm.rollout_correction.rollout_rs"
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    if not options:
        raise ValueError(f"{key}={rollout_rs!r}: expected one or more of {', '.join(ROLLOUT_RS_OPTIONS)}")
    for option in options:
        if option not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"{key}: unknown option {option!r}; known: {', '.join(ROLLOUT_RS_OPTIONS)}")
    tkey = "algorithm.rollout_correction.rollout_rs_threshold"
    if threshold is None:
        raise ValueError(f"{tkey} must be set when {key}={rollout_rs!r} (e.g. 0.5_2.0 for k1, 0.01 for k2 / k3)")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{tkey}={threshold!r}: expected one threshold or {len(options)} (one per {key} option)")
    specs = specs * len(options) if len(specs) == 1 else specs
    parsed = []
    for option, spec in zip(options, specs):
        try:
            if option.endswith("k1"):
                lower, upper = _bounds(spec)
                lower = lower if lower is not None else 1.0 / upper
            elif "_" in spec:
                raise ValueError
            else:
                lower, upper = None, float(spec)
        except (ValueError, ZeroDivisionError):
            want = "'lower_upper' ratio bounds or one upper bound" if option.endswith("k1") else "one upper bound"
            raise ValueError(f"{tkey}={threshold!r}: {option} needs {want}, got {spec!r}") from None
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"{tkey}={threshold!r}: {option} needs positive bounds, got {spec!r}")
        parsed.append((option, lower, upper))
    return tuple(parsed)
