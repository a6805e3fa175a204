"""Per-phase floors, MFU and shares of a step, and the end-of-run verdict, on synthetic numbers."""

from __future__ import annotations

import pytest

from grpo_npu.perf.flops import ModelShape, attention_pairs, forward_flops, train_flops
from grpo_npu.perf.hardware import DeviceSpec
from grpo_npu.perf.report import (PhaseCost, StepReport, StepWorkload, decode_bandwidth_floor, generation_floor,
                                  prefill_floor, step_report, verdict)

SHAPE = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=128,
                   head_width=128, tied_embeddings=True)
CRITIC = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=128,
                    head_width=1, tied_embeddings=False)
ACCEL = DeviceSpec("accel", {"fp32": 1e12, "bf16": 4e12, "fp16": 4e12}, 1e11, "test")
HUGE = 1e30  # a peak or bandwidth that takes that term out of the roofline


def spec(peak: float = 1e12, bandwidth: float = 1e11, shared: bool = False) -> DeviceSpec:
    return DeviceSpec("test", {"fp32": peak}, bandwidth, "test", ranks_share_device=shared)


def workload(prompts, responses, *, n=1, world=1, **kw) -> StepWorkload:
    return StepWorkload(actor=SHAPE, prompt_lengths=prompts, response_lengths=responses, n=n, world_size=world,
                        dtype="fp32", **kw)


# ------------------------------------------------------------------------------------------------
# gen floor
# ------------------------------------------------------------------------------------------------
def test_decode_reads_the_weights_once_per_step_for_the_whole_batch():
    rows, p, r, n = 4, 10, 6, 4  # one prompt, four samples decoded together
    w = workload([p] * rows, [r] * rows, n=n)
    _, bandwidth_s = generation_floor(w, spec(peak=HUGE))
    weights, kv = SHAPE.read_weights * 4, SHAPE.kv_bytes_per_token("fp32")
    prefill = weights + kv * p  # the shared prompt's cache written once
    decode = sum(weights + kv * rows * (p + s) for s in range(1, r))
    assert bandwidth_s == pytest.approx((prefill + decode) / 1e11)


def test_the_decode_floor_is_the_decode_steps_memory_traffic_without_the_prefills():
    rows, p, r, n = 4, 10, 6, 2
    w = workload([p] * rows, [r] * rows, n=n)
    weights, kv = SHAPE.read_weights * 4, SHAPE.kv_bytes_per_token("fp32")
    decode = sum(weights + kv * rows * (p + s) for s in range(1, r))  # steps 1..r-1: the prefill gave token 0
    assert decode_bandwidth_floor(w, spec(peak=1.0)) == pytest.approx(decode / 1e11)  # compute never enters
    assert decode_bandwidth_floor(workload([p] * rows, [1] * rows, n=n), spec()) == 0  # prefill only
    # against the engine's own decode seconds, beside the whole phase's fraction
    seconds = {"step": 1.0, "gen": 0.5}
    report = step_report(seconds, w, spec(), decode_s=0.25)
    metrics = report.metrics()
    assert metrics["perf/floor_s/decode_bandwidth"] == pytest.approx(decode / 1e11)
    assert metrics["perf/limit_frac/decode_bandwidth"] == pytest.approx(decode / 1e11 / 0.25)
    assert "perf/limit_frac/gen_bandwidth" in metrics
    assert "perf/limit_frac/decode_bandwidth" not in step_report(seconds, w, spec()).metrics()  # not timed
    with pytest.raises(ValueError, match="decode_s=-1"):
        step_report(seconds, w, spec(), decode_s=-1)


