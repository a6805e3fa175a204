"""End to end on CPU: GRPO through Ray with 2 workers and the vLLM rollout; DAPO and PPO with the
transformers rollout; resume == uninterrupted; a kill -9 mid-checkpoint leaves the previous one.

Every run uses the offline tiny kit and a small synthetic task, so each takes seconds to a minute.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_npu.checkpoint import CheckpointManager
from grpo_npu.config import load_config
from grpo_npu.data.synthetic import write_synthetic
from grpo_npu.trainer import Trainer

pytestmark = pytest.mark.slow

# Keys that depend on wall time or process memory: everything else must match exactly on resume.
NONDETERMINISTIC = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/mem_", "rollout/weight_sync_s",
                    "rollout/prefill_s", "rollout/decode_s",
                    "rollout/sync_check_s")  # wall times


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("task")
    write_synthetic(str(out), train_size=64, test_size=8, difficulty=1, seed=0, write_sft=False)
    return out


@pytest.fixture(scope="module")
def score_file(tmp_path_factory):
    """A custom reward that varies within groups even for an untrained model (for DAPO filtering)."""
    path = tmp_path_factory.mktemp("reward") / "parity_reward.py"
    path.write_text(textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(len(solution_str) % 2)
    """))
    return path


def overrides(model: str, task: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={task / 'train.parquet'}", f"data.val_files={task / 'test.parquet'}",
        "data.train_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.load_format=dummy",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.logger=['jsonl']",
        f"trainer.default_local_dir={run_dir}", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.total_training_steps=2", "trainer.save_freq=1", "ray_init.num_cpus=2",
        *extra,
    ]


def read_metrics(run_dir: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], {}).update(row)
    return by_step


def run(cfg_overrides: list[str]) -> dict:
    trainer = Trainer(load_config(cfg_overrides))
    try:
        return trainer.fit()
    finally:
        trainer.close()


def assert_trained(model_path: str, run_dir: Path, steps: int) -> None:
    """Finite metrics every step; a committed checkpoint per step; its HF export reloads and differs everywhere."""
    metrics = read_metrics(run_dir)
    assert sorted(k for k in metrics if k > 0) == list(range(1, steps + 1))
    for step, row in metrics.items():
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite {bad}"
    latest = CheckpointManager(run_dir).latest()
    assert latest is not None and latest[0] == steps
    export = Path(latest[1]) / "actor" / "huggingface"
    trained = AutoModelForCausalLM.from_pretrained(export).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    unchanged = [name for name, w in initial.items() if torch.equal(w, trained[name])]
    assert not unchanged, f"parameters not updated: {unchanged}"


def test_grpo_two_ray_workers_with_vllm(tiny_model_path, task, tmp_path):
    pytest.importorskip("vllm")
    run_dir = tmp_path / "grpo"
    last = run(overrides(
        tiny_model_path, task, run_dir,
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # one optimizer step per batch: on-policy
        "actor_rollout_ref.model.share_prompt_prefix=True",  # each prompt once for its 4 responses
    ))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean",
                "perf/throughput", "timing_s/gen", "timing_s/update_actor", "response_length/mean"):
        assert key in last, key
    # on-policy: the update's forward gave the old log-probs (no separate pass), ratio exactly 1
    assert "timing_s/old_log_prob" not in last and last["actor/ppo_kl"] == 0.0
    # the engine's log-probs agree with the actor's after the weight sync (a broken sync shows here)
    assert 0.0 < last["rollout/logp_diff_max"] < 1e-2
    assert_trained(tiny_model_path, run_dir, steps=2)


def test_dapo_with_hf_rollout(tiny_model_path, task, score_file, tmp_path):
    run_dir = tmp_path / "dapo"
    last = run(overrides(
        tiny_model_path, task, run_dir,
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
        "data.gen_batch_size=4", "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
        "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0",
        f"custom_reward_function.path={score_file}",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']",
    ))
    assert last["train/num_gen_batches"] >= 1
    assert_trained(tiny_model_path, run_dir, steps=2)


