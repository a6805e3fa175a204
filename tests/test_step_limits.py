"""The trainer's phase-limit report: the tiny kit's run yields verl's MFU names and our limit fractions, sync is a
phase of its own only where the engine holds a copy of the weights, and a model the FLOP model does not know turns
the report off instead of failing the run."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

import pytest

from grpo_npu.config import load_config
from grpo_npu.device import get_device
from grpo_npu.perf.hardware import cpu_device_spec
from grpo_npu.run_control import Timer
from grpo_npu.step_limits import BANDWIDTH_METRIC, BANDWIDTH_PROBE, BASIS_PREFIX, StepLimits

BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
SECONDS = {"step": 2.0, "gen": 0.8, "reward": 0.01, "old_log_prob": 0.1, "adv": 0.01, "update_actor": 0.9,
           "testing": 5.0}  # testing runs after the step: not a phase of it


@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_report_of_one_step(tiny_model_path, rollout):
    cfg = load_config(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}",
                              f"actor_rollout_ref.rollout.name={rollout}"])
    limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic=False)
    metrics = limits.report(SECONDS, {"rollout/weight_sync_s": 0.3}, [5, 5, 7, 7], [3, 4, 2, 6], n=2)
    assert 0 < metrics["perf/mfu/actor"] < 1 and 0 < metrics["perf/mfu/actor_infer"] < 1
    assert metrics["perf/share/update_actor"] == pytest.approx(0.45)
    assert ("perf/limit_frac/sync" in metrics) == (rollout == "vllm")
    gen_share = (0.8 - 0.3) / 2.0 if rollout == "vllm" else 0.8 / 2.0
    assert metrics["perf/share/gen"] == pytest.approx(gen_share)
    assert not any("testing" in k for k in metrics)
    assert "update_actor" in limits.verdict() or "gen" in limits.verdict()


def test_the_decode_is_held_to_its_bandwidth_floor_when_the_engine_prefilled_in_one_step(tiny_model_path):
    """The engine's decode seconds (rollout/decode_s) against the decode steps' bandwidth floor, and its prefill
    step's (rollout/prefill_s) against the prefill's roofline; neither when it prefilled in several steps (each
    carrying decode work with it) or did not time its steps."""
    cfg = load_config(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}", "actor_rollout_ref.rollout.name=vllm"])
    limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic=False)
    rows = ([5, 5, 7, 7], [3, 4, 2, 6])
    timed = {"rollout/weight_sync_s": 0.3, "rollout/decode_s": 0.2, "rollout/prefill_steps": 1.0}
    one = limits.report(SECONDS, timed, *rows, n=2)
    half = limits.report(SECONDS, {**timed, "rollout/decode_s": 0.1}, *rows, n=2)
    assert one["perf/limit_frac/decode_bandwidth"] == pytest.approx(one["perf/floor_s/decode_bandwidth"] / 0.2)
    assert half["perf/limit_frac/decode_bandwidth"] == pytest.approx(2 * one["perf/limit_frac/decode_bandwidth"])
    prefilled = limits.report(SECONDS, {**timed, "rollout/prefill_s": 0.05}, *rows, n=2)  # its prefill step too
    assert prefilled["perf/limit_frac/prefill"] == pytest.approx(prefilled["perf/floor_s/prefill"] / 0.05)
    assert "perf/limit_frac/prefill" not in one  # not timed
    for other in ({**timed, "rollout/prefill_s": 0.05, "rollout/prefill_steps": 2.0}, {"rollout/weight_sync_s": 0.3}):
        held = limits.report(SECONDS, other, *rows, n=2)
        assert "perf/limit_frac/decode_bandwidth" not in held and "perf/limit_frac/prefill" not in held


def test_a_tensor_parallel_engine_is_one_engine_on_the_ranks_it_spans(tiny_model_path, monkeypatch):
    """vLLM tensor parallelism: the ranks of a group run one engine over the group's prompts. On the CPU the two
    ranks share one device, so one tp=2 engine over all rows has the floor of one rank's engine over them; two
    data-parallel engines (tp=1) over half the rows each read every weight twice."""
    monkeypatch.setattr("grpo_npu.step_limits.cpu_bandwidth_probe", lambda: 3e10)  # the same bandwidth for each
    def gen_floor(world_size: int, tp: int) -> float:
        cfg = load_config(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}", "actor_rollout_ref.rollout.name=vllm",
                                  f"trainer.n_gpus_per_node={world_size}",
                                  f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"])
        limits = StepLimits(cfg, get_device("cpu"), world_size=world_size, use_critic=False)
        return limits.report(SECONDS, {"rollout/weight_sync_s": 0.3}, [5, 5, 7, 7], [3, 4, 2, 6], n=2)["perf/floor_s/gen"]

    one = gen_floor(1, 1)
    assert gen_floor(2, 2) == pytest.approx(one, rel=1e-6)
    assert gen_floor(2, 1) > one


def test_the_sync_check_is_a_phase_of_its_own_on_the_steps_it_runs(tiny_model_path):
    """The weight-sync canary runs inside gen on its steps: its seconds leave gen (whose floor is the generation's)
    and show as a share of their own; a step without it has no such phase."""
    cfg = load_config(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}", "actor_rollout_ref.rollout.name=vllm"])
    limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic=False)
    checked = limits.report(SECONDS, {"rollout/weight_sync_s": 0.3, "rollout/sync_check_s": 0.2},
                            [5, 5, 7, 7], [3, 4, 2, 6], n=2)
    plain = limits.report(SECONDS, {"rollout/weight_sync_s": 0.3}, [5, 5, 7, 7], [3, 4, 2, 6], n=2)
    assert checked["perf/share/gen"] == pytest.approx((0.8 - 0.3 - 0.2) / 2.0)
    assert checked["perf/share/sync_check"] == pytest.approx(0.1)
    assert checked["perf/floor_s/gen"] == pytest.approx(plain["perf/floor_s/gen"])
    assert checked["perf/limit_frac/gen"] == pytest.approx(plain["perf/limit_frac/gen"] * 0.5 / 0.3)
    assert "perf/share/sync_check" not in plain and "perf/limit_frac/sync_check" not in checked


def test_the_run_logs_the_peaks_and_bandwidth_its_floors_use(tiny_model_path, caplog):
    """On a CPU they are measured in the run: the log line is how a reader knows what the floors assumed."""
    cfg = load_config(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}"])
    with caplog.at_level("INFO"):
        limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(BASIS_PREFIX)]
    assert lines == [BASIS_PREFIX + limits.spec.summary()]
    process = cpu_device_spec([limits.dtype, limits.rollout_dtype])  # the process's measurement: its peaks
    assert limits.spec.peak_flops == process.peak_flops and limits.spec.bandwidth > 1e8  # the bandwidth anew


class FixedTimer(Timer):
    """Every section takes 0.05 s, whatever runs in it."""

    @contextmanager
    def __call__(self, name):
        yield
        self.seconds[name] += 0.05


def test_a_cpu_run_measures_its_bandwidth_again_within_a_hundredth_of_its_step_time(tiny_model_path, monkeypatch):
    """A shared host's bandwidth moves within seconds: a step's floors use a probe taken at its start, as a phase of
    its own, whenever the probes so far and one more stay within 1% of the step time reported so far."""
    cfg = load_config(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}", "actor_rollout_ref.rollout.name=vllm"])
    measured = iter([40e9, 20e9, 80e9, 10e9])
    monkeypatch.setattr("grpo_npu.step_limits.cpu_bandwidth_probe", lambda: next(measured))
    monkeypatch.setattr("grpo_npu.perf.hardware.cpu_copy_bytes", lambda: 2**24)
    limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic=False)  # probes once
    # a probe's cost is estimated from the bandwidth, not timed: the first probe in a process also pages in its
    # buffers, which would hold off the next for tens of seconds of steps (here 4.5 passes of 2 x 16 MiB)
    assert limits.spec.bandwidth == 40e9 and limits.last_probe_s == pytest.approx(4.5 * 2**25 / 40e9)
    steps = []
    for _ in range(5):  # 4 s steps, 0.05 s probes: none in step 1 (no step time yet), then when the probes so far
        # and one more fit 1% of the steps so far: 0.05 <= 0.04 + ... at step 2, 0.1 <= 0.12 at 4, 0.15 <= 0.16 at 5
        timer = FixedTimer()
        limits.probe(timer)
        seconds = {**SECONDS, "step": 4.0, **timer.seconds}
        steps.append((BANDWIDTH_PROBE in timer.seconds,
                      limits.report(seconds, {"rollout/weight_sync_s": 0.3}, [5, 5, 7, 7], [3, 4, 2, 6], n=2)))
    assert [probed for probed, _ in steps] == [False, True, False, True, True]
    assert [m[BANDWIDTH_METRIC] for _, m in steps] == [40, 20, 20, 80, 10]
    first, second = steps[0][1], steps[1][1]
    assert second["perf/share/bandwidth_probe"] == pytest.approx(0.05 / 4.0)
    assert "perf/share/bandwidth_probe" not in first and "perf/limit_frac/bandwidth_probe" not in second
    # half the bandwidth: the bandwidth-only floor doubles, the generation being as long
    assert second["perf/limit_frac/gen_bandwidth"] == pytest.approx(2 * first["perf/limit_frac/gen_bandwidth"])


def test_an_unmodelled_model_turns_the_report_off(tiny_model_path, tmp_path, caplog):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "n_embd": 64}))
    cfg = load_config(BASE + [f"actor_rollout_ref.model.path={model}"])
    with caplog.at_level("INFO"):
        limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic=False)
    assert not limits.enabled and "no phase limits for this model" in caplog.text
    assert limits.report(SECONDS, {}, [5, 5], [3, 4], n=2) == {}



@pytest.mark.parametrize("keys, device_kind, steps", [
    ([], "cpu", 2 * 2),  # 8 responses / (2 prompts x n=2 per mini-batch) x 2 epochs
    (["actor_rollout_ref.actor.ppo_mini_batch_size=1"], "cpu", 4 * 2),
    (["actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"], "cpu", 2 * 2),  # the host is the device
    (["actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"], "cuda", 0),  # the host steps: not counted
])
def test_the_update_floor_counts_the_optimizer_steps_the_update_takes(tiny_model_path, keys, device_kind, steps):
    cfg = load_config(BASE + keys + [f"actor_rollout_ref.model.path={tiny_model_path}",
                                     "actor_rollout_ref.actor.ppo_epochs=2"])
    limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic=False)
    limits.device_kind = device_kind
    assert 2 * limits.mini_batches(8, critic=False) == steps  # x ppo_epochs=2
    if device_kind == "cpu":  # two ranks: each steps once per mini-batch of its half of the rows, the same count
        two = StepLimits(cfg, get_device("cpu"), world_size=2, use_critic=False)
        assert 2 * two.mini_batches(8, critic=False) == steps
    rows = ([5, 5, 7, 7, 5, 5, 7, 7], [3, 4, 2, 6, 3, 4, 2, 6])
    limits.device_kind = "cpu"
    counted = limits.report(SECONDS, {}, *rows, n=2)
    limits.mini_batches = lambda *args, **kwargs: 0
    flops_only = limits.report(SECONDS, {}, *rows, n=2)
    reads = steps * limits.actor.params * 5 * 4 / limits.spec.bandwidth if device_kind == "cpu" else None
    if reads is not None:  # 5 fp32 reads per parameter and step, at the measured bandwidth
        assert counted["perf/floor_s/update_actor"] - flops_only["perf/floor_s/update_actor"] == pytest.approx(reads)


@pytest.mark.parametrize("keys, want", [
    # fixed micro-batches: 8 responses per rank; the update's mini-batch 2 prompts x n=2 = 4 rows in passes of 1
    ([], {"update_actor": (4, 4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1),
          "ref": (8, 3, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 3)}),  # the rollout's 3: 3+3+2
    # token budgets: rows of 8-14 tokens, 20 to a pass (the workers' packing: balanced groups within the budget)
    (["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20"],
     {"update_actor": (4, 3, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 20),
      "ref": (8, 5, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 20)}),
    # the critic's value forward: its own micro-batch size, else its update's
    (["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2", "critic.forward_micro_batch_size_per_gpu=8"],
     {"update_critic": (4, 2, "critic.ppo_micro_batch_size_per_gpu", 2),
      "values": (8, 1, "critic.forward_micro_batch_size_per_gpu", 8)}),
])
def test_each_model_pass_phase_knows_its_passes_and_the_key_that_sizes_them(tiny_model_path, keys, want):
    from grpo_npu.step_limits import phase_passes

    cfg = load_config(BASE + ["data.train_batch_size=4", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
                              f"actor_rollout_ref.model.path={tiny_model_path}", *keys])
    limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic="algorithm.adv_estimator=gae" in keys)
    lengths = [8, 10, 12, 14, 8, 10, 12, 14]
    passes = phase_passes(cfg, limits.derived, lengths)
    for phase, (rows, count, key, value) in want.items():
        got = passes[phase]
        assert (got.batch_rows, got.passes, got.key, got.value) == (rows, count, key, value), phase
        assert got.packed == key.endswith("max_token_len_per_gpu")


def test_a_run_far_from_its_update_limit_on_an_accelerator_is_told_which_key_to_raise(tiny_model_path):
    """The advice reads the run: its phases' limits, the step's row lengths and the peak memory of its metrics."""
    cfg = load_config(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}"])
    limits = StepLimits(cfg, get_device("cpu"), world_size=1, use_critic=False)
    slow_update = {"step": 100.0, "gen": 0.01, "update_actor": 99.0}  # far from any floor
    limits.report(slow_update, {"perf/max_memory_allocated_gb": 3.0}, [5, 5, 7, 7], [3, 4, 2, 6], n=2)
    assert limits.advice() == ""  # a CPU: passes there are bound by their products
    limits.accelerator = True
    line = limits.advice()
    assert line.startswith("perf: to try: update_actor runs at ")
    assert "in 4 passes per 4-row batch (actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 rows per pass)" in line
    assert f"(peak allocated 3.0 of {limits.capacity / 2**30:.1f} GiB)" in line
