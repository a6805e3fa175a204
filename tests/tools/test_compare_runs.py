"""compare_runs: MAE % and throughput ratio against references written here, outputs, exit codes, bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_npu
from grpo_npu.tools import compare_runs as cr

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib (the test/plot extra) is not installed")


def write_run(root: Path, name: str, rows: list[dict] | list[str]) -> Path:
    """A run directory with metrics.jsonl; str rows are written verbatim (for malformed lines)."""
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return run


def rl_rows(rewards: dict[int, float], throughput: float = 1000.0) -> list[dict]:
    return [{"step": s, cr.REWARD_KEY: r, cr.THROUGHPUT_KEY: throughput + s} for s, r in rewards.items()]


def reference_mae_pct(a: dict[int, float], b: dict[int, float]) -> float:
    """100 * mean|a-b| / mean|b| over the steps both runs log, by plain loops."""
    total_diff = total_base = 0.0
    n = 0
    for step in b:
        if step in a:
            total_diff += abs(a[step] - b[step])
            total_base += abs(b[step])
            n += 1
    return 100.0 * (total_diff / n) / (total_base / n)


# --------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mae_pct_matches_reference_over_common_steps(tmp_path, seed):
    rng = random.Random(seed)
    a = {s: rng.uniform(-1, 1) for s in range(1, rng.randint(5, 40))}
    start = rng.randint(1, 4)
    b = {s: rng.uniform(0.2, 1.5) for s in range(start, start + rng.randint(5, 40))}
    report = cr.compare_runs(write_run(tmp_path, "a", rl_rows(a)), write_run(tmp_path, "b", rl_rows(b)))
    common = sorted(set(a) & set(b))
    assert report.common_steps == tuple(common)
    assert report.mae_pct == pytest.approx(reference_mae_pct(a, b), rel=1e-12)
    assert report.mae == pytest.approx(sum(abs(a[s] - b[s]) for s in common) / len(common), rel=1e-12)


def test_mae_pct_is_relative_to_run_b_the_baseline(tmp_path):
    a = {1: 1.0, 2: 1.0}
    b = {1: 2.0, 2: 2.0}  # mean|a-b| = 1; relative to B: 50%, relative to A it would be 100%
    ab = cr.compare_runs(write_run(tmp_path, "a", rl_rows(a)), write_run(tmp_path, "b", rl_rows(b)))
    ba = cr.compare_runs(write_run(tmp_path, "b", rl_rows(b)), write_run(tmp_path, "a", rl_rows(a)))
    assert ab.mae_pct == pytest.approx(50.0)
    assert ba.mae_pct == pytest.approx(100.0)


def test_throughput_ratio_uses_each_runs_first_n_logged_steps(tmp_path):
    a_rows = [{"step": s, cr.REWARD_KEY: 0.5, cr.THROUGHPUT_KEY: 10.0 * s} for s in range(1, 9)]
    # B starts logging throughput at step 3 and misses step 5.
    b_rows = [{"step": s, cr.REWARD_KEY: 0.5} for s in (1, 2)]
    b_rows += [{"step": s, cr.REWARD_KEY: 0.5, cr.THROUGHPUT_KEY: 100.0 + s} for s in (3, 4, 6, 7, 8)]
    report = cr.compare_runs(write_run(tmp_path, "a", a_rows), write_run(tmp_path, "b", b_rows))
    mean_a = (10 + 20 + 30 + 40) / 4
    mean_b = (103 + 104 + 106 + 107) / 4
    assert report.throughput_steps_a == (1, 2, 3, 4)
    assert report.throughput_steps_b == (3, 4, 6, 7)
    assert report.throughput_ratio == pytest.approx(mean_a / mean_b)

    two = cr.compare_runs(write_run(tmp_path, "a", a_rows), write_run(tmp_path, "b", b_rows), first_n_throughput=2)
    assert two.throughput_ratio == pytest.approx(((10 + 20) / 2) / ((103 + 104) / 2))
    off = cr.compare_runs(write_run(tmp_path, "a", a_rows), write_run(tmp_path, "b", b_rows), first_n_throughput=0)
    assert off.throughput_ratio is None and off.throughput_steps_a == ()


def test_short_run_averages_the_steps_it_has(tmp_path):
    a = write_run(tmp_path, "a", rl_rows({1: 0.5, 2: 0.5}, throughput=100.0))
    b = write_run(tmp_path, "b", rl_rows({1: 0.5, 2: 0.5, 3: 0.5, 4: 0.5, 5: 0.5}, throughput=200.0))
    report = cr.compare_runs(a, b)
    assert report.throughput_steps_a == (1, 2)
    assert report.throughput_ratio == pytest.approx(((101 + 102) / 2) / ((201 + 202 + 203 + 204) / 4))


def test_lines_of_one_step_merge_and_later_values_win(tmp_path):
    a = write_run(tmp_path, "a", [
        {"step": 1, cr.REWARD_KEY: 0.0, cr.THROUGHPUT_KEY: 5.0},
        {"step": 1, "val-core/openai/gsm8k/reward/mean@1": 0.3},
        {"step": 2, cr.REWARD_KEY: 0.4, cr.THROUGHPUT_KEY: 5.0},
        "",
        {"step": 1, cr.REWARD_KEY: 0.2},  # a resumed run re-logs step 1
    ])
    metrics = cr.load_metrics(a)
    assert metrics[1] == {cr.REWARD_KEY: 0.2, cr.THROUGHPUT_KEY: 5.0, "val-core/openai/gsm8k/reward/mean@1": 0.3}
    b = write_run(tmp_path, "b", rl_rows({1: 0.2, 2: 0.4}))
    assert cr.compare_runs(a, b).mae == 0.0


def test_accepts_run_dir_or_jsonl_path_with_any_name(tmp_path):
    b = write_run(tmp_path, "b", rl_rows({1: 1.0, 2: 2.0}))
    custom = tmp_path / "npu_run.jsonl"
    custom.write_text((b / "metrics.jsonl").read_text())
    by_dir = cr.compare_runs(b, b)
    by_file = cr.compare_runs(custom, b / "metrics.jsonl")
    assert by_dir.mae_pct == by_file.mae_pct == 0.0
    assert by_file.run_a == str(custom)


def test_sft_mode_compares_train_loss_against_two_percent(tmp_path):
    b_loss = {s: 2.0 - 0.05 * s for s in range(1, 11)}
    a_loss = {s: v * 1.03 for s, v in b_loss.items()}  # 3% off: outside SFT's 2%, inside RL's 4%
    rows = lambda loss: [{"step": s, "train/loss": v, cr.THROUGHPUT_KEY: 50.0} for s, v in loss.items()]
    a, b = write_run(tmp_path, "a", rows(a_loss)), write_run(tmp_path, "b", rows(b_loss))
    report = cr.compare_runs(a, b, mode="sft")
    assert report.metric_key == "train/loss"
    assert report.target_pct == 2.0
    assert report.mae_pct == pytest.approx(3.0)
    assert not report.within_target and report.exit_code == 1
    assert cr.compare_runs(a, b, mode="sft", target_pct=4.0).within_target
    with pytest.raises(ValueError, match="'critic/score/mean' is never logged"):
        cr.compare_runs(a, b, mode="rl")


def test_custom_reward_key(tmp_path):
    key = "val-core/openai/gsm8k/reward/mean@1"
    a = write_run(tmp_path, "a", [{"step": s, key: 0.5, cr.THROUGHPUT_KEY: 1.0} for s in (5, 10)])
    b = write_run(tmp_path, "b", [{"step": s, key: 0.4, cr.THROUGHPUT_KEY: 1.0} for s in (5, 10)])
    report = cr.compare_runs(a, b, reward_key=key)
    assert report.metric_key == key
    assert report.mae_pct == pytest.approx(25.0)


def test_zero_baseline(tmp_path):
    zeros = write_run(tmp_path, "z", rl_rows({1: 0.0, 2: 0.0}))
    same = cr.compare_runs(zeros, zeros)
    assert same.mae_pct == 0.0 and not same.within_target and same.verdict == "INCONCLUSIVE"
    other = cr.compare_runs(write_run(tmp_path, "a", rl_rows({1: 0.1, 2: 0.0})), zeros)
    assert math.isinf(other.mae_pct) and not other.within_target
    assert other.summary()["mae_pct"] is None  # JSON-safe


# --------------------------------------------------------------------------------------------
# No signal: INCONCLUSIVE, never PASS
# --------------------------------------------------------------------------------------------
def test_all_zero_rewards_are_inconclusive_not_pass(tmp_path, capsys):
    zeros = {s: 0.0 for s in range(1, 21)}
    a, b = write_run(tmp_path, "a", rl_rows(zeros)), write_run(tmp_path, "b", rl_rows(zeros))
    report = cr.compare_runs(a, b)
    assert report.mae_pct == 0.0
    assert report.verdict == "INCONCLUSIVE" and not report.within_target
    assert report.exit_code == cr.EXIT_INCONCLUSIVE == 3
    assert "run A and run B is flat" in report.inconclusive_reason
    summary = report.summary()
    assert summary["verdict"] == "INCONCLUSIVE" and summary["within_target"] is False
    assert summary["std_a"] == summary["std_b"] == 0.0
    assert cr.main([str(a), str(b), "--no-plot"]) == 3
    out = capsys.readouterr().out
    assert "INCONCLUSIVE" in out and "PASS" not in out
    assert "verdict: inconclusive, no signal: 'critic/score/mean' of run A and run B is flat" in out


@pytest.mark.parametrize(
    "a, b, reason",
    [
        # 4 common steps of moving curves: too few (5 needed), though their MAE would pass.
        ({s: 0.1 * s for s in range(1, 5)}, {s: 0.1 * s for s in range(1, 5)}, "only 4 common steps"),
        ({s: 0.1 * s for s in range(1, 9)}, {s: 0.1 * s for s in range(5, 12)}, "only 4 common steps"),
        # one flat run: std 0 (B) or 5e-7 (A, below 1e-6) over the common steps.
        ({s: 0.1 * s for s in range(1, 9)}, {s: 0.5 for s in range(1, 9)}, "of run B is flat"),
        ({s: 0.5 + (1e-6 if s % 2 else 0.0) for s in range(1, 9)}, {s: 0.1 * s for s in range(1, 9)},
         "of run A is flat"),
    ],
)
def test_too_few_steps_or_a_flat_run_is_inconclusive(tmp_path, a, b, reason):
    report = cr.compare_runs(write_run(tmp_path, "a", rl_rows(a)), write_run(tmp_path, "b", rl_rows(b)))
    assert report.verdict == "INCONCLUSIVE" and report.exit_code == 3
    assert reason in report.inconclusive_reason


def test_signal_at_the_thresholds_gives_a_verdict(tmp_path):
    # Exactly 5 common steps; run A's std just above 1e-6 (1.22e-6): a real PASS / FAIL.
    b = {s: 1.0 + 0.1 * s for s in range(1, 6)}
    a = {1: 1.0, 2: 1.0, 3: 1.0 + 2.5e-6, 4: 1.0 + 2.5e-6, 5: 1.0 + 2.5e-6}
    report = cr.compare_runs(write_run(tmp_path, "a", rl_rows(b)), write_run(tmp_path, "b", rl_rows(b)))
    assert report.verdict == "PASS" and report.exit_code == 0 and report.inconclusive_reason is None
    near_flat = cr.compare_runs(write_run(tmp_path, "n", rl_rows(a)), write_run(tmp_path, "b", rl_rows(b)))
    assert near_flat.std_a >= cr.MIN_STD and near_flat.verdict == "FAIL" and near_flat.exit_code == 1


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cr.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "3 INCONCLUSIVE" in out and "fewer than 5 common steps" in out and "0 PASS" in out
    assert "3 INCONCLUSIVE" in cr.__doc__


def test_mae_percent_direct():
    assert cr.mae_percent([1.0, 3.0], [2.0, 2.0]) == (1.0, 50.0)
    with pytest.raises(ValueError, match="equal, non-empty"):
        cr.mae_percent([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="equal, non-empty"):
        cr.mae_percent([], [])


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------
def test_no_common_steps_is_a_clear_error(tmp_path):
    a = write_run(tmp_path, "a", rl_rows({1: 0.1, 2: 0.2, 3: 0.3}))
    b = write_run(tmp_path, "b", rl_rows({7: 0.1, 8: 0.2}))
    with pytest.raises(ValueError, match=r"no common steps with 'critic/score/mean'.*1\.\.3.*7\.\.8"):
        cr.compare_runs(a, b)


def test_missing_metrics_are_clear_errors(tmp_path):
    a = write_run(tmp_path, "a", rl_rows({1: 0.1, 2: 0.2}))
    no_reward = write_run(tmp_path, "nr", [{"step": 1, cr.THROUGHPUT_KEY: 3.0, "actor/pg_loss": 0.1}])
    with pytest.raises(ValueError, match=r"run B .*nr.*'critic/score/mean' is never logged.*actor/pg_loss"):
        cr.compare_runs(a, no_reward)
    no_tp = write_run(tmp_path, "nt", [{"step": 1, cr.REWARD_KEY: 0.1}])
    with pytest.raises(ValueError, match=r"run A .*nt.*'perf/throughput' is never logged"):
        cr.compare_runs(no_tp, a)
    assert cr.compare_runs(no_tp, a, first_n_throughput=0).throughput_ratio is None


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"metrics.jsonl:2: not valid JSON"),
        ("[1, 2]", r"metrics.jsonl:2: expected a JSON object, got list"),
        ('{"critic/score/mean": 0.1}', r"metrics.jsonl:2: expected an integer 'step', got None"),
        ('{"step": 2.0, "critic/score/mean": 0.1}', r"metrics.jsonl:2: expected an integer 'step', got 2.0"),
        ('{"step": true, "critic/score/mean": 0.1}', r"metrics.jsonl:2: expected an integer 'step', got True"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, line, message):
    ok = json.dumps({"step": 1, cr.REWARD_KEY: 0.1, cr.THROUGHPUT_KEY: 1.0})
    run = write_run(tmp_path, "a", [ok, line])
    with pytest.raises(ValueError, match=message):
        cr.load_metrics(run)


@pytest.mark.parametrize("value", ["0.5", None, True, float("nan"), float("inf")])
def test_non_numeric_metric_values_name_the_step(tmp_path, value):
    run = write_run(tmp_path, "a", [{"step": 1, cr.REWARD_KEY: 0.1}, {"step": 2, cr.REWARD_KEY: value}])
    with pytest.raises(ValueError, match=r"step 2: 'critic/score/mean' must be a finite number"):
        cr.metric_curve(cr.load_metrics(run), cr.REWARD_KEY, label="run A")


def test_missing_paths_and_empty_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a run directory nor"):
        cr.load_metrics(tmp_path / "nope")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
        cr.load_metrics(tmp_path / "empty_dir")
    with pytest.raises(ValueError, match="no metric rows"):
        cr.load_metrics(write_run(tmp_path, "blank", ["", "  "]))


def test_bad_arguments(tmp_path):
    run = write_run(tmp_path, "a", rl_rows({1: 0.5}))
    with pytest.raises(ValueError, match="mode='ppo' is not one of rl, sft"):
        cr.compare_runs(run, run, mode="ppo")
    with pytest.raises(ValueError, match="first_n_throughput must be >= 0"):
        cr.compare_runs(run, run, first_n_throughput=-1)
    zero_tp = write_run(tmp_path, "z", rl_rows({1: 0.5}, throughput=-1.0))
    with pytest.raises(ValueError, match="expected > 0"):
        cr.compare_runs(run, zero_tp)


# --------------------------------------------------------------------------------------------
# Command line: outputs and exit codes
# --------------------------------------------------------------------------------------------
@needs_matplotlib
def test_main_within_target_writes_json_and_plot(tmp_path, capsys):
    a = write_run(tmp_path, "npu", rl_rows({s: 0.5 + 0.01 * s for s in range(1, 9)}, throughput=600.0))
    b = write_run(tmp_path, "gpu", rl_rows({s: 0.5 + 0.0101 * s for s in range(1, 9)}, throughput=1000.0))
    summary, plot = tmp_path / "out" / "parity.json", tmp_path / "out" / "parity.png"
    summary.parent.mkdir()
    assert cr.main([str(a), str(b), "--json", str(summary), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "reward MAE %" in out and "PASS" in out and "throughput ratio A/B" in out
    assert "MAE % = 100 * mean|A-B| / mean|B|" in out
    data = json.loads(summary.read_text())
    assert data["within_target"] is True and data["num_common_steps"] == 8
    assert data["throughput_ratio"] == pytest.approx((600 + 2.5) / (1000 + 2.5))
    assert plot.read_bytes()[:8] == PNG_MAGIC and plot.stat().st_size > 5000
    assert sorted(p.name for p in summary.parent.iterdir()) == ["parity.json", "parity.png"]  # no temp files left


@needs_matplotlib
def test_main_outside_target_exits_1_and_default_plot_goes_to_cwd(tmp_path, monkeypatch, capsys):
    a = write_run(tmp_path, "a", rl_rows({s: 0.5 + 0.1 * s for s in range(1, 6)}))
    b = write_run(tmp_path, "b", rl_rows({s: 0.4 + 0.1 * s for s in range(1, 6)}))
    monkeypatch.chdir(tmp_path)
    assert cr.main([str(a), str(b)]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert (tmp_path / cr.DEFAULT_PLOT).read_bytes()[:8] == PNG_MAGIC


def test_main_bad_input_exits_2(tmp_path, capsys):
    a = write_run(tmp_path, "a", rl_rows({1: 0.5}))
    b = write_run(tmp_path, "b", rl_rows({2: 0.5}))
    assert cr.main([str(a), str(b), "--no-plot"]) == 2
    assert "compare_runs: error: no common steps" in capsys.readouterr().err
    assert cr.main([str(a), str(tmp_path / "missing"), "--no-plot"]) == 2
    assert cr.main([str(a), str(a), "--json", str(tmp_path / "no_such_dir" / "x.json"), "--no-plot"]) == 2


def test_missing_matplotlib_skips_default_plot_but_fails_explicit_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.chdir(tmp_path)
    a = write_run(tmp_path, "a", rl_rows({s: 0.1 * s for s in range(1, 6)}))
    assert cr.main([str(a), str(a)]) == 0
    assert "plot: skipped, matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / cr.DEFAULT_PLOT).exists()
    assert cr.main([str(a), str(a), "--plot", str(tmp_path / "p.png")]) == 2
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_module_entry_point_exit_code(tmp_path):
    a = write_run(tmp_path, "a", rl_rows({s: 1.0 * s for s in range(1, 6)}))
    b = write_run(tmp_path, "b", rl_rows({s: 2.0 * s for s in range(1, 6)}))
    env = {**os.environ, "PYTHONPATH": str(Path(grpo_npu.__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_npu.tools.compare_runs", str(a), str(b), "--no-plot"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "reward MAE %" in proc.stdout and "50.00%" in proc.stdout