def test_gdpo_normalises_the_reward_functions_components(tiny_model_path, task, tmp_path):
    """verl's GDPO keys: a reward function returning a dict of components, each normalised within its group."""
    scorer = tmp_path / "two_rewards.py"
    scorer.write_text(textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            fmt, acc = float(len(solution_str) % 2), float(len(solution_str) % 3 == 0)
            return {"score": fmt + acc, "format_reward": fmt, "accuracy_reward": acc}
    """))
    run_dir = tmp_path / "gdpo"
    last = run(overrides(
        tiny_model_path, task, run_dir, "actor_rollout_ref.rollout.name=hf", "algorithm.adv_estimator=gdpo",
        "+algorithm.gdpo_reward_keys=['accuracy_reward', 'format_reward']", "reward.reward_manager.name=gdpo",
        f"custom_reward_function.path={scorer}", "custom_reward_function.name=compute_score",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']",
    ))
    for key in ("gdpo/accuracy_reward/mean", "gdpo/format_reward/std", "actor/pg_loss"):
        assert key in last, key
    assert abs(last["critic/advantages/mean"]) < 1e-5  # whitened over the batch's tokens
    assert_trained(tiny_model_path, run_dir, steps=2)


def test_optimal_token_baseline_with_sum_pi_squared(tiny_model_path, task, score_file, tmp_path):
    """verl's OTB command line: the old-log-prob pass returns sum pi^2, the estimator weighs each token by it, and the
    step logs verl's variance_proxy/* (proxy1 is actor/grad_norm squared)."""
    run_dir = tmp_path / "otb"
    last = run(overrides(tiny_model_path, task, run_dir, "actor_rollout_ref.rollout.name=hf",
                         "algorithm.adv_estimator=optimal_token_baseline",
                         "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
                         f"custom_reward_function.path={score_file}",
                         "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']"))
    assert last["variance_proxy/proxy1_signal_strength"] == pytest.approx(last["actor/grad_norm"] ** 2)
    assert last["variance_proxy/expected_w"] > 0 and last["variance_proxy/proxy2_total_power"] >= 0
    assert "timing_s/old_log_prob" in last  # recomputed: sum pi^2 comes from that pass
    assert_trained(tiny_model_path, run_dir, steps=2)


def test_remax_scores_each_prompts_greedy_response_as_its_baseline(tiny_model_path, task, score_file, tmp_path):
    """ReMax: the dump holds one baseline per row, shared by the rows of a prompt, a score the reward gives;
    replaying that dump into a GRPO run works, and a GRPO dump is refused for ReMax (no baselines)."""
    run_dir, dump = tmp_path / "remax", tmp_path / "dump"
    last = run(overrides(tiny_model_path, task, run_dir, "algorithm.adv_estimator=remax",
                         "actor_rollout_ref.rollout.name=hf", f"custom_reward_function.path={score_file}",
                         f"trainer.rollout_data_dir={dump}", "trainer.save_freq=-1"))
    assert math.isfinite(last["actor/pg_loss"])
    assert last["reward_baseline/errors"] == last["reward_baseline/timeouts"] == 0.0  # the greedy rows' failures
    from safetensors.torch import load_file

    for step in (1, 2):
        saved = load_file(str(dump / f"{step}.safetensors"))
        baselines, groups = saved["reward_baselines"], saved["group_index"]
        assert baselines.shape == (16,) and set(baselines.tolist()) <= {0.0, 1.0}  # len(response) % 2
        for g in groups.unique():
            assert baselines[groups == g].unique().numel() == 1
    with pytest.raises(Exception, match="reward_baselines, which algorithm.adv_estimator=remax needs"):
        grpo_dump = tmp_path / "grpo_dump"
        run(overrides(tiny_model_path, task, tmp_path / "grpo", "actor_rollout_ref.rollout.name=hf",
                      f"trainer.rollout_data_dir={grpo_dump}", "trainer.save_freq=-1", "trainer.total_training_steps=1"))
        run(overrides(tiny_model_path, task, tmp_path / "replay", "algorithm.adv_estimator=remax",
                      f"trainer.replay_rollouts_from={grpo_dump}", "trainer.save_freq=-1", "trainer.total_training_steps=1"))


def test_ppo_with_critic_and_hf_rollout(tiny_model_path, task, tmp_path):
    """Also verl's profiler keys: step 2 traced per call of the actor (and so the rollout) and the critic."""
    run_dir, traces = tmp_path / "ppo", tmp_path / "traces"
    last = run(overrides(
        tiny_model_path, task, run_dir,
        "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.name=hf", "critic.optim.lr=1e-3",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']",
        "global_profiler.tool=torch", "global_profiler.steps=[2]", f"global_profiler.save_path={traces}",
        "actor_rollout_ref.actor.profiler.enable=True", "actor_rollout_ref.actor.profiler.all_ranks=True",
        "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=True",
        "critic.profiler.enable=True", "critic.profiler.ranks=[0]", "critic.profiler.tool_config.torch.discrete=True",
    ))
    for key in ("critic/vf_loss", "critic/values/mean", "critic/returns/mean", "actor/pg_loss"):
        assert key in last, key
    assert_trained(tiny_model_path, run_dir, steps=2)
    calls = ("rollout_generate", "critic_compute_values", "critic_update_critic", "actor_update_actor")
    assert {p.name for p in traces.iterdir()} >= {f"{call}_step2_rank0.json.gz" for call in calls}
    assert not [p for p in traces.iterdir() if "step1" in p.name]


@pytest.mark.parametrize("lora", [(), ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
                                         "actor_rollout_ref.actor.optim.lr=1e-3")], ids=["full", "lora"])
