"""bench.scaling's exponent fit and point keys, bench.scaling_activations' points, bench.cli_run's step reading,
bench.report's README block."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import cli_run, report, scaling, scaling_activations


@pytest.mark.parametrize("k", [1.0, 2.0, 0.5])
def test_memory_exponent_fit_recovers_the_power(k):
    xs = [64, 128, 256, 512, 1024]
    assert scaling.fit_exponent(xs, [1.5 + (x / 1024) ** k for x in xs]) == pytest.approx(k, abs=0.02)


def test_flat_memory_has_exponent_zero():
    assert scaling.fit_exponent([64, 256, 1024], [1.118, 1.1183, 1.1185]) == 0.0


def test_scaling_points_are_valid_command_lines(tmp_path, tiny_model_path):
    from grpo_npu.config import derive, load_config

    keys = scaling.point_keys(tiny_model_path, "train.parquet", 256, 32, "hf", packed=True)
    cfg = load_config(keys + [f"data.train_files={tmp_path}", f"trainer.default_local_dir={tmp_path}"])
    d = derive(cfg, world_size=1)
    assert d.train_batch_responses == d.micro_batch_per_rank == 32 and d.response_length == 256
    assert cfg.actor_rollout_ref.model.use_remove_padding and cfg.actor_rollout_ref.rollout.ignore_eos


def test_activation_sweeps_cover_length_and_batch():
    plan = {sweep: (path, points) for sweep, _, path, points in scaling_activations.sweeps()}
    for path in scaling_activations.PATHS:
        assert plan[f"length, {path}"] == (path, [(t, 8) for t in (64, 128, 256, 512, 1024)])
    for path in scaling_activations.TARGETS:  # the paths the workers run: 8 -> 128 sequences at T = 64
        assert plan[f"batch, {path}"] == (path, [(64, b) for b in (8, 16, 32, 64, 128)])
    assert len(plan) == len(scaling_activations.PATHS) + len(scaling_activations.TARGETS)


def test_rederive_declares_step_time_targets_only(tmp_path):
    """CPU peak RSS has a start-up floor: the CLI sweep's memory exponent is a note, its step-time exponent a target."""
    rows = [{"sweep": sweep, "x_name": "x", "x": x, "step_s": s, "peak_memory_gb": m}
            for sweep, pts in (("length", ((64, 1.0, 1.118), (1024, 16.0, 1.118))),
                               ("batch", ((8, 1.0, 1.118), (32, 1.5, 1.118), (128, 64.0, 1.398))))
            for x, s, m in pts]
    stored = {"name": "scaling", "rows": rows, "notes": ["length: stale", "run by hand under load"],
              "meta": {"quick": False},
              "targets": {"memory_exponent_batch": {"measured": 3.0, "target": "<= 1.5", "passed": False}}}
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps(stored))
    scaling.main(["--rederive", str(path)])
    out = json.loads(path.read_text())
    assert out["rows"] == rows and out["meta"] == stored["meta"]
    assert (tmp_path / "scaling.png").is_file() or "matplotlib" in " ".join(out["notes"])  # redrawn beside it
    assert set(out["targets"]) == {"step_time_exponent_length", "step_time_exponent_batch"}
    assert out["targets"]["step_time_exponent_length"]["measured"] == pytest.approx(1.0)  # 16x time over 16x length
    assert out["targets"]["step_time_exponent_batch"] == {"measured": pytest.approx(1.5), "target": "<= 1.5",
                                                          "passed": True}
    assert out["notes"][-1] == "run by hand under load" and "length: stale" not in out["notes"]
    assert any(n.startswith("batch: peak memory 1.118 -> 1.398 GB") and "not a target" in n for n in out["notes"])