def test_the_prefill_floor_is_each_groups_prompt_once_and_is_held_to_the_engines_prefill_step():
    prompts, n = [10, 10, 7, 7], 2  # two groups of two rows
    w = workload(prompts, [6] * 4, n=n)
    once = forward_flops(SHAPE, [10, 7], head_tokens=2, causal=True).total  # each prompt once, one token sampled
    assert prefill_floor(w, spec(bandwidth=HUGE)) == pytest.approx(once / 1e12)
    read = SHAPE.read_weights * 4 + SHAPE.kv_bytes_per_token("fp32") * (10 + 7)  # weights once, each cache written once
    assert prefill_floor(w, spec(peak=HUGE)) == pytest.approx(read / 1e11)
    # the gen roofline starts with it: with one token per row there is no decode step
    assert generation_floor(workload(prompts, [1] * 4, n=n), spec())[0] == pytest.approx(prefill_floor(w, spec()))
    seconds = {"step": 1.0, "gen": 0.5}
    metrics = step_report(seconds, w, spec(), decode_s=0.3, prefill_s=0.125).metrics()
    assert metrics["perf/floor_s/prefill"] == pytest.approx(prefill_floor(w, spec()))
    assert metrics["perf/limit_frac/prefill"] == pytest.approx(prefill_floor(w, spec()) / 0.125)
    assert "perf/limit_frac/prefill" not in step_report(seconds, w, spec(), decode_s=0.3).metrics()  # not timed
    with pytest.raises(ValueError, match="prefill_s=inf"):
        step_report(seconds, w, spec(), prefill_s=float("inf"))


def test_finished_rows_stop_costing():
    long_only = workload([7], [9])
    with_short = workload([7, 5], [9, 1])  # the short row ends with its prefill token
    _, a = generation_floor(long_only, spec(peak=HUGE))
    _, b = generation_floor(with_short, spec(peak=HUGE))
    assert b - a == pytest.approx(SHAPE.kv_bytes_per_token("fp32") * 5 / 1e11)  # its prompt's cache only


def test_compute_bound_generation_is_a_causal_forward_without_the_last_token():
    prompts, responses = [9, 4, 12], [5, 1, 3]
    roofline, _ = generation_floor(workload(prompts, responses), spec(bandwidth=HUGE))
    fed = [p + r - 1 for p, r in zip(prompts, responses)]  # the last sampled token is never fed back
    want = forward_flops(SHAPE, fed, head_tokens=sum(responses), causal=True).total / 1e12
    assert roofline == pytest.approx(want)


def test_ranks_generate_in_parallel_unless_they_share_the_device():
    half_p, half_r = [6, 6, 9, 9], [4, 8, 2, 2]
    one = generation_floor(workload(half_p, half_r, n=2), spec())
    two = generation_floor(workload(half_p * 2, half_r * 2, n=2, world=2), spec())
    shared = generation_floor(workload(half_p * 2, half_r * 2, n=2, world=2), spec(shared=True))
    assert two == pytest.approx(one)
    assert shared == pytest.approx((2 * one[0], 2 * one[1]))


def test_a_tensor_parallel_engine_splits_its_work_over_its_ranks_devices():
    prompts, responses = [6, 6, 9, 9], [4, 8, 2, 2]
    one = workload(prompts, responses, n=2)
    tp2 = workload(prompts, responses, n=2, world=2, rollout_tp=2)  # one engine over both ranks
    assert generation_floor(tp2, spec()) == pytest.approx(tuple(x / 2 for x in generation_floor(one, spec())))
    assert decode_bandwidth_floor(tp2, spec()) == pytest.approx(decode_bandwidth_floor(one, spec()) / 2)
    assert prefill_floor(tp2, spec()) == pytest.approx(prefill_floor(one, spec()) / 2)
    # a device the ranks share splits nothing: the one engine's whole work
    assert generation_floor(tp2, spec(shared=True)) == pytest.approx(generation_floor(one, spec()))
    # two engines of two ranks each: each half of the groups on two devices
    four = workload(prompts * 2, responses * 2, n=2, world=4, rollout_tp=2)
    assert generation_floor(four, spec()) == pytest.approx(generation_floor(tp2, spec()))
    with pytest.raises(ValueError, match="rollout_tp=3 must divide world_size=4"):
        workload(prompts, responses, n=2, world=4, rollout_tp=3)