def test_resume_equals_uninterrupted(tiny_model_path, task, tmp_path, lora):
    if lora:
        pytest.importorskip("peft")
    common = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf",
              "actor_rollout_ref.actor.use_kl_loss=True", "trainer.save_freq=2", *lora]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(overrides(tiny_model_path, task, straight, *common, "trainer.total_training_steps=4"))
    run(overrides(tiny_model_path, task, resumed, *common, "trainer.total_training_steps=2"))  # "killed" after 2
    run(overrides(tiny_model_path, task, resumed, *common, "trainer.total_training_steps=4"))  # resume_mode=auto
    a, b = read_metrics(straight), read_metrics(resumed)
    for step in (3, 4):
        keys = [k for k in a[step] if not k.startswith(NONDETERMINISTIC)]
        assert keys and set(keys) <= set(b[step])
        diff = {k: (a[step][k], b[step][k]) for k in keys if a[step][k] != b[step][k]}
        assert not diff, f"step {step} differs after resume: {diff}"


KILL_SCRIPT = """
import sys, time
from grpo_npu.config import load_config
from grpo_npu.trainer import Trainer
from grpo_npu import checkpoint

trainer = Trainer(load_config(sys.argv[1:]))
original = checkpoint.CheckpointManager.commit

def slow_commit(self, step, tmp):
    if step == 2:  # the second checkpoint: announce, then hang before the rename
        print("WRITING", flush=True)
        time.sleep(600)
    return original(self, step, tmp)

checkpoint.CheckpointManager.commit = slow_commit
trainer.fit()
"""


def test_kill_9_during_checkpoint_keeps_previous(tiny_model_path, task, tmp_path):
    run_dir = tmp_path / "killed"
    args = overrides(tiny_model_path, task, run_dir, "algorithm.adv_estimator=grpo",
                     "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=3")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        deadline = time.time() + 300
        for line in proc.stdout:
            if "WRITING" in line or time.time() > deadline:
                break
        assert (run_dir / "global_step_1").is_dir()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    found = CheckpointManager(run_dir).resolve_resume("auto", None)
    assert found is not None and found[0] == 1
    # and a new run resumes from it and finishes
    run(args)
    assert CheckpointManager(run_dir).latest()[0] == 3


def test_ulysses_sequence_parallel_with_vllm_and_critic(tiny_model_path, task, tmp_path):
    """verl's Ulysses keys run: both ranks form one sequence-parallel group for the actor, the reference and the
    critic (tests/workers/test_ulysses.py checks the numbers against one rank); the weight-sync canary probes each
    rank's own prompts whole."""
    pytest.importorskip("vllm")
    run_dir = tmp_path / "sp"
    last = run(overrides(
        tiny_model_path, task, run_dir,
        "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']",
        "actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",  # verl's key
        "critic.ulysses_sequence_parallel_size=2", "critic.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.sync_check.first_syncs=2",
    ))
    for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "rollout/sync_check/logprob_diff_max"):
        assert key in last, key
    assert last["rollout/sync_check/logprob_diff_max"] < 1e-2
    assert_trained(tiny_model_path, run_dir, steps=2)