def test_accelerator_sweeps_cover_the_full_range_and_target_memory(tmp_path, tiny_model_path):
    """On a lent accelerator both models run 64 -> 1024 tokens and 8 -> 128 sequences on that device, and the
    allocator's peak has no process floor: there the memory exponent is a target beside the step time's."""
    keys = scaling.point_keys(tiny_model_path, "train.parquet", 1024, 8, "hf", packed=False, device="cuda")
    assert "trainer.device=cuda" in keys and "trainer.device=cpu" not in keys
    assert scaling.ACCEL_POINTS == ((64, 256, 1024), (8, 32, 128))
    rows = [{"sweep": "length", "x_name": "x", "x": x, "step_s": s, "peak_memory_gb": m}
            for x, s, m in ((64, 1.0, 2.0), (256, 2.0, 5.0), (1024, 6.0, 17.0))]
    path = tmp_path / "scaling_0.5b_cuda.json"
    path.write_text(json.dumps({"name": "scaling_0.5b_cuda", "rows": rows, "notes": [], "targets": {},
                                "meta": {"device": "cuda"}}))
    scaling.main(["--rederive", str(path)])
    targets = json.loads(path.read_text())["targets"]
    assert set(targets) == {"step_time_exponent_length", "memory_exponent_length"}
    assert targets["memory_exponent_length"]["measured"] == pytest.approx(1.0, abs=0.02)  # 1 + x/64 GB: linear
    floor = [dict(r, peak_memory_gb=m) for r, m in zip(rows, (8.954, 8.954, 9.13))]  # optimizer floor, then a jump
    path.write_text(json.dumps({"name": "scaling_0.5b_cuda", "rows": floor, "notes": [], "targets": {},
                                "meta": {"device": "cuda"}}))
    scaling.main(["--rederive", str(path)])
    out = json.loads(path.read_text())
    assert set(out["targets"]) == {"step_time_exponent_length"}
    assert any("sits on a floor" in n for n in out["notes"])


def test_a_point_both_sweeps_pass_through_runs_once(monkeypatch, tmp_path):
    """The length sweep (at SWEEP_BATCH sequences) and the batch sweep (at SWEEP_LENGTH tokens) meet at one
    point: one CLI run serves both rows, each with its own sweep and x."""
    runs = []

    def fake_point(keys, root, sweep, x_name, length, seqs, threads):
        runs.append((length, seqs))
        return {"sweep": sweep, "x_name": x_name, "x": length if sweep != "batch" else seqs, "response_len": length,
                "sequences": seqs, "step_s": length * seqs / 512, "peak_memory_gb": 1.0}

    monkeypatch.setattr(scaling, "measure_point", fake_point)
    result = scaling.run(quick=True, png=tmp_path / "scaling.png")
    shared = (scaling.SWEEP_LENGTH, scaling.SWEEP_BATCH)
    assert sorted(runs) == sorted({(t, scaling.SWEEP_BATCH) for t in scaling.QUICK_POINTS[0]}
                                  | {(scaling.SWEEP_LENGTH, b) for b in scaling.QUICK_POINTS[1]})
    assert runs.count(shared) == 1 and len(result.rows) == len(runs) + 1
    both = [r for r in result.rows if (r["response_len"], r["sequences"]) == shared]
    assert [(r["sweep"], r["x"]) for r in both] == [("length", scaling.SWEEP_LENGTH), ("batch", scaling.SWEEP_BATCH)]


def test_measured_steps_drop_the_warm_up_step():
    rows = [{"timing_s/step": s, "timing_s/gen": 0.5 * s, "timing_s/update_actor": 0.25 * s, "timing_s/ref": 0.1,
             "perf/total_num_tokens": 100.0, "response_length/mean": 8.0, "perf/max_memory_allocated_gb": m}
            for s, m in ((9.0, 1.0), (2.0, 1.5), (4.0, 1.2))]
    out = cli_run.measured_steps({"rows": rows, "cpu_s": [8.0, 3.0, None], "process_s": 20.0}, samples=4)
    assert out["step_s"] == [2.0, 4.0] and out["cpu_s"] == [3.0, None] and out["peak_memory_gb"] == 1.5
    assert out["sections"][0] == {"gen": 1.0, "score": 0.1, "update": 0.5, "other": pytest.approx(0.4)}
    assert out["response_tokens"] == [32.0, 32.0]
    with pytest.raises(RuntimeError, match="no timed step"):
        cli_run.measured_steps({"rows": rows[:1], "cpu_s": [1.0], "process_s": 1.0}, samples=4)


