"""bench.step_vs_trl: both trainers are configured for the same work (cheap checks, no training)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import step_vs_trl as svt


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_path):
    from grpo_npu.data.synthetic import write_synthetic

    files = write_synthetic(str(tmp_path_factory.mktemp("svt_data")), train_size=4, test_size=1, write_sft=False)
    return {"model": tiny_model_path, "train": str(files["train"]), "prompt_width": 64, "prompt_tokens": 200}


@pytest.mark.parametrize("change, message", [
    (dict(micro_batch=3), "not a multiple of micro_batch"),
    (dict(beta=0.0), "beta > 0"),
    (dict(timed_steps=0), "timed_steps"),
    (dict(model="7b"), "known"),
])
def test_workload_rejects_bad_sizes(change, message):
    with pytest.raises(ValueError, match=message):
        replace(svt.QUICK, **change)


def test_grpo_npu_side_does_one_optimizer_step_per_generation_batch(inputs, tmp_path):
    from grpo_npu.config import derive, load_config

    work = replace(svt.FULL, prompts=4, n=4, micro_batch=8, response_len=24)
    cfg = load_config(svt.grpo_npu_overrides(work, inputs, "hf", tmp_path / "run"))
    d = derive(cfg, world_size=1)
    assert d.train_batch_responses == d.mini_batch_responses_per_rank == 16  # one mini-batch = one optimizer step
    assert cfg.actor_rollout_ref.actor.ppo_epochs == 1
    assert d.micro_batch_per_rank == d.log_prob_micro_batch_per_rank == d.ref_log_prob_micro_batch_per_rank == 8
    assert d.use_reference and cfg.actor_rollout_ref.actor.kl_loss_coef == work.beta
    assert d.response_length == 24 and d.prompt_length == inputs["prompt_width"]
    rollout = cfg.actor_rollout_ref.rollout
    sampling = (rollout.name, rollout.n, rollout.ignore_eos, rollout.temperature, rollout.top_p)
    assert sampling == ("hf", 4, True, 1.0, 1.0)
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing
    assert list(cfg.data.train_files) == [inputs["train"]] and not cfg.data.shuffle
    assert cfg.trainer.total_training_steps == 1 + work.timed_steps


def test_overrides_reach_grpo_npu_last_and_prompt_sharing_is_cpu_only(inputs, tmp_path):
    from grpo_npu.config import load_config

    def loaded(work):
        return load_config(svt.grpo_npu_overrides(work, inputs, "vllm", tmp_path / "run")).actor_rollout_ref

    assert loaded(svt.FULL).model.share_prompt_prefix is True
    assert loaded(replace(svt.FULL, device="cuda")).model.share_prompt_prefix is False
    work = replace(svt.FULL, overrides=("actor_rollout_ref.rollout.enforce_eager=False",
                                        "actor_rollout_ref.model.share_prompt_prefix=False"))
    ref = loaded(work)
    assert ref.rollout.enforce_eager is False and ref.model.share_prompt_prefix is False  # after the workload's
    with pytest.raises(ValueError, match="expected key=value"):
        svt.run(overrides=("enforce_eager",))


def test_trl_side_does_one_optimizer_step_per_generation_batch(tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    work = replace(svt.FULL, prompts=4, n=4, micro_batch=8, response_len=24)
    args = GRPOConfig(**svt.trl_config_kwargs(work, tmp_path))
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16  # samples per optimizer step
    assert args.generation_batch_size == 16 and args.steps_per_generation == args.gradient_accumulation_steps == 2
    assert args.num_generations == 4 and args.num_iterations == 1
    assert args.max_completion_length == args.generation_kwargs["min_new_tokens"] == 24  # fixed length
    assert args.beta == work.beta > 0 and args.gradient_checkpointing
    assert args.learning_rate == work.lr and args.weight_decay == 0.0 and args.max_grad_norm == 1.0
    assert not args.bf16 and not args.fp16 and args.use_cpu
    assert args.max_steps == 1 + work.timed_steps


def test_summary_row_takes_the_fastest_step():
    measured = {
        "step_s": [2.0, 1.0, 4.0], "cpu_s": [1.9, 0.9, 1.2],
        "sections": [{"gen": 1.0, "score": 0.5, "update": 0.5}, {"gen": 0.5, "score": 0.2, "update": 0.3},
                     {"gen": 2.0, "score": 1.0, "update": 1.0}],
        "tokens": [100.0, 100.0, 100.0], "response_tokens": [64.0, 64.0, 64.0], "threads": 1, "process_s": 9.0,
    }
    row = svt.summarise("x", measured)
    assert row["step_s"] == 1.0 and row["steps_per_s"] == 1.0 and row["tokens_per_s"] == 100.0
    assert row["step_s_median"] == 2.0 and row["prompt_tokens_per_step"] == 36.0
    assert row["response_tokens_per_s"] == 64.0 and row["cpu_s"] == 0.9 and row["gen_s"] == 0.5
    assert row["step_s_all"] == "2/1/4"


def test_missing_optional_packages_skip_a_side_with_the_install_hint(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert "pip install -e '.[bench]'" in svt.missing_dependency("trl")
    assert svt.missing_dependency("grpo_npu_hf") is None
