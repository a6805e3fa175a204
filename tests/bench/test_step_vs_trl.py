"""bench.step_vs_trl: grpo_npu gets its defaults plus the workload's keys only; both sides do the same work."""

from __future__ import annotations

from dataclasses import replace

import os
import pytest

from bench import step_vs_trl as svt
from bench import trl_side

# What a user must say to describe this workload; anything else on grpo_npu's command line would be tuning.
WORKLOAD_KEYS = {
    "algorithm.adv_estimator", "data.train_files", "data.train_batch_size", "data.max_response_length",
    "actor_rollout_ref.model.path", "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.ignore_eos",
    "actor_rollout_ref.rollout.tensor_model_parallel_size", "trainer.device", "trainer.n_gpus_per_node",
    "trainer.nnodes", "trainer.total_training_steps", "trainer.val_before_train",
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_path):
    from grpo_npu.data.synthetic import write_synthetic

    files = write_synthetic(str(tmp_path_factory.mktemp("svt_data")), train_size=4, test_size=1, write_sft=False)
    return {"model": tiny_model_path, "train": str(files["train"]), "prompt_tokens": 200}


@pytest.mark.parametrize("change, message", [
    (dict(micro_batch=3), "not a multiple of micro_batch"),
    (dict(timed_steps=0), "timed_steps"),
    (dict(rounds=0), "rounds"),
    (dict(model="7b"), "known"),
    (dict(overrides=("enforce_eager",)), "expected key=value"),
])
def test_workload_rejects_bad_sizes(change, message):
    with pytest.raises(ValueError, match=message):
        replace(svt.FIXED, **change)


@pytest.mark.parametrize("work", [svt.FIXED, svt.EOS, svt.QUICK], ids=lambda w: w.name)
def test_grpo_npu_gets_only_workload_keys(work, inputs):
    keys = svt.workload_keys(work, inputs, "vllm")
    assert {k.split("=", 1)[0] for k in keys} <= WORKLOAD_KEYS
    assert ("actor_rollout_ref.rollout.ignore_eos=True" in keys) is not work.natural_eos


def test_grpo_npu_does_one_optimizer_step_per_generation_batch_with_its_defaults(inputs, tmp_path):
    from grpo_npu.config import derive, load_config

    cfg = load_config(svt.workload_keys(svt.FIXED, inputs, "hf") + [f"trainer.default_local_dir={tmp_path}"])
    d = derive(cfg, world_size=1)
    assert d.train_batch_responses == d.mini_batch_responses_per_rank == 64  # 16 x 4: one optimizer step
    assert d.micro_batch_per_rank == 16 and cfg.actor_rollout_ref.actor.ppo_epochs == 1
    assert d.use_reference and d.response_length == 64
    actor = cfg.actor_rollout_ref.actor
    defaults = trl_side.GRPO_NPU_DEFAULTS  # what TRL is given must be grpo_npu's defaults
    assert (actor.optim.lr, actor.optim.weight_decay, actor.clip_ratio, actor.grad_clip, actor.kl_loss_coef) == (
        defaults["lr"], defaults["weight_decay"], defaults["clip_ratio"], defaults["grad_clip"],
        defaults["kl_loss_coef"])
    assert actor.loss_agg_mode == "token-mean" and cfg.actor_rollout_ref.rollout.temperature == 1.0
    assert cfg.trainer.total_training_steps == 1 + svt.FIXED.timed_steps