def test_watch_records_cpu_when_each_metrics_line_appears(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    script = ("import time, sys\nf = open(sys.argv[1], 'a')\nfor i in range(2):\n"
              "    t = time.process_time()\n    while time.process_time() - t < 0.3: pass\n"
              "    f.write('{}\\n'); f.flush()\n    time.sleep(0.3)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(metrics)])
    seen = cli_run._watch(proc, metrics, timeout_s=60)
    assert set(seen) == {0, 1, 2}
    assert 0.25 < seen[2] - seen[1] < 1.0  # the second line's busy loop, not its sleep


def _result(name, quick=False, measured=2.0):
    return {"name": name, "rows": [{}], "notes": [], "meta": {"quick": quick, "measured_at": "2026-11-26"},
            "targets": {"x_vs_y": {"measured": measured, "target": ">= 1.5", "passed": measured >= 1.5}}}


def test_report_rewrites_and_checks_the_readme_block(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(json.dumps(_result("a")))
    (results / "b.json").write_text(json.dumps(_result("b", measured=1.0)))
    (results / "q.json").write_text(json.dumps(_result("q", quick=True)))  # quick sizes never reach the README
    (results / "summary.json").write_text(json.dumps(_result("summary")))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.START}\nold\n{report.END}\nrest\n")
    args = ["--results", str(results), "--readme-path", str(readme)]
    assert report.main(args + ["--check"]) == 1
    assert report.main(args + ["--readme"]) == 0
    assert report.main(args + ["--check"]) == 0
    text = readme.read_text()
    assert "| `bench.a` | x_vs_y | 2 | >= 1.5 | yes |" in text and "| `bench.b` | x_vs_y | 1 | >= 1.5 | **no** |" in text
    assert "bench.q" not in text and "bench.summary" not in text
    assert text.startswith("intro\n") and text.endswith("rest\n")


def test_the_readme_table_is_up_to_date():
    assert report.main(["--check"]) == 0, "run python -m bench.report --readme"


def test_activation_points_build_the_attention_the_workers_use(tiny_model_path):
    """bench.scaling_activations points, several in one process as --quick runs them: the model as build_sharded
    makes it for each path, and a measured peak."""
    attention = {"packed": "grpo_npu", "packed, sdpa mask (before)": "sdpa", "padded": "sdpa"}
    assert set(attention) == set(scaling_activations.PATHS) and set(scaling_activations.TARGETS) <= set(attention)
    specs = [{"length": 16, "path": path, "model": tiny_model_path, "batch": 2} for path in attention]
    out = subprocess.run([sys.executable, "-m", "bench.scaling_activations", "--point", json.dumps(specs)],
                         capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1",  # the benchmark's own measuring environment
                              "MALLOC_MMAP_THRESHOLD_": str(scaling_activations.MMAP_THRESHOLD)})
    points = [json.loads(line) for line in out.stdout.strip().splitlines()[-len(specs):]]
    assert [p["attn_implementation"] for p in points] == list(attention.values())
    assert all(p["peak_extra_mb"] > 0 and p["seconds"] > 0 for p in points), points


@pytest.mark.parametrize("module", ["bench.scaling", "bench.step_vs_trl"])
def test_help_lists_the_benchmarks_own_options_with_quick_and_json(module, capsys):
    """Their own options are parsed first; --help used to show only --quick and --json (or print twice)."""
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.count("usage:") == 1
    own = ["--model", "--packed", "--device", "--rederive"] if module == "bench.scaling" else ["--workloads", "--trl-path"]
    assert all(flag in out for flag in own + ["--quick", "--json"]), out
