"""bench.run_all on a throwaway package of benchmarks: summary rows, crash detection, exit status."""

from __future__ import annotations

import json
import textwrap

import pytest

from bench import run_all as runner

GOOD = '''
from bench.common import BenchResult, bench_main


def run(quick: bool = False) -> BenchResult:
    """A benchmark that meets one target and misses another."""
    result = BenchResult(name="good", rows=[{"case": "x", "seconds": 0.5 if quick else 5.0}])
    result.add_target("fast_enough", 3.0, 2.0)
    result.add_target("small_enough", 0.9, 0.5, higher_is_better=False)
    return result


if __name__ == "__main__":
    bench_main(run)
'''
NO_TARGETS = """
from bench.common import BenchResult, bench_main

if __name__ == "__main__":
    bench_main(lambda quick=False: BenchResult(name="no_targets", rows=[{"case": "y"}]))
"""
CRASHES = 'raise RuntimeError("boom")\n'
SILENT = "print('ran, but wrote no JSON')\n"  # exit 0 without a result must not pass for success


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package ``fakebench`` with good / no_targets / crashes / silent modules, importable by subprocesses."""
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, source in {"good": GOOD, "no_targets": NO_TARGETS, "crashes": CRASHES, "silent": SILENT}.items():
        (pkg / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "fakebench"


def test_summary_has_one_row_per_target_and_a_crash_row(fake_package, tmp_path):
    out = tmp_path / "results"
    summary, crashed = runner.run_all(["good", "crashes", "silent", "no_targets"], quick=True, out_dir=out,
                                      package=fake_package)
    assert crashed == ["crashes", "silent"]
    rows = [(r["benchmark"], r["target"], r["verdict"]) for r in summary.rows]
    assert rows == [
        ("good", "fast_enough", "PASS"),
        ("good", "small_enough", "MISS"),
        ("crashes", "-", "CRASH"),
        ("silent", "-", "CRASH"),
        ("no_targets", "(none measured)", "-"),
    ]
    assert summary.rows[0]["measured"] == 3.0 and summary.rows[0]["want"] == ">= 2.0"
    assert any("1 of 2 targets met" in n for n in summary.notes)
    assert any("load average" in n for n in summary.notes)
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["name"] == "summary" and on_disk["rows"] == json.loads(json.dumps(summary.rows))
    good = json.loads((out / "good.json").read_text())  # each benchmark's own JSON sits beside the summary
    assert good["rows"] == [{"case": "x", "seconds": 0.5}]  # --quick reached the benchmark


def test_stale_result_file_is_not_taken_for_this_run(fake_package, tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "silent.json").write_text(json.dumps({"name": "silent", "rows": [], "targets": {}, "notes": []}))
    _, crashed = runner.run_all(["silent"], quick=True, out_dir=out, package=fake_package)
    assert crashed == ["silent"]


def test_main_exit_status_zero_on_missed_targets_nonzero_on_crash(fake_package, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "PACKAGE", fake_package)
    monkeypatch.setattr(runner, "BENCHMARKS", ("good", "crashes"))
    out = tmp_path / "results"
    assert runner.main(["--quick", "--only", "good", "--out-dir", str(out)]) == 0  # a MISS is a report, not a failure
    assert "MISS" in capsys.readouterr().out
    assert runner.main(["--quick", "--out-dir", str(out)]) == 1
    assert "crashed: crashes" in capsys.readouterr().err


def test_only_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        runner.main(["--only", "no_such_benchmark"])
    assert "invalid choice" in capsys.readouterr().err


def test_known_benchmarks_are_modules_with_run_and_main():
    import importlib.util

    for name in runner.BENCHMARKS:
        spec = importlib.util.find_spec(f"bench.{name}")
        assert spec is not None, f"bench/{name}.py is missing"
        source = open(spec.origin).read()
        assert "def run(quick: bool = False" in source and "def main(" in source, name
