"""Rollout correction against verl's formulas, written here: per-token loops for the weights and masks, and a
float64 transcription of verl's rollout_corr_helper (compute_is_metrics, compute_rs_metrics,
compute_offpolicy_metrics, calculate_debug_metrics) for every metric, at each IS level and RS option."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from grpo_npu.algo import losses
from grpo_npu.algo import rollout_corr as rc
from grpo_npu.algo.names import ROLLOUT_IS_LEVELS, ROLLOUT_RS_OPTIONS, parse_rollout_rs
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import RolloutCorrectionConfig

SHAPES = [(1, 1), (3, 5), (8, 12)]
SEEDS = [0, 1, 2]
THRESHOLDS = {"k1": "0.8_1.25", "k2": "0.02", "k3": "0.02"}  # reject some, keep some at noise 0.3


def make(shape, seed, noise=0.3):
    """(old_logp, rollout_logp, mask): right-padded rows, row 0 empty and row 1 one token when B >= 3."""
    gen = torch.Generator().manual_seed(seed)
    b, t = shape
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    roll = old + noise * torch.randn(b, t, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    if b >= 3:
        lengths[0], lengths[1] = 0, 1
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return old, roll, mask


# ------------------------------------------------------------------------------------------------
# verl's formulas (verl/trainer/ppo/rollout_corr_helper.py, verl/utils/debug/metrics.py), float64
# ------------------------------------------------------------------------------------------------
def v_sum(x, m, axis=None):
    return torch.where(m.bool(), x, 0.0).sum() if axis is None else torch.where(m.bool(), x, 0.0).sum(axis)


def v_mean(x, m, axis=None):
    return v_sum(x, m, axis) / ((m.sum() if axis is None else m.sum(axis)) + 1e-8)


def verl_is(lr, m, level, thr, normalize):
    """verl 0.9.1: compute_rollout_correction_weights + compute_is_metrics (no IcePop lower bound)."""
    if level == "token":
        lfm = lr
        raw = torch.exp(lr.clamp(-20, 20))
    else:
        lfm = v_sum(lr, m, -1).unsqueeze(-1)
        raw = torch.exp(lfm.clamp(-20, 20)).expand_as(lr)
    raw = raw * m
    w = raw.clamp(max=thr)  # the truncated weights the metrics describe
    lo = 1.0 / thr
    out = {}
    if level == "sequence":
        out["rollout_is_max"] = torch.exp(lfm.max().clamp(max=20))
        out["rollout_is_min"] = torch.exp(lfm.min())
        out["rollout_is_mean"] = v_mean(w, m)
        out["rollout_is_ratio_fraction_high"] = (lfm > math.log(thr)).double().mean()
        out["rollout_is_ratio_fraction_low"] = (lfm < math.log(lo)).double().mean()
    else:
        out["rollout_is_mean"] = v_mean(w, m)
        out["rollout_is_ratio_fraction_high"] = v_mean((raw > thr).double(), m)
        out["rollout_is_ratio_fraction_low"] = v_mean((raw < lo).double(), m)
        out["rollout_is_max"] = w.masked_fill(~m.bool(), float("-inf")).max()
        out["rollout_is_min"] = w.masked_fill(~m.bool(), float("inf")).min()
    if m.sum() > 1:
        c = w.clamp(0.0, thr)
        out["rollout_is_std"] = torch.sqrt((v_mean(c.square(), m) - v_mean(c, m).square()).clamp(min=0))
    else:
        out["rollout_is_std"] = 0.0
    c = w.clamp(0.0, thr)
    c = c / (v_mean(c, m) + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / v_mean(c.square(), m)
    s = v_mean(w, m, -1)
    out["rollout_is_seq_mean"] = s.mean()
    out["rollout_is_seq_std"] = s.std() if s.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = s.max()
    out["rollout_is_seq_min"] = s.min()
    out["rollout_is_seq_max_deviation"] = (s - 1.0).abs().max()
    raw_s = v_mean(raw, m, -1)
    out["rollout_is_seq_fraction_high"] = (raw_s > thr).double().mean()
    out["rollout_is_seq_fraction_low"] = (raw_s < lo).double().mean()
    w = w.clamp(max=thr)
    if normalize:
        if level == "token":
            mean = v_mean(w, m)
        else:
            sm = (m.sum(-1) > 0).double()
            mean = (v_mean(w, m, -1) * sm).sum() / sm.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
            out["rollout_is_batch_norm_factor"] = mean
        else:
            out["rollout_is_batch_norm_factor"] = 1.0
    return w, out


def verl_rs_metrics(name, stat, m, seq_valid, level, per_seq, hi, lo, apply_lo):
    p = f"rollout_rs_{name}"
    sv = (per_seq if per_seq is not None else v_mean(stat, m, -1))[seq_valid]
    out = {f"{p}_mean": v_mean(stat, m)}
    if level == "sequence" and sv.numel():
        out[f"{p}_max"], out[f"{p}_min"] = sv.max(), sv.min()
        out[f"{p}_fraction_high"] = (sv > hi).double().mean()
        out[f"{p}_fraction_low"] = (sv < lo).double().mean() if apply_lo else 0.0
    else:
        out[f"{p}_max"] = stat.masked_fill(~m.bool(), float("-inf")).max()
        out[f"{p}_min"] = stat.masked_fill(~m.bool(), float("inf")).min()
        out[f"{p}_fraction_high"] = v_mean((stat > hi).double(), m)
        out[f"{p}_fraction_low"] = v_mean((stat < lo).double(), m) if apply_lo else 0.0
    if m.sum() > 1:
        c = stat.clamp(min=lo if apply_lo else 0.0, max=hi)
        out[f"{p}_std"] = torch.sqrt((v_mean(c.square(), m) - v_mean(c, m).square()).clamp(min=0))
    else:
        out[f"{p}_std"] = 0.0
    if sv.numel():
        out.update({f"{p}_seq_mean": sv.mean(), f"{p}_seq_std": sv.std() if sv.numel() > 1 else 0.0,
                    f"{p}_seq_max": sv.max(), f"{p}_seq_min": sv.min(), f"{p}_seq_max_deviation": sv.abs().max(),
                    f"{p}_seq_fraction_high": (sv > hi).double().mean()})
        if apply_lo:
            out[f"{p}_seq_fraction_low"] = (sv < lo).double().mean()
    else:
        out.update({f"{p}_{k}": 0.0 for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                                             "seq_fraction_high", "seq_fraction_low")})
    return out


def verl_rs(lr, m, rollout_rs, spec):
    opts = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",")))
    specs = [s.strip() for s in spec.split(",")]
    specs = specs * len(opts) if len(specs) == 1 else specs
    ls = lr.clamp(-20, 20)
    k = {"k1": -ls, "k2": 0.5 * ls**2, "k3": torch.exp(ls) - 1.0 - ls}
    mb, seq_valid = m.bool(), m.sum(-1) > 0
    combined = torch.ones_like(lr)
    out = {}
    for opt, sp in zip(opts, specs):
        est = opt[-2:]
        if est == "k1":
            lo_s, hi_s = sp.split("_") if "_" in sp else (str(1 / float(sp)), sp)
            lo, hi = math.log(float(lo_s)), math.log(float(hi_s))
        else:
            lo, hi = 0.0, float(sp)
        if opt.startswith("token"):
            stat, per_seq, level = k[est], None, "token"
        else:
            if opt.startswith("seq_sum"):
                s = v_sum(k[est], m, -1)
            elif opt.startswith("seq_mean"):
                s = v_mean(k[est], m, -1)
            else:
                s = k[est].masked_fill(~mb, float("-inf")).max(-1).values
                s = torch.where(s == float("-inf"), torch.zeros_like(s), s)
            stat, per_seq, level = s.unsqueeze(-1).expand_as(lr), s, "sequence"
        keep = (stat >= lo) & (stat <= hi) if est == "k1" else stat <= hi
        kf = keep.double()
        combined = combined * kf
        seq_keep = (~((~keep) & mb)).all(-1)
        out.update(verl_rs_metrics(opt, stat, m, seq_valid, level, per_seq, hi, lo, est == "k1"))
        out[f"rollout_rs_{opt}_masked_fraction"] = v_mean(1 - kf, m)
        sv = seq_valid.double()
        out[f"rollout_rs_{opt}_seq_masked_fraction"] = (
            ((1.0 - seq_keep.double()) * sv).sum() / sv.sum() if sv.sum() > 0 else 0.0)
    out["rollout_rs_masked_fraction"] = v_mean(1 - combined, m)
    out["rollout_rs_seq_masked_fraction"] = (~((combined > 0.5) & mb) & mb).any(-1).double().mean()
    return (m * combined).long(), out


def verl_offpolicy(old, roll, m):
    mo, mr = v_mean(old, m, -1), v_mean(roll, m, -1)
    lr = old - roll
    d = mr - mo
    return {
        "training_ppl": torch.exp(-mo).mean(), "training_log_ppl": (-mo).mean(),
        "kl": v_mean(roll - old, m), "k3_kl": v_mean(torch.exp(lr) - lr - 1, m),
        "rollout_ppl": torch.exp(-mr).mean(), "rollout_log_ppl": (-mr).mean(),
        "log_ppl_diff": d.mean(), "log_ppl_abs_diff": d.abs().mean(), "log_ppl_diff_max": d.max(),
        "log_ppl_diff_min": d.min(), "ppl_ratio": torch.exp(d).mean(),
        "chi2_token": v_mean(torch.exp(lr.clamp(-20, 20)).square(), m) - 1.0,
        "chi2_seq": torch.exp(2.0 * v_sum(lr, m, -1).clamp(-20, 20)).mean() - 1.0,
    }


def verl_all(old, roll, m, rollout_is=None, thr=2.0, normalize=False, rollout_rs=None, rs_thr=None):
    lr = old - roll
    out, w, mask = {}, None, m
    if rollout_is is not None:
        w, is_m = verl_is(lr, m, rollout_is, thr, normalize)
        out.update(is_m)
    if rollout_rs is not None:
        mask, rs_m = verl_rs(lr, m, rollout_rs, rs_thr)
        out.update(rs_m)
    out.update(verl_offpolicy(old, roll, m))
    return w, mask, {f"rollout_corr/{k}": float(v) for k, v in out.items()}


def assert_metrics_match(ours: dict, ref: dict):
    assert sorted(ours) == sorted(ref)
    for key in ref:
        assert ours[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key


# ------------------------------------------------------------------------------------------------
# Importance-sampling weights
# ------------------------------------------------------------------------------------------------
def loop_is_weights(old, roll, mask, level, thr):
    """w per token: min(r_t, thr) (token) or min(prod r_t, thr) (sequence); 0 off the mask."""
    b, t = old.shape
    w = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        valid = [j for j in range(t) if mask[i, j]]
        seq_lr = sum(float(old[i, j] - roll[i, j]) for j in valid)
        for j in valid:
            lr = float(old[i, j] - roll[i, j]) if level == "token" else seq_lr
            w[i, j] = min(math.exp(min(max(lr, -20.0), 20.0)), thr)
    return w


@pytest.mark.parametrize("level", ROLLOUT_IS_LEVELS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("thr", [1.1, 2.0])
def test_is_weights_and_metrics(level, shape, seed, thr):
    old, roll, mask = make(shape, seed)
    weights, loss_mask, metrics = rc.compute_rollout_correction(old, roll, mask, rollout_is=level,
                                                                rollout_is_threshold=thr)
    torch.testing.assert_close(weights.double(), loop_is_weights(old, roll, mask, level, thr), rtol=1e-5, atol=1e-6)
    assert loss_mask is mask
    w_ref, _, ref = verl_all(old, roll, mask, rollout_is=level, thr=thr)
    assert_metrics_match(metrics, ref)
    assert float(weights.max()) <= thr


@pytest.mark.parametrize("level", ROLLOUT_IS_LEVELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_is_batch_normalize(level, seed):
    old, roll, mask = make((8, 12), seed)
    weights, _, metrics = rc.compute_rollout_correction(old, roll, mask, rollout_is=level, rollout_is_threshold=1.5,
                                                        rollout_is_batch_normalize=True)
    w_ref, _, ref = verl_all(old, roll, mask, rollout_is=level, thr=1.5, normalize=True)
    torch.testing.assert_close(weights.double(), w_ref, rtol=1e-5, atol=1e-6)
    assert_metrics_match(metrics, ref)
    # normalised: mean 1 over tokens (token) or over sequences (sequence)
    valid = mask.bool()
    mean = weights[valid].mean() if level == "token" else weights[valid.any(-1), 0].mean()
    assert float(mean) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("level", ROLLOUT_IS_LEVELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_icepop_bounds_zero_the_weights_outside_them(level, seed):
    """rollout_is_threshold="lower_upper" (verl 0.9.1's IcePop): a weight inside [lower, upper] is kept as it is, one
    outside is 0 (not clamped); rollout_is_oob_ratio is the share of valid tokens outside; the low fraction counts
    against lower, not 1 / upper."""
    old, roll, mask = make((8, 12), seed)
    weights, _, metrics = rc.compute_rollout_correction(old, roll, mask, rollout_is=level, rollout_is_threshold="0.8_1.5")
    raw = loop_is_weights(old, roll, mask, level, float("inf"))
    inside = (raw >= 0.8) & (raw <= 1.5)
    torch.testing.assert_close(weights.double(), torch.where(inside, raw, torch.zeros_like(raw)), rtol=1e-5, atol=1e-6)
    valid = mask.bool()
    assert 0 < float((~inside)[valid].double().mean()) < 1  # both kinds of token in the batch
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(float((~inside)[valid].double().mean()))
    if level == "token":
        assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(float((raw < 0.8)[valid].double().mean()))
    tis, _, tis_metrics = rc.compute_rollout_correction(old, roll, mask, rollout_is=level, rollout_is_threshold="1.5")
    torch.testing.assert_close(tis.double(), loop_is_weights(old, roll, mask, level, 1.5), rtol=1e-5, atol=1e-6)
    assert "rollout_corr/rollout_is_oob_ratio" not in tis_metrics


def test_batch_normalisation_sums_over_ranks_when_asked():
    """Bypass mode normalises over the ranks (verl's distributed_masked_mean): the mean divided out is the sum of
    every rank's weights over every rank's count, which a stand-in all-reduce provides here."""
    old, roll, mask = make((6, 5), 0)
    other_total, other_count = torch.tensor(30.0, dtype=torch.float64), torch.tensor(10.0, dtype=torch.float64)
    weights, _, metrics = rc.compute_rollout_correction(
        old, roll, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
        all_reduce=lambda total, count: (total + other_total, count + other_count))
    raw = loop_is_weights(old, roll, mask, "token", 2.0)
    mean = (raw.sum() + 30.0) / (mask.sum() + 10.0)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(float(mean))
    torch.testing.assert_close(weights.double(), raw / mean, rtol=1e-5, atol=1e-6)


def test_is_weights_carry_no_gradient_and_saturate():
    old = torch.tensor([[0.0, 0.0]], requires_grad=True)
    roll = torch.tensor([[-30.0, 0.0]])
    weights, _, metrics = rc.compute_rollout_correction(old, roll, torch.ones(1, 2), rollout_is="token",
                                                        rollout_is_threshold=2.0)
    assert not weights.requires_grad and weights.tolist() == [[2.0, 1.0]]
    # verl 0.9.1: the token max describes the truncated weights, the fraction beyond C the raw ones
    assert metrics["rollout_corr/rollout_is_max"] == 2.0
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5
    _, _, seq = rc.compute_rollout_correction(old, roll, torch.ones(1, 2), rollout_is="sequence",
                                              rollout_is_threshold=2.0)
    # at the sequence level max comes from the summed log-ratio, which saturates at 20 (verl's SAFETY_BOUND)
    assert seq["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    assert seq["rollout_corr/rollout_is_mean"] == 2.0 and seq["rollout_corr/rollout_is_seq_fraction_high"] == 1.0


# ------------------------------------------------------------------------------------------------
# Rejection sampling
# ------------------------------------------------------------------------------------------------
def loop_rejection(old, roll, mask, option, lower, upper):
    """The kept (B, T) mask of one option, token by token / sequence by sequence."""
    b, t = old.shape
    est = option[-2:]

    def k(lr):
        lr = min(max(lr, -20.0), 20.0)
        return {"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1 - lr}[est]

    def ok(x):
        return math.log(lower) <= x <= math.log(upper) if est == "k1" else x <= upper

    keep = torch.zeros(b, t, dtype=torch.long)
    for i in range(b):
        valid = [j for j in range(t) if mask[i, j]]
        ks = [k(float(old[i, j] - roll[i, j])) for j in valid]
        if option.startswith("token"):
            for j, x in zip(valid, ks):
                keep[i, j] = int(ok(x))
            continue
        if option.startswith("seq_sum"):
            stat = sum(ks)
        elif option.startswith("seq_mean"):
            stat = sum(ks) / len(ks) if ks else 0.0
        else:
            stat = max(ks) if ks else 0.0
        for j in valid:
            keep[i, j] = int(ok(stat))
    return keep


@pytest.mark.parametrize("option", ROLLOUT_RS_OPTIONS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_each_rejection_option(option, shape, seed):
    old, roll, mask = make(shape, seed)
    spec = THRESHOLDS[option[-2:]]
    (_, lower, upper), = parse_rollout_rs(option, spec)
    weights, loss_mask, metrics = rc.compute_rollout_correction(old, roll, mask, rs_options=parse_rollout_rs(option, spec))
    assert weights is None
    assert loss_mask.dtype == mask.dtype
    assert torch.equal(loss_mask, loop_rejection(old, roll, mask, option, lower, upper))
    _, ref_mask, ref = verl_all(old, roll, mask, rollout_rs=option, rs_thr=spec)
    assert torch.equal(loss_mask, ref_mask)
    assert_metrics_match(metrics, ref)


def test_options_combine_by_and_with_is_weights():
    old, roll, mask = make((8, 12), 3)
    rs, spec = "token_k1,seq_mean_k3,token_k1", "0.5_2.0,0.02"  # thresholds count the distinct options
    options = parse_rollout_rs(rs, spec)
    assert [o for o, _, _ in options] == ["token_k1", "seq_mean_k3"]  # duplicates dropped, as in verl
    weights, loss_mask, metrics = rc.compute_rollout_correction(old, roll, mask, rollout_is="sequence",
                                                                rollout_is_threshold=2.0, rs_options=options)
    both = loop_rejection(old, roll, mask, "token_k1", 0.5, 2.0) * loop_rejection(old, roll, mask, "seq_mean_k3", None, 0.02)
    assert torch.equal(loss_mask, both) and 0 < int(both.sum()) < int(mask.sum())
    w_ref, _, ref = verl_all(old, roll, mask, rollout_is="sequence", rollout_rs="token_k1,seq_mean_k3",
                             rs_thr="0.5_2.0,0.02")
    torch.testing.assert_close(weights.double(), w_ref, rtol=1e-5, atol=1e-6)
    assert_metrics_match(metrics, ref)


def test_identical_policies_keep_everything():
    old, _, mask = make((6, 7), 0)
    options = parse_rollout_rs(",".join(ROLLOUT_RS_OPTIONS), "0.999_1.001,1e-6,1e-6,0.999_1.001,1e-6,1e-6,"
                                                             "0.999_1.001,1e-6,1e-6,1e-6,1e-6")
    weights, loss_mask, metrics = rc.compute_rollout_correction(old, old.clone(), mask, rollout_is="token",
                                                                rs_options=options)
    assert torch.equal(loss_mask, mask) and torch.equal(weights, mask.to(weights.dtype))
    assert metrics["rollout_corr/kl"] == 0.0 and metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0


# ------------------------------------------------------------------------------------------------
# Thresholds, metrics-only mode, debug metrics
# ------------------------------------------------------------------------------------------------
def test_parse_rollout_rs_thresholds():
    assert parse_rollout_rs("token_k1", 2.0) == (("token_k1", 0.5, 2.0),)  # lower = 1 / upper
    assert parse_rollout_rs("seq_mean_k1", "0.999_1.001") == (("seq_mean_k1", 0.999, 1.001),)
    assert parse_rollout_rs("token_k2, seq_max_k3", "0.1") == (("token_k2", None, 0.1), ("seq_max_k3", None, 0.1))
    assert parse_rollout_rs("token_k2,seq_sum_k1", "0.1,0.5_2") == (("token_k2", None, 0.1),
                                                                   ("seq_sum_k1", 0.5, 2.0))
    for rs, spec, match in [("token_k4", "1", "unknown option 'token_k4'"), ("token_k1", None, "must be set"),
                            ("token_k2", "0.5_2", "token_k2 needs one upper bound"),
                            ("token_k1,token_k2", "1,2,3", "expected one threshold or 2"),
                            ("seq_sum_k3", "-1", "positive"), ("token_k1", "0_2", "positive"), ("", "1", "expected one")]:
        with pytest.raises(ValueError, match=match):
            parse_rollout_rs(rs, spec)


def test_metrics_only_mode_and_probs_diff():
    old, roll, mask = make((8, 12), 5)
    weights, loss_mask, metrics = rc.compute_rollout_correction(old, roll, mask)
    assert weights is None and loss_mask is mask
    assert_metrics_match(metrics, verl_all(old, roll, mask)[2])
    p, q = torch.exp(old)[mask.bool()], torch.exp(roll)[mask.bool()]
    diff = (p - q).abs()
    ref = {"training/rollout_probs_diff_valid": 1.0, "training/rollout_probs_diff_max": float(diff.max()),
           "training/rollout_probs_diff_mean": float(diff.mean()), "training/rollout_probs_diff_std": float(diff.std()),
           "training/rollout_actor_probs_pearson_corr": float(torch.corrcoef(torch.stack([p, q]))[0, 1])}
    ours = {k: float(v) for k, v in rc.probs_diff_metrics(old, roll, mask).items()}
    assert_metrics_match(ours, ref)


# ------------------------------------------------------------------------------------------------
# In the loss and on the batch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_multiplies_per_token_terms_by_the_weights(mode, agg):
    """verl: pg_losses = pg_losses * rollout_is_weights before agg_loss; loss and gradient scale token by token."""
    gen = torch.Generator().manual_seed(0)
    old, roll, mask = make((6, 9), 4)
    logp = (old + 0.05 * torch.randn(old.shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(old.shape, generator=gen, dtype=torch.float64)
    weights, _, _ = rc.compute_rollout_correction(old, roll, mask, rollout_is="token", rollout_is_threshold=1.5)
    fn = losses.get_policy_loss_fn(mode)
    clip = dict(clip_low=0.2, clip_high=0.28) if mode == "vanilla" else dict(clip_low=3e-4, clip_high=4e-4)
    loss_w, m_w = fn(logp, old, adv, mask, agg_mode=agg, rollout_is_weights=weights, **clip)
    (grad_w,) = torch.autograd.grad(loss_w, logp)
    # reference: the unweighted loss's per-token terms L (captured at its agg_loss call), then agg(L * w)
    per_token = {}
    orig = losses.agg_loss

    def capture(x, m, mode_, **kw):
        per_token["L"] = x
        return orig(x, m, mode_, **kw)

    losses.agg_loss = capture
    try:
        fn(logp, old, adv, mask, agg_mode=agg, **clip)
    finally:
        losses.agg_loss = orig
    loss_ref = losses.agg_loss(per_token["L"] * weights, mask, agg)
    torch.testing.assert_close(loss_w, loss_ref)
    (grad_ref,) = torch.autograd.grad(loss_ref, logp)
    torch.testing.assert_close(grad_w, grad_ref)
    loss_1, m_1 = fn(logp, old, adv, mask, agg_mode=agg, **clip)
    assert not torch.allclose(loss_w, loss_1)  # the weights matter
    assert m_w == m_1  # clip fractions and ppo_kl do not depend on them (verl)


_Cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")


def test_correct_batch_sets_weights_and_loss_mask_only_when_it_can():
    old, roll, mask = make((4, 6), 1)
    b = RolloutBatch(prompt_ids=torch.zeros(4, 2, dtype=torch.long), prompt_mask=torch.ones(4, 2, dtype=torch.long),
                     response_ids=torch.zeros(4, 6, dtype=torch.long), response_mask=mask)
    metrics: dict = {}
    assert rc.correct_batch(b, _Cfg, metrics) is b and metrics == {}  # no rollout log-probs
    assert rc.correct_batch(b.replace(rollout_logp=roll), _Cfg, metrics).rollout_is_weights is None  # no old
    out = rc.correct_batch(b.replace(rollout_logp=roll, old_logp=old), _Cfg, metrics)
    assert out.rollout_is_weights.shape == (4, 6) and torch.equal(out.response_mask, mask)
    assert torch.equal(out.loss_tokens(), loop_rejection(old, roll, mask, "token_k1", 0.8, 1.25))
    assert "rollout_corr/rollout_is_mean" in metrics and "training/rollout_probs_diff_mean" in metrics
    bypass: dict = {}  # bypass mode: the actor corrects each micro-batch, the driver nothing
    full = b.replace(rollout_logp=roll, old_logp=old)
    assert rc.correct_batch(full, dataclasses.replace(_Cfg, bypass_mode=True), bypass) is full and bypass == {}
    picked = out.select([2, 3])  # the new fields travel with rows
    assert torch.equal(picked.loss_mask, out.loss_mask[2:]) and torch.equal(picked.rollout_is_weights,
                                                                           out.rollout_is_weights[2:])
