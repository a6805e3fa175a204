"""The weight-sync canary in real runs of the tiny model: a clean run passes it and logs the difference; a run
whose weight sync sends one tensor transposed stops at step 1 with exit code 1, naming that tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from grpo_npu.cli import _report
from grpo_npu.config import load_config
from grpo_npu.data.synthetic import write_synthetic
from grpo_npu.errors import EXIT_STOPPED, WorkerError
from grpo_npu.rollout.names import SYNC_CHECK_THRESHOLDS
from grpo_npu.rollout.sync_check import KEY
from grpo_npu.trainer import Trainer
from grpo_npu.workers.hybrid import HybridWorker

pytestmark = pytest.mark.slow

BROKEN = "model.layers.1.self_attn.o_proj.weight"
# Keys that depend on wall time or process memory, and the check's own.
NONDETERMINISTIC = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/mem_", "rollout/weight_sync_s",
                    "rollout/prefill_s", "rollout/decode_s",
                    "rollout/sync_check")  # square: a transposed copy still loads


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("task")
    write_synthetic(str(out), train_size=16, test_size=4, difficulty=1, seed=0, write_sft=False)
    return out


def overrides(model: str, task: Path, run_dir: Path, engine: str, *extra: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.name={engine}",
        f"data.train_files={task / 'train.parquet'}", "data.train_batch_size=2", "data.max_prompt_length=64",
        "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.load_format=dummy",
        *(["+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=134217728"] if engine == "vllm" else []),
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.logger=['jsonl']",
        f"trainer.default_local_dir={run_dir}", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.total_training_steps=3", "trainer.save_freq=-1", *extra,
    ]


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def fit(cfg_overrides: list[str]) -> None:
    trainer = Trainer(load_config(cfg_overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()


def transposed_in_sync(monkeypatch) -> None:
    """The worker's weight sync sends BROKEN transposed (every time, as a layout bug would)."""
    sync = HybridWorker.rollout_weights

    def broken_sync(self):
        for name, tensor in sync(self):
            yield name, (tensor.T.contiguous() if name == BROKEN else tensor)

    monkeypatch.setattr(HybridWorker, "rollout_weights", broken_sync)


# (engine, rollout.dtype, bound on the mean difference): an fp32 engine agrees with the fp32 actor to kernel order;
# a bf16 engine (CPU auto where the CPU has bf16 dot products) to bf16 rounding, within the canary's bf16 threshold
ENGINES = [("hf", "auto", 1e-3), pytest.param("vllm", "float32", 1e-3, marks=pytest.mark.vllm),
           pytest.param("vllm", "bfloat16", SYNC_CHECK_THRESHOLDS["bfloat16"],
                        marks=[pytest.mark.vllm, pytest.mark.cpu_bf16])]


@pytest.mark.parametrize("engine, dtype, bound", ENGINES)
def test_a_clean_run_passes_the_canary_and_logs_the_difference(engine, dtype, bound, tiny_model_path, task, tmp_path):
    if engine == "vllm":
        pytest.importorskip("vllm")
    on, off = tmp_path / "on", tmp_path / "off"
    keys = (f"actor_rollout_ref.rollout.dtype={dtype}",)
    fit(overrides(tiny_model_path, task, on, engine, *keys, f"{KEY}.first_syncs=1", f"{KEY}.every_n_steps=3"))
    by_step = metrics_by_step(on)
    checked = sorted(s for s, row in by_step.items() if "rollout/sync_check/logprob_diff_mean" in row)
    assert checked == [1, 3]  # the first sync, then every third step
    for step in checked:
        row = by_step[step]
        assert 0.0 <= row["rollout/sync_check/logprob_diff_mean"] <= row["rollout/sync_check/logprob_diff_max"]
        assert row["rollout/sync_check/logprob_diff_mean"] < bound
        assert math.isfinite(row["rollout/sync_check_s"])
    # The check changes nothing the run computes: the same run with it off has the same metrics, bit for bit.
    fit(overrides(tiny_model_path, task, off, engine, *keys, f"{KEY}.enable=False"))
    same = lambda row: {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)}  # noqa: E731
    assert {s: same(r) for s, r in metrics_by_step(off).items()} == {s: same(r) for s, r in by_step.items()}


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.vllm)])
def test_a_tensor_broken_in_the_sync_stops_the_run_naming_it(engine, tiny_model_path, task, tmp_path, monkeypatch,
                                                             capsys):
    pytest.importorskip("vllm")
    transposed_in_sync(monkeypatch)
    with pytest.raises(WorkerError) as caught:
        fit(overrides(tiny_model_path, task, tmp_path, engine))
    assert caught.value.stopped
    assert _report(caught.value) == EXIT_STOPPED
    line = capsys.readouterr().err.strip().splitlines()[-1]  # the one line the entry point prints
    assert line.startswith("stopped: rank 0: weight-sync canary at step 1:")
    assert f"names {BROKEN} " in line
    assert f"{KEY}.enable=False" in line
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()


def test_the_hf_rollout_blames_no_tensor_for_a_forward_that_differs(tiny_model_path, task, tmp_path, monkeypatch,
                                                                   capsys):
    """The transformers rollout generates with the actor's module (no sync): a mismatch there is its forward's."""
    from grpo_npu.rollout.hf_rollout import HFRollout

    scores = HFRollout.prompt_logprobs
    monkeypatch.setattr(HFRollout, "prompt_logprobs", lambda self, seqs: [t + 0.1 for t in scores(self, seqs)])
    with pytest.raises(WorkerError) as caught:
        fit(overrides(tiny_model_path, task, tmp_path, "hf"))
    assert _report(caught.value) == EXIT_STOPPED
    assert "the engine's loader or forward" in capsys.readouterr().err