@pytest.mark.parametrize("work", [svt.FIXED, svt.EOS], ids=lambda w: w.name)
def test_trl_does_the_same_work(work, tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from dataclasses import asdict

    args = GRPOConfig(**trl_side.trl_config_kwargs(asdict(work), tmp_path))
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 64  # samples per optimizer step
    assert args.generation_batch_size == 64 and args.num_generations == 4 and args.num_iterations == 1
    assert args.max_completion_length == 64
    assert args.generation_kwargs.get("min_new_tokens") == (None if work.natural_eos else 64)
    assert args.beta == 0.001 and args.gradient_checkpointing and args.loss_type == "dapo"
    assert not args.bf16 and not args.fp16 and args.use_cpu and args.max_steps == 1 + work.timed_steps


def _measured(step_s, cpu_s, sections=None):
    sections = sections or [{"gen": t / 2, "score": t / 4, "update": t / 4, "other": 0.0} for t in step_s]
    return {"step_s": step_s, "cpu_s": cpu_s, "sections": sections, "tokens": [100.0] * len(step_s),
            "response_tokens": [64.0] * len(step_s), "threads": 2, "process_s": 9.0}


def test_summary_row_takes_the_fastest_step():
    measured = _measured([2.0, 1.0, 4.0], [1.9, None, 1.2],
                         [{"gen": 1.0, "score": 0.5, "update": 0.5, "other": 0.0},
                          {"gen": 0.5, "score": 0.2, "update": 0.3, "other": 0.0},
                          {"gen": 2.0, "score": 1.0, "update": 1.0, "other": 0.0}])
    row = svt.summarise(svt.FIXED, "grpo_npu_hf", [measured])
    assert row["step_s"] == 1.0 and row["steps_per_s"] == 1.0 and row["tokens_per_s"] == 100.0
    assert row["step_s_median"] == 2.0 and row["prompt_tokens_per_step"] == 36.0 and row["cpu_s"] == 1.2
    assert row["gen_s"] == 0.5 and row["step_s_all"] == "2/1/4" and row["side"] == "grpo_npu (rollout=hf)"
    tuned = svt.summarise(replace(svt.FIXED, overrides=("a.b=1",)), "grpo_npu_hf", [measured])
    assert tuned["side"].endswith("+ overrides")  # never passes for the defaults


def test_summary_row_spans_rounds():
    first = {**_measured([2.0, 3.0], [2.0, 2.5]), "limits": [{"perf/mfu/actor": 0.1}, {"perf/mfu/actor": 0.2}],
             "peak_memory_gb": 1.0}
    second = {**_measured([1.5, 0.9], [1.4, 0.8]), "limits": [{"perf/mfu/actor": 0.3}, {"perf/mfu/actor": 0.4}],
              "peak_memory_gb": 1.5, "process_s": 12.0}
    row = svt.summarise(svt.FIXED, "grpo_npu_hf", [first, second])
    assert row["step_s"] == 0.9 and row["perf/mfu/actor"] == 0.4 and row["update_s"] == 0.9 / 4
    assert row["step_s_all"] == "2/3 | 1.5/0.9" and row["step_s_median"] == 1.75
    assert row["cpu_s"] == 0.8 and row["peak_memory_gb"] == 1.5 and row["process_s"] == 12.0


def test_rounds_rotate_the_order_of_the_sides():
    sides = list(svt.SIDES)
    orders = [svt.rotated(sides, n) for n in range(3)]
    assert [order[0] for order in orders] == sides  # each side runs first once in three rounds
    assert all(sorted(order) == sorted(sides) for order in orders) and svt.rotated(sides, 3) == sides


def test_target_is_the_median_of_each_rounds_ratio():
    from bench.common import BenchResult

    def rows(ours, trl):
        side = {"prompt_tokens_per_step": 800, "response_tokens_per_step": 4096, "cpu_s": 1.0, "gen_s": 0.3}
        return {"trl": {**side, "steps_per_s": 1 / trl}, "grpo_npu_hf": {**side, "steps_per_s": 1 / ours}}

    # the host slows between rounds: the whole run's fastest steps (0.5 s ours, 1.0 s TRL's) come from
    # different rounds and would say 2.0x; each round says 1.5x, 1.25x, 1.0x
    rounds = [rows(0.5, 0.75), rows(1.2, 1.5), rows(2.0, 2.0)]
    result = BenchResult(name="step_vs_trl")
    svt.check_workload(result, svt.FIXED, {"prompt_tokens": 200}, rows(0.5, 0.75) | {"trl": rows(1, 1.0)["trl"]},
                       rounds)
    assert result.targets["fixed_grpo_npu_hf_vs_trl_steps_per_s"]["measured"] == pytest.approx(1.25)
    assert any("1.50/1.25/1.00x (median 1.25x" in n and "2.00x in wall time" in n for n in result.notes)


def test_the_transformers_rollouts_generation_is_held_to_trls_per_response_token():
    from bench.common import BenchResult

    def rows(gen_ours, tokens_ours, gen_trl, tokens_trl):
        side = {"prompt_tokens_per_step": 800, "steps_per_s": 1.0, "cpu_s": 1.0}
        return {"trl": {**side, "gen_s": gen_trl, "response_tokens_per_step": tokens_trl},
                "grpo_npu_hf": {**side, "gen_s": gen_ours, "response_tokens_per_step": tokens_ours}}

    # eos: our answers are longer in the second round; per token we are 1.5x, 0.9x and 1.2x TRL's speed
    rounds = [rows(0.1, 800, 0.15, 800), rows(0.2, 900, 0.16, 800), rows(0.1, 800, 0.12, 800)]
    result = BenchResult(name="step_vs_trl")
    svt.check_workload(result, svt.EOS, {"prompt_tokens": 200}, rounds[0], rounds)
    target = result.targets["eos_grpo_npu_hf_vs_trl_generation_per_token"]
    assert target == {"measured": pytest.approx(1.2), "target": ">= 1.0", "passed": True}
    assert any("1.50/0.90/1.20x" in n for n in result.notes)
    without_hf = BenchResult(name="step_vs_trl")
    svt.check_workload(without_hf, svt.EOS, {"prompt_tokens": 200}, {"trl": rounds[0]["trl"]})
    assert not without_hf.targets


def test_ratios_and_mismatch_checks():
    from bench.common import BenchResult

    result = BenchResult(name="step_vs_trl")
    rows = {"trl": {"steps_per_s": 1.0, "cpu_s": 2.0, "prompt_tokens_per_step": 800, "response_tokens_per_step": 4096},
            "grpo_npu_vllm": {"steps_per_s": 2.0, "cpu_s": 1.0, "prompt_tokens_per_step": 800,
                              "response_tokens_per_step": 4000}}
    svt.check_workload(result, svt.FIXED, {"prompt_tokens": 200}, rows)
    assert result.targets["fixed_grpo_npu_vllm_vs_trl_steps_per_s"] == {"measured": 2.0, "target": ">= 1.5",
                                                                         "passed": True}
    assert any("WORKLOAD MISMATCH: fixed/grpo_npu_vllm" in n for n in result.notes)
    natural = BenchResult(name="step_vs_trl")  # at natural length, response tokens may differ between sides
    svt.check_workload(natural, svt.EOS, {"prompt_tokens": 200}, rows)
    assert not any("MISMATCH" in n for n in natural.notes)


def test_missing_optional_packages_skip_a_side_with_the_install_hint(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert "pip install -e '.[bench]'" in svt.missing_dependency("trl")
    assert svt.missing_dependency("grpo_npu_hf") is None
    assert "no trl package" in svt.missing_dependency("trl", str(tmp_path))
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("")
    assert svt.missing_dependency("trl", str(tmp_path)) is None


def test_a_side_does_not_inherit_the_parents_process_group_rendezvous(monkeypatch):
    """The eos workload's SFT warm start holds a process group in the bench's own process; a side that
    inherited MASTER_PORT failed with EADDRINUSE (seen on the TRL side)."""
    from bench.cli_run import child_env

    monkeypatch.setenv("MASTER_PORT", "44867")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    env = child_env(2, "/tmp/x")
    assert not {"MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE"} & env.keys()
    assert env["OMP_NUM_THREADS"] == "2" and env["PYTHONPATH"].split(os.pathsep)[1] == "/tmp/x"
