"""Tracker sinks, resume truncation, console line, PNG curves and the optional-backend wiring."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from grpo_npu.tracking import Tracker, plots, sinks
from grpo_npu.tracking.plots import plot_curves
from grpo_npu.tracking.sinks import (
    METRICS_FILE,
    MissingPackageError,
    format_console_line,
    mlflow_key,
    read_metrics,
    wandb_mode,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make(run_dir, loggers, **kwargs) -> Tracker:
    """A Tracker with test project/experiment names unless given."""
    kwargs.setdefault("project", "p")
    kwargs.setdefault("experiment", "e")
    return Tracker(run_dir, loggers, **kwargs)


def _step_metrics(step: int) -> dict[str, float]:
    return {
        "critic/score/mean": 0.1 * step,
        "response_length/mean": 20.0 + step,
        "response_length/max": 30.0 + step,
        "response_length/min": 10.0,
        "actor/kl_loss": 0.001 * step,
        "actor/entropy": 1.5 - 0.1 * step,
        "actor/grad_norm": 0.5,
        "perf/throughput": 1000.0 + step,
        "timing_s/step": 2.0,
    }


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_flushed_each_step(tmp_path):
    tracker = make(tmp_path, ("jsonl",), total_steps=3)
    tracker.log({"a": 1.0, "t": torch.tensor(2.5)}, step=1)
    # flushed: readable before close
    assert _lines(tmp_path / METRICS_FILE) == [{"step": 1, "a": 1.0, "t": 2.5}]
    tracker.log({"a": float("nan")}, step=2)
    tracker.close()
    rows = _lines(tmp_path / METRICS_FILE)
    assert rows[1]["step"] == 2 and math.isnan(rows[1]["a"])
    with pytest.raises(ValueError, match="'bad'"):
        make(tmp_path / "x", ("jsonl",)).log({"bad": torch.ones(3)}, step=1)


def test_truncate_after_on_resume(tmp_path):
    with make(tmp_path, ("jsonl",)) as tracker:
        for step in range(1, 6):
            tracker.log({"x": float(step)}, step=step)
        tracker.log({"val": 9.0}, step=5)
    # the resumed run (checkpoint at step 3) reopens the file and forgets steps 4 and 5
    with make(tmp_path, ("jsonl",)) as tracker:
        tracker.truncate_after(3)
        assert [r["step"] for r in _lines(tmp_path / METRICS_FILE)] == [1, 2, 3]
        tracker.log({"x": 40.0}, step=4)
    rows = [(r["step"], r.get("x")) for r in _lines(tmp_path / METRICS_FILE)]
    assert rows == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # atomic rewrite left no temp


def test_verls_file_logger_format_path_and_restarts(tmp_path, monkeypatch):
    """trainer.logger=file writes verl's FileLogger lines ({"step", "data"}) to $VERL_FILE_LOGGER_ROOT/<project>/
    <experiment>.jsonl (or $VERL_FILE_LOGGER_PATH); a fresh run starts it empty, a resumed one keeps its steps."""
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "logs"))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    path = tmp_path / "logs" / "proj" / "exp.jsonl"
    with make(tmp_path / "run", ("file",), project="proj", experiment="exp") as tracker:
        for step in (1, 2, 3):
            tracker.log({"x": float(step)}, step=step)
    assert _lines(path) == [{"step": s, "data": {"x": float(s)}} for s in (1, 2, 3)]
    assert _lines(tmp_path / "run" / METRICS_FILE)[0] == {"step": 1, "x": 1.0}  # metrics.jsonl as always
    with make(tmp_path / "run", ("file",), project="proj", experiment="exp") as tracker:  # resumed from step 2
        tracker.truncate_after(2)
        tracker.log({"x": 30.0}, step=3)
    assert [(r["step"], r["data"]["x"]) for r in _lines(path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    with make(tmp_path / "run2", ("file",), project="proj", experiment="exp") as tracker:  # a fresh run, same names
        tracker.log({"y": 1.0}, step=1)
    assert _lines(path) == [{"step": 1, "data": {"y": 1.0}}]
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "given.jsonl"))
    with make(tmp_path / "run3", ("file",)) as tracker:
        tracker.log({"z": 2.0}, step=1)
    assert _lines(tmp_path / "given.jsonl") == [{"step": 1, "data": {"z": 2.0}}]


def test_torn_last_line_is_dropped_on_reopen(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')  # killed mid-write
    with make(tmp_path, ("jsonl",)) as tracker:
        tracker.log({"x": 2.0}, step=2)
    assert _lines(path) == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}]


def test_read_metrics_merges_lines_and_skips_garbage(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 2, "a": 1}\nnot json\n{"step": 1, "a": 0}\n{"step": 2, "b": 5, "a": 3}\n{"no_step": 1}\n')
    assert read_metrics(tmp_path) == {1: {"a": 0}, 2: {"a": 3, "b": 5}}
    with pytest.raises(FileNotFoundError, match="metrics"):
        read_metrics(tmp_path / "missing")


def test_console_line_and_progress_bar(tmp_path, capsys):
    metrics = _step_metrics(2) | {"val-core/openai/gsm8k/reward/mean@1": 0.4567}
    line = format_console_line(metrics, 2, 10)
    assert line == ("step 2/10 | critic/score/mean 0.200 | actor/kl_loss 0.002 | actor/entropy 1.300 | response_length/mean 22.0 | "
                    "actor/grad_norm 0.5 | perf/throughput 1002 | timing_s/step 2.00 | "
                    "val-core/openai/gsm8k/reward/mean@1 0.457")
    assert format_console_line({"actor/pg_loss": 0.25}, 1, None) == "step 1 | actor/pg_loss 0.25"

    tracker = make(tmp_path, ("console",), total_steps=3, progress=True)
    for step in (1, 2, 3):
        tracker.log(_step_metrics(step), step=step)
    tracker.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [format_console_line(_step_metrics(s), s, 3) for s in (1, 2, 3)]
    assert "3/3" in err and "training" in err  # the bar went to stderr only
    assert "\r" not in out

    resumed = make(tmp_path, ("console",), total_steps=5, progress=True)
    resumed.truncate_after(3)  # resumed from checkpoint 3: the bar starts there
    resumed.log({"critic/score/mean": 1.0}, step=4)
    resumed.close()
    out, err = capsys.readouterr()
    assert out == "step 4/5 | critic/score/mean 1.000\n" and "3/5" in err and "4/5" in err


def test_progress_bar_off_when_not_a_terminal(tmp_path, capsys):
    with make(tmp_path, ("console",), total_steps=2) as tracker:  # progress=None: pytest's stderr is no tty
        tracker.log({"critic/score/mean": 1.0}, step=1)
    out, err = capsys.readouterr()
    assert out == "step 1/2 | critic/score/mean 1.000\n" and err == ""


def test_sinks_match_the_config_choices():
    from grpo_npu.config import LOGGERS

    assert tuple(sinks.SINKS) == LOGGERS


def test_unknown_logger_lists_known(tmp_path):
    with pytest.raises(ValueError, match="known loggers: console, jsonl, file, tensorboard, wandb, mlflow"):
        make(tmp_path, ("console", "swanlab"))


def test_curves_written_at_close_and_by_cli(tmp_path):
    with make(tmp_path, ("jsonl",)) as tracker:
        for step in range(1, 5):
            tracker.log(_step_metrics(step), step=step)
        tracker.log({"val-core/openai/gsm8k/reward/mean@1": 0.3}, step=4)
    expected = {"reward.png", "response_length.png", "kl.png", "entropy.png", "throughput.png"}
    assert {p.name for p in tmp_path.glob("*.png")} == expected
    for name in expected:
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
        (tmp_path / name).unlink()
    proc = subprocess.run([sys.executable, "-m", "grpo_npu.tracking", "plot", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {Path(p).name for p in proc.stdout.split()} == expected

def test_cli_missing_run(tmp_path, capsys):
    assert plots.main(["plot", str(tmp_path / "nope")]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "unplotted": 1.0}\n')
    assert plots.main(["plot", str(tmp_path)]) == 1


def test_curves_only_for_logged_metrics_and_from_memory_without_jsonl(tmp_path):
    with make(tmp_path, ("console",)) as tracker:
        tracker.log({"perf/throughput": 10.0}, step=1)
        tracker.log({"perf/throughput": 12.0}, step=2)
    assert [p.name for p in tmp_path.glob("*.png")] == ["throughput.png"]
    assert plot_curves(tmp_path / "other", history={1: {"x": 1.0}}) == []


def test_missing_matplotlib_warns_once_and_skips(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setattr(plots, "_warned_no_matplotlib", False)
    history = {1: _step_metrics(1)}
    with caplog.at_level("WARNING", logger="grpo_npu.tracking"):
        assert plot_curves(tmp_path, history=history) == []
        assert plot_curves(tmp_path, history=history) == []
    assert sum("matplotlib" in r.message for r in caplog.records) == 1
    assert not list(tmp_path.glob("*.png"))


# -- optional backends: wiring checked against recording fakes; real packages when installed ----
@pytest.mark.parametrize("name,module,package", [
    ("tensorboard", "torch.utils.tensorboard", "tensorboard"),
    ("wandb", "wandb", "wandb"),
    ("mlflow", "mlflow", "mlflow"),
])
def test_missing_backend_is_a_clear_error(tmp_path, monkeypatch, name, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    with pytest.raises(MissingPackageError, match=f"pip install {package}"):
        make(tmp_path, ("jsonl", name))


def test_wandb_mode_defaults():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "disabled"}) == "disabled"


def test_wandb_wiring(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with make(tmp_path, ("wandb",), project="p", experiment="e", config_dict={"a": {"b": 1}}) as tracker:
        tracker.log({"x": 1.0}, step=3)
    assert calls[0] == ("init", {"project": "p", "name": "e", "config": {"a": {"b": 1}}, "dir": str(tmp_path),
                                 "mode": "offline"})
    assert calls[1:] == [("log", {"x": 1.0}, 3), ("finish",)]


def test_mlflow_wiring(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("mlflow")
    fake.set_tracking_uri = lambda uri: calls.append(("uri", uri))
    fake.set_experiment = lambda name: calls.append(("experiment", name))
    fake.start_run = lambda run_name: calls.append(("start", run_name))
    fake.log_params = lambda params: calls.append(("params", params))
    fake.log_metrics = lambda metrics, step: calls.append(("metrics", metrics, step))
    fake.end_run = lambda: calls.append(("end",))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(sinks, "_have_module", lambda name: False)
    with pytest.raises(MissingPackageError, match="sqlalchemy"):  # mlflow-skinny: no local store
        make(tmp_path, ("mlflow",))
    monkeypatch.setattr(sinks, "_have_module", lambda name: name == "sqlalchemy")
    calls.clear()
    config = {"trainer": {f"k{i}": i for i in range(150)}, "model": {"path": "x" * 900}}
    with make(tmp_path, ("mlflow",), project="p", experiment="e", config_dict=config) as tracker:
        tracker.log({"val-core/openai/gsm8k/reward/mean@1": 0.5}, step=2)
    assert calls[0] == ("uri", f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    assert calls[1:3] == [("experiment", "p"), ("start", "e")]
    params = [c[1] for c in calls if c[0] == "params"]
    assert [len(p) for p in params] == [100, 51]  # batches of at most 100
    assert len(params[1]["model.path"]) == 500
    assert ("metrics", {"val-core/openai/gsm8k/reward/mean_at_1": 0.5}, 2) in calls
    assert calls[-1] == ("end",)
    assert mlflow_key("a:b@c") == "a_b_at_c"


def test_tensorboard_wiring_and_purge_on_resume(tmp_path, monkeypatch):
    writers = []

    class Writer:
        def __init__(self, log_dir, purge_step=None):
            self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
            writers.append(self)

        def add_text(self, tag, text):
            self.text = (tag, text)

        def add_scalar(self, key, value, global_step):
            self.scalars.append((key, value, global_step))

        def flush(self):
            pass

        def close(self):
            self.closed = True

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    with make(tmp_path, ("tensorboard",), config_dict={"a": 1}) as tracker:
        tracker.log({"x": 1.0, "y": 2.0}, step=7)
        tracker.truncate_after(5)
    assert writers[0].log_dir == str(tmp_path / "tensorboard") and writers[0].text[0] == "config"
    assert writers[0].scalars == [("x", 1.0, 7), ("y", 2.0, 7)]
    assert writers[0].closed and writers[1].purge_step == 6 and writers[1].closed


def test_real_tensorboard_if_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with make(tmp_path, ("tensorboard",), config_dict={"a": 1}) as tracker:
        for step in (1, 2, 3):
            tracker.log({"critic/score/mean": float(step)}, step=step)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_real_mlflow_if_installed(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with make(tmp_path, ("mlflow",), project="p", experiment="e", config_dict={"a": {"b": 1}}) as tracker:
        tracker.log({"critic/score/mean": 1.0, "val-core/x/reward/mean@1": 0.5}, step=1)
        tracker.log({"critic/score/mean": 2.0}, step=2)
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("p").experiment_id])[0]
    assert run.data.params == {"a.b": "1"} and run.info.run_name == "e"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0)]
    assert run.data.metrics["val-core/x/reward/mean_at_1"] == 0.5


def test_real_wandb_offline_if_installed(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with make(tmp_path, ("wandb",), project="p", experiment="e", config_dict={"a": 1}) as tracker:
        tracker.log({"critic/score/mean": 1.0}, step=1)
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_metrics_jsonl_is_written_whatever_the_loggers(tmp_path, capsys):
    """trainer.logger=['console'] (verl's quickstart) still leaves metrics.jsonl for compare_runs and resume."""
    with make(tmp_path, ("console",), total_steps=1, progress=False) as tracker:
        tracker.log(_step_metrics(1), step=1)
    assert _lines(tmp_path / METRICS_FILE) == [{"step": 1, **_step_metrics(1)}]
    assert capsys.readouterr().out.startswith("step 1/1 | critic/score/mean 0.100 | actor/kl_loss")
