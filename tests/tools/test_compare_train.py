"""compare_runs --mode train: per-metric |A-B| <= atol + rtol * |B| over the common steps; rewards must be
identical (two replays of one dump), a metric on one side only is a configuration difference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_npu.tools import compare_runs as cr
from grpo_npu.tools import compare_train as ct


def _run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(pg: list[float], grad: list[float], score: float = 0.5, **extra: list[float]) -> list[dict]:
    return [{"step": s + 1, "actor/pg_loss": pg[s], "actor/grad_norm": grad[s], "critic/score/mean": score,
             **{k.replace("__", "/"): v[s] for k, v in extra.items()}} for s in range(len(pg))]


def test_within_and_outside_tolerance(tmp_path, capsys):
    b = _run(tmp_path / "b", _rows([0.10, 0.20, 0.30], [1.0, 2.0, 3.0]))
    a = _run(tmp_path / "a", _rows([0.10, 0.2001, 0.30], [1.0, 2.0, 3.3]))
    report = ct.compare_train(a, b, rtol=0.02, atol=1e-3)
    by_key = {k.key: k for k in report.keys}
    assert by_key["actor/pg_loss"].verdict == "PASS"  # 1e-4 <= 1e-3 + 0.02 * 0.2
    grad = by_key["actor/grad_norm"]
    assert (grad.verdict, grad.worst_step, grad.steps_outside) == ("FAIL", 3, 1)  # 0.3 > 1e-3 + 0.06
    assert grad.max_abs_diff == pytest.approx(0.3)
    assert report.exit_code == ct.EXIT_FAIL
    # through compare_runs' command line
    assert cr.main([str(a), str(b), "--mode", "train", "--rtol", "0.2"]) == ct.EXIT_PASS
    assert "verdict: PASS" in capsys.readouterr().out
    assert cr.main([str(a), str(b), "--mode=train", "--rtol", "0", "--atol", "0", "--key", "actor/pg_loss"]) == 1


def test_bitwise_equal_runs_pass_at_zero_tolerance(tmp_path):
    rows = _rows([0.1, -0.2], [1.5, 2.5], actor__kl_loss=[0.01, 0.02])
    a, b = _run(tmp_path / "a", rows), _run(tmp_path / "b", rows)
    report = ct.compare_train(a, b, rtol=0, atol=0)
    assert report.verdict == "PASS" and {k.key for k in report.keys} == {"actor/pg_loss", "actor/grad_norm",
                                                                       "actor/kl_loss"}


def test_bad_input_exits_2(tmp_path, capsys):
    b = _run(tmp_path / "b", _rows([0.1, 0.2], [1.0, 2.0]))
    other_rewards = _run(tmp_path / "r", _rows([0.1, 0.2], [1.0, 2.0], score=0.75))
    assert cr.main([str(other_rewards), str(b), "--mode", "train"]) == ct.EXIT_BAD_INPUT
    assert "did not train on the same rollouts" in capsys.readouterr().err
    with_kl = _run(tmp_path / "k", _rows([0.1, 0.2], [1.0, 2.0], actor__kl_loss=[0.1, 0.1]))
    assert cr.main([str(with_kl), str(b), "--mode", "train"]) == ct.EXIT_BAD_INPUT
    assert "'actor/kl_loss' is logged by run A only" in capsys.readouterr().err
    assert cr.main([str(tmp_path / "missing"), str(b), "--mode", "train"]) == ct.EXIT_BAD_INPUT