# ------------------------------------------------------------------------------------------------
# step report
# ------------------------------------------------------------------------------------------------
def test_mfu_and_limit_fractions_under_verl_names():
    prompts, responses = [12, 12, 20, 20], [8, 3, 5, 0]
    w = workload(prompts, responses, n=2, world=2, gradient_checkpointing=True, ppo_epochs=2,
                 critic=CRITIC, critic_ppo_epochs=1)
    seqs = [p + r for p, r in zip(prompts, responses)]
    peak_all = 2 * 1e12
    fwd = forward_flops(SHAPE, seqs, head_tokens=16).total
    update_model = 2 * train_flops(SHAPE, seqs, head_tokens=16).total
    update_hw = 2 * train_flops(SHAPE, seqs, head_tokens=16, recompute=True).total
    critic_update = train_flops(CRITIC, seqs, head_tokens=16).total
    seconds = {"step": 10.0, "gen": 2.0, "sync": 0.5, "reward": 1.0, "old_log_prob": fwd / peak_all,
               "ref": 3 * fwd / peak_all, "values": 0.25, "update_critic": 2 * critic_update / peak_all,
               "update_actor": update_model / peak_all, "adv": 0.1}
    metrics = step_report(seconds, w, spec()).metrics()
    assert metrics["perf/mfu/actor"] == pytest.approx(1.0)  # model FLOPs: no recompute
    assert metrics["perf/limit_frac/update_actor"] == pytest.approx(update_hw / update_model)  # > 1 with it
    assert metrics["perf/mfu/actor_infer"] == pytest.approx(0.5)  # 2 forwards in 4 forwards' peak time
    assert metrics["perf/mfu/critic"] == pytest.approx(0.5)
    assert metrics["perf/limit_frac/old_log_prob"] == pytest.approx(1.0)
    assert metrics["perf/limit_frac/ref"] == pytest.approx(1 / 3)
    copy = 2 * SHAPE.params * 4 / 1e11
    assert metrics["perf/floor_s/sync"] == pytest.approx(copy)
    assert metrics["perf/limit_frac/sync"] == pytest.approx(copy / 0.5)
    roofline, bandwidth_only = generation_floor(w, spec())
    assert metrics["perf/limit_frac/gen"] == pytest.approx(roofline / 2.0)
    assert metrics["perf/limit_frac/gen_bandwidth"] == pytest.approx(bandwidth_only / 2.0)
    accounted = sum(v for k, v in seconds.items() if k != "step")
    assert metrics["perf/share/idle"] == pytest.approx((10.0 - accounted) / 10.0)
    assert metrics["perf/share/reward"] == pytest.approx(0.1)
    assert "perf/floor_s/reward" not in metrics and "perf/limit_frac/idle" not in metrics


@pytest.mark.parametrize("shared", [False, True])
def test_an_update_floor_adds_its_optimizer_steps_reads_at_the_bandwidth(shared):
    """Each optimizer step reads 5 fp32 values per parameter (the gradient for its norm; AdamW's parameter,
    gradient and two moments); FSDP shards them over the devices, and ranks sharing one device share its
    bandwidth. The critic's steps count its own parameters."""
    prompts, responses = [12, 12, 20, 20], [8, 3, 5, 0]
    seqs = [p + r for p, r in zip(prompts, responses)]
    plain = workload(prompts, responses, n=2, world=2, critic=CRITIC)
    stepping = workload(prompts, responses, n=2, world=2, critic=CRITIC, optimizer_steps=3, critic_optimizer_steps=2)
    seconds = {"step": 10.0, "update_actor": 2.0, "update_critic": 1.0}
    devices = 1 if shared else 2
    without = step_report(seconds, plain, spec(shared=shared)).metrics()
    report = step_report(seconds, stepping, spec(shared=shared))
    metrics = report.metrics()
    compute = train_flops(SHAPE, seqs, head_tokens=16).total / (devices * 1e12)
    assert without["perf/floor_s/update_actor"] == pytest.approx(compute)  # no steps counted: FLOPs only
    reads = 3 * SHAPE.params * 5 * 4 / (devices * 1e11)
    assert metrics["perf/floor_s/update_actor"] == pytest.approx(compute + reads)
    critic_compute = train_flops(CRITIC, seqs, head_tokens=16).total / (devices * 1e12)
    assert metrics["perf/floor_s/update_critic"] == pytest.approx(critic_compute + 2 * CRITIC.params * 20 / (devices * 1e11))
    assert metrics["perf/mfu/actor"] == pytest.approx(without["perf/mfu/actor"])  # verl's MFU: model FLOPs only
    assert report.phases["update_actor"].bound == "compute + optimizer"
    with pytest.raises(ValueError, match="optimizer_steps=-1 must be >= 0"):
        workload(prompts, responses, n=2, optimizer_steps=-1)


