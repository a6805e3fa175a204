"""bench.phase_limits: the product's CLI with workload keys only, and targets read from the run's own limit metrics."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import phase_limits as pl
from bench.common import BenchResult
from tests.bench.test_step_vs_trl import WORKLOAD_KEYS


def _inputs(tmp_path):
    return {"model": str(tmp_path / "model"), "train": str(tmp_path / "train.parquet"), "prompt_tokens": 10}


@pytest.mark.parametrize("work", [pl.WORK, pl.QUICK], ids=["full", "quick"])
def test_the_cli_gets_only_workload_keys_with_the_vllm_rollout(work, tmp_path):
    keys = pl.svt.workload_keys(work, _inputs(tmp_path), "vllm")
    assert {k.split("=", 1)[0] for k in keys} <= WORKLOAD_KEYS
    assert "actor_rollout_ref.rollout.name=vllm" in keys and "actor_rollout_ref.rollout.ignore_eos=True" in keys
    assert f"trainer.total_training_steps={1 + work.timed_steps}" in keys and work.timed_steps >= 2
    assert work.threads == 2 and work.device == "cpu"


def test_full_size_is_qwen2_5_0_5b_shape():
    from grpo_npu.models.tiny import QWEN2_5_0_5B_SHAPE

    assert pl.WORK.model == "0.5b" and pl.QUICK.model != "0.5b"
    assert (QWEN2_5_0_5B_SHAPE.hidden_size, QWEN2_5_0_5B_SHAPE.num_hidden_layers, QWEN2_5_0_5B_SHAPE.vocab_size) == (
        896, 24, 151936)
    assert pl.WORK.response_len <= 32 and pl.WORK.prompts * pl.WORK.n <= 8  # a step well under a few minutes


def _step(step_s, gen_share, gen_frac, sync_s, bandwidth_frac, update_frac=0.5, gbps=32.0):
    """A metrics.jsonl step row as the trainer writes it (perf/* from grpo_npu.perf.report.StepReport.metrics);
    ``bandwidth_frac``: the decode steps' fraction of their bandwidth floor (rollout/decode_s: 60% of gen)."""
    decode_s = 0.6 * gen_share * step_s
    return {"timing_s/step": step_s, "rollout/weight_sync_s": sync_s,
            "perf/share/gen": gen_share, "perf/floor_s/gen": gen_frac * gen_share * step_s,
            "perf/limit_frac/gen": gen_frac, "perf/limit_frac/gen_bandwidth": 0.6 * bandwidth_frac,
            "rollout/decode_s": decode_s, "rollout/decode_steps": 31.0, "rollout/prefill_s": 0.2 * decode_s,
            "perf/floor_s/decode_bandwidth": bandwidth_frac * decode_s,
            "perf/limit_frac/decode_bandwidth": bandwidth_frac,
            "perf/floor_s/prefill": 0.1 * decode_s, "perf/limit_frac/prefill": 0.5,  # the prefill at half its roofline
            "perf/share/update_actor": 0.5, "perf/floor_s/update_actor": update_frac * 0.5 * step_s,
            "perf/limit_frac/update_actor": update_frac,
            "perf/share/sync": sync_s / step_s, "perf/floor_s/sync": sync_s / 3, "perf/limit_frac/sync": 1 / 3,
            "perf/share/reward": 0.01, "perf/mfu/actor": 0.4, "perf/bandwidth_gbps": gbps}


# three timed steps, each phase's median in a different one
STEPS = [_step(10.0, 0.3, 0.5, 1.0, 0.4, update_frac=0.9), _step(8.0, 0.25, 0.8, 0.6, 0.55, update_frac=0.7),
         _step(9.0, 0.2, 0.6, 0.8, 0.7, update_frac=0.6)]


def test_median_takes_the_worse_middle_of_an_even_count():
    assert pl.median([3.0, 1.0, 2.0]) == 2.0 and pl.median([1.0, 2.0]) == 2.0
    assert pl.median([1.0, 2.0], higher_is_better=True) == 1.0


def test_phase_rows_take_each_phases_median_step_from_the_metrics():
    rows = {r["phase"]: r for r in pl.phase_rows(STEPS)}
    assert set(rows) == {"gen", "update_actor", "sync", "reward"}
    gen = rows["gen"]  # fractions 0.5 / 0.8 / 0.6: the third step's
    assert gen["limit_frac"] == 0.6 and gen["time_over_floor"] == pytest.approx(1 / 0.6)
    assert gen["seconds"] == pytest.approx(0.2 * 9.0) and gen["floor_s"] == pytest.approx(0.6 * 1.8)
    assert gen["seconds_all"] == "3/2/1.8"
    update = rows["update_actor"]  # 0.9 / 0.7 / 0.6: the second step's
    assert update["limit_frac"] == 0.7 and update["seconds"] == pytest.approx(4.0)
    reward = rows["reward"]  # no floor: shares only, the median time (0.1 / 0.08 / 0.09 s)
    assert "time_over_floor" not in reward and reward["seconds"] == pytest.approx(0.09)


def test_targets_one_per_floored_phase_plus_decode_and_sync_over_copy():
    result = BenchResult(name="phase_limits")
    floor = {"copy_s": 0.25, "sync_s": 0.5, "prepack_s": 0.3, "state_MB": 2000.0, "sync_path": "direct", "tensors": 9}
    sync = pl.add_targets(result, pl.phase_rows(STEPS), STEPS, floor)
    t = result.targets
    assert set(t) == {"gen_time_over_floor", "update_actor_time_over_floor", "sync_time_over_floor",
                      "decode_fraction_of_bandwidth_floor", "weight_sync_over_copy_plus_prepack"}
    assert t["gen_time_over_floor"] == {"measured": pytest.approx(1 / 0.6), "target": "<= 1.5", "passed": False}
    assert t["update_actor_time_over_floor"] == {"measured": pytest.approx(1 / 0.7), "target": "<= 1.5",
                                                 "passed": True}
    # every step's sync at 1/3 of its bandwidth floor: the median (the second step, 0.6 s) + the prepack 0.3 s
    assert t["sync_time_over_floor"] == {"measured": pytest.approx(0.6 / (0.6 / 3 + 0.3)), "target": "<= 1.5",
                                         "passed": True}
    assert t["decode_fraction_of_bandwidth_floor"] == {"measured": 0.55, "target": ">= 0.6", "passed": False}
    # the median sync, 0.8 s, over copy_ + prepack
    assert t["weight_sync_over_copy_plus_prepack"] == {"measured": pytest.approx(0.8 / 0.55), "target": "<= 2.0",
                                                       "passed": True}
    assert sync["sync_over_copy"] == pytest.approx(0.8 / 0.25)  # against copy_ alone: kept in the row
    assert sync["prepack_share_of_isolated_sync"] == pytest.approx(0.6)
    assert sync["sync_less_prepack_over_copy"] == pytest.approx(0.8)
    assert sync["sync_over_copy_plus_prepack"] == pytest.approx(0.8 / 0.55)


def test_a_phase_faster_than_its_floor_is_flagged():
    quiet = [_step(10.0, 0.3, 0.9, 1.0, 0.8)]
    assert pl.floor_warnings(pl.phase_rows(quiet), quiet) == []
    loaded = [_step(10.0, 0.3, 1.2, 1.0, 1.4)]  # floors measured under load: gen "beats" its floor
    (warning,) = pl.floor_warnings(pl.phase_rows(loaded), loaded)
    assert warning.startswith("FLOORS DISTURBED") and "gen 1.20" in warning and "decode_bandwidth 1.40" in warning


def test_an_update_under_its_floor_by_no_more_than_packing_saves_is_not_flagged():
    # 2 prompts of 50 tokens x n=2, 32 tokens each: the floor counts 2 x 100 + 128 tokens, packing computes 100 + 128
    work = replace(pl.WORK, prompts=2, n=2, response_len=32)
    packing = pl.model_over_computed(work, prompt_tokens=100)
    assert packing == pytest.approx(328 / 228)
    fast = [_step(10.0, 0.3, 0.9, 1.0, 0.8, update_frac=1.2)]
    assert pl.floor_warnings(pl.phase_rows(fast), fast, packing) == []
    (warning,) = pl.floor_warnings(pl.phase_rows(fast), fast)  # without packing: flagged
    assert "update_actor 1.20" in warning
    faster = [_step(10.0, 0.3, 0.9, 1.0, 0.8, update_frac=1.5)]  # beyond what packing saves: flagged
    (warning,) = pl.floor_warnings(pl.phase_rows(faster), faster, packing)
    assert "update_actor 1.50" in warning


def test_the_run_step_reads_the_floors_basis_and_verdict_from_the_runs_log(tmp_path, monkeypatch):
    from grpo_npu.step_limits import BASIS_PREFIX

    log = tmp_path / "run.log"
    log.write_text("INFO grpo_npu.step_limits: " + BASIS_PREFIX + "CPU (2 threads): matmul peak fp32 215 GFLOP/s, "
                   "memory bandwidth 47.7 GB/s (measured)\n"
                   "INFO grpo_npu.trainer: perf: slowest against its limit: gen, 40% of step time\n")
    steps = [_step(10.0, 0.3, 0.5, 1.0, 0.4)] * (1 + pl.WORK.timed_steps)
    monkeypatch.setattr(pl.svt, "prepare_inputs", lambda work, root: _inputs(tmp_path))
    monkeypatch.setattr(pl, "run_cli", lambda *a, **k: {"rows": steps, "log": str(log)})
    step = pl.run_step(pl.WORK, tmp_path)
    assert step["basis"] == "CPU (2 threads): matmul peak fp32 215 GFLOP/s, memory bandwidth 47.7 GB/s (measured)"
    assert step["verdict"] == "perf: slowest against its limit: gen, 40% of step time"
    assert len(step["steps"]) == pl.WORK.timed_steps


def test_the_host_bandwidth_row_shows_each_steps_probe_and_rescales_the_decode_to_the_fastest():
    steps = [_step(10.0, 0.3, 0.5, 1.0, 0.62, gbps=32.5), _step(10.0, 0.3, 0.5, 1.0, 0.5, gbps=48.0),
             _step(10.0, 0.3, 0.5, 1.0, 0.7, gbps=30.0)]
    row = pl.host_bandwidth_row([31e9, 45e9, 27e9, 33e9, 32e9], steps)
    assert (row["probes"], row["min_GBps"], row["median_GBps"], row["max_GBps"]) == (5, 27, 32, 45)
    assert row["run_GBps"] == "32.5/48.0/30.0"
    # fraction x bandwidth per step: 20.15 / 24 / 21 GB/s; the median, over the fastest probe (the run's 48)
    assert row["decode_fraction_of_bandwidth_floor_at_max"] == pytest.approx(21 / 48)


def test_the_decode_row_is_the_engines_decode_steps_of_the_median_step():
    row = pl.decode_row(STEPS)  # decode fractions 0.4 / 0.55 / 0.7: the second step's
    assert row["limit_frac"] == 0.55 and row["seconds"] == pytest.approx(0.6 * 0.25 * 8.0)
    assert row["bandwidth_floor_s"] == pytest.approx(0.55 * row["seconds"]) and row["decode_steps"] == 31
    assert row["prefill_s"] == pytest.approx(0.2 * row["seconds"])
    assert row["prefill_floor_s"] == pytest.approx(0.1 * row["seconds"]) and row["prefill_limit_frac"] == 0.5
    assert row["gen_limit_frac_bandwidth"] == pytest.approx(0.6 * 0.55)  # the whole phase, prefill included


def test_host_bandwidth_series_probes_with_the_runs_threads_and_restores_the_callers():
    import torch

    before = torch.get_num_threads()
    series = pl.host_bandwidth_series(2, 0.0, threads=1)
    assert len(series) == 2 and all(b > 1e8 for b in series)  # any real machine; no speed is asserted
    assert torch.get_num_threads() == before
