"""``python -m bench --quick``: every benchmark runs on CPU and reports in the agreed shape (not speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import run_all as runner
from bench import step_vs_trl as svt

pytestmark = pytest.mark.slow  # every benchmark at quick sizes, one process each: about 7 minutes on 2 idle cores


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_results")
    committed = runner.REPO_ROOT / "bench" / "results"
    before = {p: p.read_bytes() for p in committed.iterdir() if p.is_file()}
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out-dir", str(out)], cwd=runner.REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(runner.REPO_ROOT)}, capture_output=True, text=True)
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    changed = sorted(p.name for p, data in before.items() if p.read_bytes() != data)
    assert not changed, f"a --quick run rewrote committed results: {changed}"  # a quick plot once replaced scaling.png
    return proc, results


def test_every_benchmark_runs_and_the_suite_exits_zero(suite):
    proc, results = suite
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(results) == {*runner.BENCHMARKS, "summary"}
    assert "== summary ==" in proc.stdout


@pytest.mark.parametrize("name", runner.BENCHMARKS)
def test_benchmark_result_shape(suite, name):
    result = suite[1][name]
    assert result["name"] == name
    assert result["rows"] and all(isinstance(row, dict) and row for row in result["rows"])
    assert result["notes"], "every benchmark says how it measured"
    for target in result["targets"].values():
        assert set(target) == {"measured", "target", "passed"}
        assert isinstance(target["measured"], float) and target["target"].startswith((">= ", "<= "))


def test_summary_lists_every_target_of_every_benchmark(suite):
    results = suite[1]
    summary_rows = {(r["benchmark"], r["target"]): r for r in results["summary"]["rows"]}
    for name in runner.BENCHMARKS:
        for target, t in results[name]["targets"].items():
            row = summary_rows[(name, target)]
            assert row["measured"] == t["measured"] and row["want"] == t["target"]
            assert row["verdict"] == ("PASS" if t["passed"] else "MISS")
    assert not any(r["verdict"] == "CRASH" for r in summary_rows.values())


def test_step_vs_trl_sides_did_identical_work(suite):
    result = suite[1]["step_vs_trl"]
    rows = {row["side"]: row for row in result["rows"]}
    expected = {svt.LABELS[s] for s in svt.SIDES if svt.missing_dependency(s, os.environ.get(svt.TRL_PATH_ENV)) is None}
    assert set(rows) == expected
    work = svt.QUICK
    for row in rows.values():
        assert row["workload"] == work.name
        assert row["response_tokens_per_step"] == work.prompts * work.n * work.response_len  # EOS ignored everywhere
        assert row["threads"] == work.threads
        assert row["steps_per_s"] == pytest.approx(1.0 / row["step_s"])
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        assert len(row["step_s_all"].split("/")) == work.timed_steps
        assert 0 < row["gen_s"] < row["step_s"] and 0 < row["update_s"] < row["step_s"]
    assert len({row["tokens_per_step"] for row in rows.values()}) == 1, "same prompts and lengths on every side"
    assert not any("WORKLOAD MISMATCH" in n for n in result["notes"]), result["notes"]
    assert result["meta"]["quick"] is True
    trl = rows.get(svt.LABELS["trl"])
    if trl is None:
        assert not result["targets"] and any("trl" in n and "not run" in n for n in result["notes"])
        return
    for side in svt.TARGET_SPEEDUP:
        if svt.LABELS[side] in rows:
            ratio = rows[svt.LABELS[side]]["steps_per_s"] / trl["steps_per_s"]
            assert result["targets"][svt.target_name(work, side)]["measured"] == pytest.approx(ratio)
    assert any("load average" in n for n in result["notes"])


def test_phase_limits_reports_every_floored_phase_of_the_cli_run(suite):
    result = suite[1]["phase_limits"]
    rows = {row["phase"]: row for row in result["rows"]}
    floored = {name for name, row in rows.items() if "time_over_floor" in row}
    assert {"gen", "sync", "update_actor", "ref"} <= floored  # KL loss on: a reference pass; vLLM: a weight sync
    assert {f"{p}_time_over_floor" for p in floored} | {"decode_fraction_of_bandwidth_floor", "weight_sync_over_copy_plus_prepack"} \
        == set(result["targets"])
    for phase in floored:
        row = rows[phase]
        assert row["time_over_floor"] == pytest.approx(1 / row["limit_frac"])
        assert row["seconds"] == pytest.approx(row["floor_s"] * row["time_over_floor"])
        assert result["targets"][f"{phase}_time_over_floor"]["measured"] == pytest.approx(row["time_over_floor"])
    sync = rows["sync vs copy_"]
    assert sync["seconds"] == pytest.approx(rows["sync"]["seconds"], rel=1e-6)  # the run's own weight_sync_s
    target = result["targets"]["weight_sync_over_copy_plus_prepack"]["measured"]
    assert target == pytest.approx(sync["seconds"] / (sync["copy_s"] + sync["prepack_s"]))
    assert sync["sync_over_copy"] == pytest.approx(sync["seconds"] / sync["copy_s"])  # copy_ alone: in the row
    assert rows["sync"]["floor_s"] == pytest.approx(rows["sync"]["bandwidth_floor_s"] + sync["prepack_s"])
    assert 0 < sync["prepack_s"] < sync["isolated_sync_s"] and sync["sync_path"] == "direct"
    assert any("load average" in n for n in result["notes"]) and any("prepack" in n for n in result["notes"])