def test_a_cpu_shares_one_peak_between_ranks():
    w = workload([8, 8], [4, 4], n=1, world=2)
    fwd = forward_flops(SHAPE, [12, 12], head_tokens=8).total
    report = step_report({"step": 1.0, "ref": fwd / 1e12}, w, spec(shared=True))
    assert report.mfu["perf/mfu/actor_infer"] == pytest.approx(1.0)  # not 0.5: one device, not two


def test_unknown_device_gives_shares_only():
    report = step_report({"step": 4.0, "gen": 1.0, "update_actor": 2.0}, workload([5], [5]), None)
    assert report.metrics() == {"perf/share/gen": 0.25, "perf/share/update_actor": 0.5, "perf/share/idle": 0.25}


@pytest.mark.parametrize("seconds, match", [
    ({"gen": 1.0}, r"no 'step' entry"),
    ({"step": 1.0, "gen": 0.8, "sync": 0.5}, r"add up to 1.3 s, more than the step's 1 s; pass disjoint phases"),
    ({"step": 1.0, "gen": -0.1}, r"phase 'gen' took -0.1 s"),
    ({"step": 0.0}, r"step took 0.0 s"),
    ({"step": 1.0, "values": 0.2}, r"phases \['values'\] were timed but StepWorkload.critic is None"),
])
def test_bad_timings_are_refused(seconds, match):
    with pytest.raises(ValueError, match=match):
        step_report(seconds, workload([5], [5]), spec())


def test_sync_floor_reads_the_compute_dtype_and_writes_the_engines():
    """An fp32 actor syncing into a bf16 engine reads 4 bytes and writes 2 per parameter; bf16 into bf16, 2 + 2."""
    fp32_to_bf16 = workload([3], [1], rollout_dtype="bfloat16")
    bf16_spec = DeviceSpec("test", {"fp32": 1e12, "bf16": 2e12}, 1e11, "test")
    metrics = step_report({"step": 1.0, "sync": 0.5}, fp32_to_bf16, bf16_spec).metrics()
    assert metrics["perf/floor_s/sync"] == pytest.approx(SHAPE.params * (4 + 2) / 1e11)
    bf16 = StepWorkload(actor=SHAPE, prompt_lengths=[3], response_lengths=[1], n=1, world_size=1, dtype="bf16")
    metrics = step_report({"step": 1.0, "sync": 0.5}, bf16, bf16_spec).metrics()
    assert metrics["perf/floor_s/sync"] == pytest.approx(SHAPE.params * (2 + 2) / 1e11)
    # a tensor-parallel engine: each of its ranks copies its shard (on a shared device, every rank's shard)
    tp2 = StepWorkload(actor=SHAPE, prompt_lengths=[3, 3], response_lengths=[1, 1], n=1, world_size=2, rollout_tp=2,
                       dtype="bf16")
    metrics = step_report({"step": 1.0, "sync": 0.5}, tp2, bf16_spec).metrics()
    assert metrics["perf/floor_s/sync"] == pytest.approx(SHAPE.params * (2 + 2) / 2 / 1e11)
    shared = DeviceSpec("test", {"fp32": 1e12, "bf16": 2e12}, 1e11, "test", ranks_share_device=True)
    metrics = step_report({"step": 1.0, "sync": 0.5}, tp2, shared).metrics()
    assert metrics["perf/floor_s/sync"] == pytest.approx(SHAPE.params * (2 + 2) / 1e11)


def test_workload_validation():
    with pytest.raises(ValueError, match=r"2 prompt lengths and 3 response lengths"):
        workload([3, 3], [1, 2, 3])
    with pytest.raises(ValueError, match=r"rows 0..1 share a prompt but have prompt lengths \[3, 4\]"):
        workload([3, 4], [1, 1], n=2)
    with pytest.raises(ValueError, match=r"3 rows is not a multiple of n=2"):
        workload([3, 3, 3], [1, 1, 1], n=2)
    with pytest.raises(ValueError, match=r"dtype 'int8'"):
        StepWorkload(actor=SHAPE, prompt_lengths=[3], response_lengths=[1], n=1, world_size=1, dtype="int8")
    w = StepWorkload(actor=SHAPE, prompt_lengths=[3], response_lengths=[1], n=1, world_size=1, dtype="float32",
                     rollout_dtype="bfloat16")
    assert (w.dtype, w.rollout_dtype) == ("fp32", "bf16")
    assert attention_pairs(4) == 10 and attention_pairs(4, causal=False) == 16


# ------------------------------------------------------------------------------------------------
# verdict
# ------------------------------------------------------------------------------------------------
def report(step_s: float, **phases: PhaseCost) -> StepReport:
    return StepReport(step_s, phases, {})


def test_verdict_names_the_phase_with_the_most_time_above_its_limit():
    steps = [report(10.0, gen=PhaseCost(6.0, 0.5, "roofline"), update_actor=PhaseCost(3.0, 2.4, "compute"),
                    reward=PhaseCost(0.5), idle=PhaseCost(0.5)),
             report(12.0, gen=PhaseCost(8.0, 0.5, "roofline"), update_actor=PhaseCost(3.0, 2.4, "compute"),
                    reward=PhaseCost(0.5), idle=PhaseCost(0.5))]
    line = verdict(steps)
    assert line.startswith("perf: slowest against its limit: gen, 64% of step time (7 s/step) at 7% of its "
                           "roofline limit (0.5 s/step), 6.5 s/step above it")
    assert line.endswith("; next: update_actor (0.6 s/step above its limit)")
    assert "\n" not in line


def test_a_verdict_naming_gen_says_how_far_its_prefill_and_decode_steps_are_from_their_limits():
    def gen_step(prefill_s, decode_s):
        return StepReport(10.0, {"gen": PhaseCost(6.0, 0.5, "roofline"), "update_actor": PhaseCost(3.0, 2.4, "compute")},
                          {}, decode_bandwidth_floor_s=0.3, decode_s=decode_s, prefill_floor_s=0.1, prefill_s=prefill_s)
    line = verdict([gen_step(0.2, 0.6), gen_step(0.2, 0.4)])  # over the run: 0.2 / 0.4 and 0.6 / 1.0
    assert "above it (prefill at 50% of its roofline, decode steps at 60% of their bandwidth floor); next: " in line
    # named second, the split goes with it; not timed, nothing is said
    slow_update = [StepReport(10.0, {"gen": PhaseCost(3.0, 2.5, "roofline"), "update_actor": PhaseCost(6.0, 1.0, "compute")},
                              {}, decode_bandwidth_floor_s=0.3, decode_s=0.6)]
    assert verdict(slow_update).endswith("; next: gen (0.5 s/step above its limit; decode steps at 50% of their "
                                         "bandwidth floor)")
    assert verdict([report(10.0, gen=PhaseCost(6.0, 0.5, "roofline"))]).endswith("5.5 s/step above it")


def test_verdict_weighs_time_not_fractions():
    # update_actor is at 10% of its limit but only 10 ms; gen at 50% costs 4 s above its floor.
    steps = [report(9.0, update_actor=PhaseCost(0.01, 0.001, "compute"), gen=PhaseCost(8.0, 4.0, "roofline"),
                    sync=PhaseCost(0.99, 0.9, "copy"))]
    assert verdict(steps).startswith("perf: slowest against its limit: gen,")


def test_verdict_blames_a_phase_without_a_floor():
    steps = [report(10.0, reward=PhaseCost(7.0), gen=PhaseCost(3.0, 2.5, "roofline"))]
    assert verdict(steps).startswith("perf: slowest against its limit: reward, 70% of step time (7 s/step), "
                                     "no physical floor modelled")
    assert verdict([]) == "perf: no steps to judge"


def test_verdict_from_step_reports_end_to_end():
    w = workload([10, 10], [40, 40], n=2)
    fast_update = train_flops(SHAPE, [50, 50], head_tokens=80).total / 1e12 * 1.1  # 91% of its limit
    steps = [step_report({"step": 5.0, "gen": 4.0, "update_actor": fast_update}, w, spec()) for _ in range(3)]
    assert verdict(steps).startswith("perf: slowest against its limit: gen,")
