"""Config: the verl seed command line, YAML/CLI precedence, validation messages, freezing, --help."""

from __future__ import annotations

import dataclasses
import pickle
import re
import shlex

import pytest

from grpo_npu import config as C
from grpo_npu.config import ConfigError, derive, load_config

SEED_COMMAND = """
algorithm.adv_estimator=grpo data.train_files=/home/u/data/gsm8k/train.parquet
data.val_files=/home/u/data/gsm8k/test.parquet data.train_batch_size=128 data.max_prompt_length=512
data.max_response_length=128 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=5e-7
actor_rollout_ref.model.use_remove_padding=False actor_rollout_ref.actor.entropy_coeff=0.001
actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=20
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.rollout.enable_chunked_prefill=False
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.kl_ctrl.kl_coef=0.001 trainer.critic_warmup=0 trainer.logger=['console']
trainer.project_name='verl_grpo_example_gsm8k' trainer.experiment_name='qwen2_7b_function_rm'
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=5
trainer.total_epochs=1 trainer.device=npu
"""

# A small valid base for the error tests.
BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


def seed_args(*tiny_overrides: str) -> list[str]:
    return shlex.split(SEED_COMMAND) + list(tiny_overrides)


def test_seed_command_parses_with_verl_meanings():
    cfg = load_config(seed_args("actor_rollout_ref.model.path=/tmp/tiny", "trainer.device=cpu"))
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.train_files == ("/home/u/data/gsm8k/train.parquet",)
    assert cfg.data.val_files == ("/home/u/data/gsm8k/test.parquet",)
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (128, 512, 128)
    assert cfg.data.filter_overlong_prompts is True and cfg.data.truncation == "error"
    arr = cfg.actor_rollout_ref
    assert arr.model.path == "/tmp/tiny"  # the later override wins
    assert arr.actor.optim.lr == pytest.approx(5e-7)
    assert arr.actor.entropy_coeff == pytest.approx(0.001)
    assert arr.actor.use_kl_loss and arr.actor.kl_loss_type == "low_var_kl"
    assert arr.model.enable_gradient_checkpointing is True and arr.model.use_remove_padding is False
    assert arr.rollout.name == "vllm" and arr.rollout.n == 5 and arr.rollout.tensor_model_parallel_size == 2
    assert arr.rollout.gpu_memory_utilization == pytest.approx(0.6)
    assert arr.rollout.enable_chunked_prefill is False
    assert arr.ref.fsdp_config.param_offload is True and arr.actor.fsdp_config.param_offload is False
    assert cfg.trainer.logger == ("console",)
    assert cfg.trainer.project_name == "verl_grpo_example_gsm8k"
    assert cfg.trainer.default_local_dir == "checkpoints/verl_grpo_example_gsm8k/qwen2_7b_function_rm"
    assert (cfg.trainer.test_freq, cfg.trainer.save_freq, cfg.trainer.total_epochs) == (5, -1, 1)
    assert cfg.trainer.device == "cpu"

    d = derive(cfg)
    # verl's normalisation: 64 prompts x 5 samples / 8 ranks = 40 responses per rank per mini-batch
    assert d.world_size == 8 and d.mini_batch_responses_per_rank == 40 and d.micro_batch_per_rank == 20
    assert d.train_batch_responses == 640 and d.use_reference and not d.use_critic
    assert (d.prompt_length, d.response_length) == (512, 128)
    assert (d.clip_low, d.clip_high) == (0.2, 0.2)


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(BASE + ["actor_rollout_ref.actor.ppo_mini_batchsize=3"])
    msg = str(e.value)
    assert "'actor_rollout_ref.actor.ppo_mini_batchsize'" in msg and "actor_rollout_ref.actor.ppo_mini_batch_size" in msg
    with pytest.raises(ConfigError, match=r"unknown config key 'lr'.*actor_rollout_ref\.actor\.optim\.lr"):
        load_config(BASE + ["lr=1e-6"])


def test_one_token_prompts_are_refused_while_the_sync_check_needs_two():
    """data.max_prompt_length=1 used to fail at the first sync, blaming the check; now at load, with both ways out."""
    with pytest.raises(ConfigError, match=r"^data\.max_prompt_length=1: the sync check teacher-forces prompts of 2 "
                                          r"tokens or more; .*\(actor_rollout_ref\.rollout\.sync_check\.enable=False\)$"):
        load_config(BASE + ["data.max_prompt_length=1"])
    assert load_config(BASE + ["data.max_prompt_length=1", "actor_rollout_ref.rollout.sync_check.enable=False"])
    off = ["actor_rollout_ref.rollout.sync_check.first_syncs=0", "actor_rollout_ref.rollout.sync_check.every_n_steps=0"]
    assert load_config(BASE + ["data.max_prompt_length=1", *off]).data.max_prompt_length == 1  # a check never due
    with pytest.raises(ConfigError, match=r"max_prompt_length=1: the sync check"):  # either one still checks
        load_config(BASE + ["data.max_prompt_length=1", off[0]])
    assert load_config(BASE + ["data.max_prompt_length=2"]).data.max_prompt_length == 2


def test_a_loss_modes_settings_are_checked_and_another_modes_refused():
    """Each loss mode reads its own settings (names.POLICY_LOSS_READS); a setting it does not read is refused
    at a non-default value (verl would ignore it), except clip_ratio_c under gspo, which verl's GSPO examples set."""
    mode = "actor_rollout_ref.actor.policy_loss.loss_mode"
    actor = "actor_rollout_ref.actor"
    with pytest.raises(ConfigError, match=rf"^{actor}\.clip_ratio_high=0.28 is not read by {mode}=gpg \(it reads: none "
                                          r"of them\); remove it or choose the loss mode that reads it$"):
        load_config(BASE + [f"{mode}=gpg", f"{actor}.clip_ratio_high=0.28"])
    with pytest.raises(ConfigError, match=rf"^{actor}\.tau_pos=2.0 is not read by {mode}=vanilla \(it reads: "
                                          r"clip_ratio_low, clip_ratio_high, clip_ratio_c\)"):
        load_config(BASE + [f"{actor}.tau_pos=2.0"])
    with pytest.raises(ConfigError, match=rf"{actor}\.clip_ratio_c=10.0 is not read by {mode}=cispo"):
        load_config(BASE + [f"{mode}=cispo", f"{actor}.clip_ratio_c=10.0"])
    with pytest.raises(ConfigError, match=rf"{actor}\.clip_ratio_low=None is not read by {mode}=sapo"):  # nor clip_ratio
        load_config(BASE + [f"{mode}=sapo", f"{actor}.clip_ratio=0.3", f"{actor}.clip_ratio_low=null"])
    with pytest.raises(ConfigError, match=rf"^{actor}\.policy_loss\.dro_beta=None: loss_mode=dro needs a penalty weight > 0$"):
        load_config(BASE + [f"{mode}=dro"])
    with pytest.raises(ConfigError, match=rf"^{actor}\.tau_neg=0.0 must be > 0$"):
        load_config(BASE + [f"{mode}=sapo", f"{actor}.tau_neg=0.0"])
    # accepted: each mode with the settings it reads, as verl's example command lines give them
    cfg = load_config(BASE + [f"{mode}=cispo", f"{actor}.clip_ratio_low=10", f"{actor}.clip_ratio_high=0.2"])
    assert derive(cfg, 2).clip_low == 10.0
    assert load_config(BASE + [f"{mode}=dppo_tv", f"{actor}.clip_ratio_c=10000.0"]).actor_rollout_ref.actor.clip_ratio_c == 1e4
    assert load_config(BASE + [f"{mode}=sapo", f"{actor}.tau_pos=2.0"]).actor_rollout_ref.actor.tau_pos == 2.0
    assert load_config(BASE + [f"{mode}=dro", f"{actor}.policy_loss.dro_beta=0.1"]).actor_rollout_ref.actor.policy_loss.dro_beta == 0.1
    assert load_config(BASE + [f"{mode}=gspo", f"{actor}.clip_ratio_c=10.0"]).actor_rollout_ref.actor.clip_ratio_c == 10.0
    # verl's SAPO examples also write the temperatures into the policy_loss block, which verl's SAPO never reads:
    # accepted only where they equal the actor-level values it does read
    sapo = BASE + [f"{mode}=sapo", f"{actor}.tau_neg=1.2"]
    load_config(sapo + [f"+{actor}.policy_loss.tau_pos=1.0", f"+{actor}.policy_loss.tau_neg=1.2"])
    with pytest.raises(ConfigError, match=rf"^not supported by grpo_npu: {actor}\.policy_loss\.tau_neg=1.05 \(verl's SAPO "
                                          rf"loss reads {actor}\.tau_neg .*; supported values: 1.2$"):
        load_config(sapo + [f"+{actor}.policy_loss.tau_neg=1.05"])


def test_a_key_under_the_wrong_section_suggests_its_leaf_name_first():
    """A clip setting written into the policy_loss block, where neither verl nor grpo_npu reads it: the key that
    acts, actor.clip_ratio_high, is named first."""
    with pytest.raises(ConfigError, match=r"did you mean actor_rollout_ref\.actor\.clip_ratio_high, "):
        load_config(BASE + ["+actor_rollout_ref.actor.policy_loss.clip_ratio_high=0.28"])
    # a close match that shares the leaf stays first, ahead of other keys ending in .enable
    with pytest.raises(ConfigError, match=r"did you mean algorithm\.filter_groups\.enable, "):
        load_config(BASE + ["algorithm.filter_group.enable=True"])
    with pytest.raises(ConfigError, match=r"did you mean reward_model\.overlong_buffer\.enable, "):
        load_config(BASE + ["reward_model.overlong_bufer.enable=True"])


def test_bad_type_and_bad_value_messages():
    with pytest.raises(ConfigError, match=r"data\.train_batch_size.*'abc'.*expected int"):
        load_config(BASE + ["data.train_batch_size=abc"])
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator='grpoo'.*grpo, rloo"):
        load_config(BASE + ["algorithm.adv_estimator=grpoo"])
    with pytest.raises(ConfigError, match=r"trainer\.logger='foo'.*console"):
        load_config(BASE + ["trainer.logger=['console','foo']"])
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1.5"):
        load_config(BASE + ["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match=r"clip_ratio_c=0.5 must be > 1"):
        load_config(BASE + ["actor_rollout_ref.actor.clip_ratio_c=0.5"])
    with pytest.raises(ConfigError, match=r"filter_groups\.metric=None"):
        load_config(BASE + ["algorithm.filter_groups.enable=True"])
    with pytest.raises(ConfigError, match=r"lora_rank=-1 must be >= 0"):
        load_config(BASE + ["actor_rollout_ref.model.lora_rank=-1"])
    with pytest.raises(ConfigError, match=r"lora_alpha=0 must be > 0"):
        load_config(BASE + ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=0"])
    with pytest.raises(ConfigError, match=r"all-linear stands alone"):
        load_config(BASE + ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[all-linear,q_proj]"])
    with pytest.raises(ConfigError, match=r"is a config section"):
        load_config(BASE + ["trainer=3"])
    with pytest.raises(ConfigError, match=r"not key=value"):
        load_config(BASE + ["trainer.device"])


def test_lora_merge_is_verls_key_acted_on_with_lora_and_vllm_and_refused_elsewhere():
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=True"]
    assert load_config(BASE).actor_rollout_ref.model.lora.merge is None  # auto: merged on CPU only
    assert load_config(BASE + lora + ["actor_rollout_ref.rollout.name=vllm"]).actor_rollout_ref.model.lora.merge
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.lora\.merge=True needs LoRA .*rollout\.name=vllm"):
        load_config(BASE + ["actor_rollout_ref.model.lora.merge=True", "actor_rollout_ref.rollout.name=vllm"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.lora\.merge=True needs"):
        load_config(BASE + lora + ["actor_rollout_ref.rollout.name=hf"])
    with pytest.raises(ConfigError, match=r"lora\.rank=8 .*only lora\.merge is grpo_npu's"):  # the block's others
        load_config(BASE + ["actor_rollout_ref.model.lora.rank=8"])


def test_rollout_dtype_is_refused_where_the_rollout_cannot_act_on_it():
    """The hf rollout generates with the actor's module: a rollout.dtype other than auto would be ignored there."""
    with pytest.raises(ConfigError, match=r"rollout\.dtype=bfloat16 with rollout\.name=hf.*leave it auto"):
        load_config(BASE + ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=bfloat16"])
    assert load_config(BASE + ["actor_rollout_ref.rollout.name=hf"]).actor_rollout_ref.rollout.dtype == "auto"
    assert load_config(BASE + ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bf16"])


def test_batch_arithmetic_errors_explain_the_numbers():
    with pytest.raises(ConfigError, match=r"10 x 1 = 10 responses cannot be split evenly over 8 ranks"):
        load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "data.train_batch_size=10",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=10"])
    with pytest.raises(ConfigError, match=r"not a multiple of actor_rollout_ref\.actor\.ppo_mini_batch_size=3"):
        load_config(BASE + ["actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.train_batch_size=8"])
    with pytest.raises(ConfigError, match=r"4 x 1 / 2 = 2 responses is not a multiple of .*ppo_micro_batch_size_per_gpu=4"):
        load_config(BASE + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    with pytest.raises(ConfigError, match=r"larger than data\.train_batch_size=8"):
        load_config(BASE + ["actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    with pytest.raises(ConfigError, match=r"set only one of"):
        load_config(BASE + ["actor_rollout_ref.actor.ppo_micro_batch_size=8"])
    # dynamic batch size needs no micro-batch size
    cfg = load_config(["actor_rollout_ref.actor.use_dynamic_bsz=True", "trainer.n_gpus_per_node=2",
                       "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert derive(cfg).micro_batch_per_rank is None


def test_yaml_then_cli_precedence(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "defaults:\n  - ppo_trainer\n"  # hydra's defaults list is ignored (our defaults are the dataclasses)
        "data:\n  train_batch_size: 16\n  max_prompt_length: 64\n"
        "actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 2\n    ppo_mini_batch_size: 8\n"
        "  rollout:\n    n: 4\ntrainer:\n  n_gpus_per_node: 2\n"
    )
    cfg = load_config(["data.max_prompt_length=128"], yaml_path=str(yaml))
    assert cfg.data.train_batch_size == 16  # from YAML
    assert cfg.data.max_prompt_length == 128  # CLI beats YAML
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.data.max_response_length == 512  # default untouched

    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_batchsize: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'data\.train_batchsize' in .*bad\.yaml.*data\.train_batch_size"):
        load_config([], yaml_path=str(bad))
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config([], yaml_path=str(tmp_path / "missing.yaml"))
    bad.write_text("data: 5\n")
    with pytest.raises(ConfigError, match=rf"^data in {re.escape(str(bad))} is a section of settings: expected a "
                                          r"mapping, got 5$"):
        load_config([], yaml_path=str(bad))
    bad.write_text("data:\n  train_batch_size: 2\n   bad_indent: 3\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML: mapping values are not allowed") as err:
        load_config([], yaml_path=str(bad))
    assert "\n" not in str(err.value), "one line, the YAML parser's position included"
    bad.write_text("data:\ntrainer:\n  n_gpus_per_node: 2\n")  # a section whose settings are all commented out
    assert load_config(BASE[:1] + BASE[2:], yaml_path=str(bad)).trainer.n_gpus_per_node == 2


def test_command_line_forms(tmp_path, capsys):
    yaml = tmp_path / "exp.yaml"
    yaml.write_text("trainer:\n  n_gpus_per_node: 2\n")
    for argv in (["--config", str(yaml)], [f"config={yaml}"], ["--config-path", str(tmp_path), "--config-name", "exp"]):
        cfg, cmd = C.config_from_argv(argv + BASE[:1] + BASE[2:])
        assert cfg.trainer.n_gpus_per_node == 2, argv
    cfg, cmd = C.config_from_argv(["--cfg"] + BASE + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    assert cfg is None and "ppo_micro_batch_size_per_gpu: 1" in capsys.readouterr().out
    cfg, cmd = C.config_from_argv(["--help"])
    out = capsys.readouterr().out
    assert cfg is None and "actor_rollout_ref.actor.kl_loss_type" in out and "KL estimator of the KL loss" in out
    with pytest.raises(ConfigError, match=r"unknown option '--bogus'"):
        C.split_argv(["--bogus"])


def test_help_says_which_values_a_kept_key_is_limited_to():
    """A key grpo_npu keeps for verl's command lines at some values only says so in --help, with the feature other
    values would need; a key it acts on fully, or at every value, says nothing of the kind."""
    from grpo_npu.config.keys import iter_keys
    from grpo_npu.config.support import refused_schema_keys

    text = C.help_text()

    def entry(key: str) -> str:
        return re.split(r"\n(?=  \S)|\n\n", text.split(f"\n  {key} (", 1)[1], maxsplit=1)[0]  # to the next key

    assert entry("actor_rollout_ref.actor.use_torch_compile").endswith(
        "Only False here; other values are refused (not in grpo_npu: torch.compile of the log-prob computation).")
    assert "Only 0 here; other values are refused (not in grpo_npu: data-loader worker processes" in entry(
        "data.dataloader_num_workers")
    assert "refused" not in entry("critic.ulysses_sequence_parallel_size")
    assert "refused" not in entry("data.shuffle")
    assert entry("data.return_raw_chat").endswith("Every value runs the same here: verl keeps the messages for rollouts "
                                                  "that template them themselves (its agent loop); grpo_npu's single-turn "
                                                  "rollout generates from the prompt as the dataset templates it, the same "
                                                  "tokens.")
    for value in ("True", "False"):  # verl's examples set it for their agent loop: accepted either way
        load_config(BASE + [f"data.return_raw_chat={value}", f"actor_rollout_ref.rollout.layered_summon={value}"])
    limited = refused_schema_keys(tuple(spec.key for spec in iter_keys()))
    assert len(limited) == 20 and text.count("other values are refused") == len(limited)  # each such key, once
    assert all("other values are refused" in entry(key) for key in limited)


def test_free_form_dicts_need_plus():
    cfg = load_config(BASE[:1] + BASE[2:] + ["trainer.n_gpus_per_node=1",
                      "+actor_rollout_ref.model.override_config.attn_implementation=eager",
                      "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=4"])
    assert cfg.actor_rollout_ref.model.override_config["attn_implementation"] == "eager"
    assert cfg.actor_rollout_ref.rollout.engine_kwargs["vllm"]["max_logprobs"] == 4
    with pytest.raises(ConfigError, match=r"write \+actor_rollout_ref\.model\.override_config\.x=1"):
        load_config(BASE + ["actor_rollout_ref.model.override_config.x=1"])


@pytest.mark.parametrize("items, message", [
    (["+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3"],
     r"^actor_rollout_ref\.rollout\.engine_kwargs\.sglang\.attention_backend: rollout\.name=vllm reads "
     r"engine_kwargs\.vllm only; remove it$"),
    (["actor_rollout_ref.rollout.name=hf", "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=64"],
     r"^actor_rollout_ref\.rollout\.engine_kwargs\.vllm\.block_size: rollout\.name=hf takes no engine arguments"),
    (["actor_rollout_ref.rollout.engine_kwargs.vllm=3"],
     r"^actor_rollout_ref\.rollout\.engine_kwargs\.vllm=3: expected a mapping of engine arguments"),
])
def test_engine_arguments_no_engine_reads_are_refused(items, message):
    """An engine section the configured rollout never reads was accepted and ignored (sglang's beside vLLM)."""
    with pytest.raises(ConfigError, match=message):
        load_config(BASE + items)
    load_config(BASE + ["actor_rollout_ref.rollout.name=hf"])  # verl's empty sections are fine with any rollout
    load_config(BASE + ["+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=null"])  # null: unset


def test_frozen_after_load_and_picklable():
    cfg = load_config(BASE[:1] + BASE[2:] + ["trainer.n_gpus_per_node=1", "+actor_rollout_ref.model.override_config.a=1"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.train_batch_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.actor_rollout_ref.model.override_config["b"] = 2  # type: ignore[index]
    assert isinstance(cfg.trainer.logger, tuple)
    again = pickle.loads(pickle.dumps(cfg))  # configs travel to Ray workers
    assert again == cfg


def test_one_load_leaves_nothing_behind_for_the_next(tmp_path):
    """load_config builds the defaults' tree once per process: overrides, YAML values, deletions and free-form
    additions of one load must not reach the next."""
    default = C.to_dict(load_config(BASE))
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("trainer:\n  project_name: from_yaml\n")
    changed = load_config(BASE + ["+actor_rollout_ref.model.override_config.attn_implementation=eager",
                                  "~trainer.experiment_name", "actor_rollout_ref.rollout.n=8"], str(yaml_file))
    assert changed.trainer.project_name == "from_yaml" and changed.actor_rollout_ref.rollout.n == 8
    assert C.to_dict(load_config(BASE)) == default


def test_every_key_documented_once():
    specs = C.iter_keys()
    keys = [s.key for s in specs]
    assert len(keys) == len(set(keys))
    undocumented = [s.key for s in specs if not s.doc]
    assert not undocumented, f"fields without a docstring line: {undocumented}"
    # the issue-named keys exist
    for key in ["actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high",
                "actor_rollout_ref.actor.clip_ratio_c", "actor_rollout_ref.actor.loss_agg_mode",
                "actor_rollout_ref.actor.policy_loss.loss_mode", "algorithm.filter_groups.max_num_gen_batches",
                "reward_model.overlong_buffer.penalty_factor", "actor_rollout_ref.actor.use_dynamic_bsz",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.rollout.free_cache_engine",
                "actor_rollout_ref.rollout.enable_sleep_mode", "actor_rollout_ref.rollout.enforce_eager",
                "actor_rollout_ref.rollout.load_format", "actor_rollout_ref.rollout.val_kwargs.temperature",
                "trainer.resume_mode", "trainer.default_local_dir", "trainer.total_training_steps",
                "trainer.val_before_train", "trainer.device"]:
        assert key in keys, key


@pytest.mark.parametrize("keys, old_pass, ref_pass", [
    ((), "budget", "budget"),  # no log-prob micro-batch size anywhere: both no-grad passes pack to their token budget
    (("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",), 4, 4),  # the reference follows the rollout's
    (("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",), "budget", 8),
    (("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false"),
     2, 2),  # explicitly fixed: the training micro-batch, as before
    (("actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"),
     "budget", "budget"),  # verl's rule: the actor's dynamic batch size carries over
])
def test_log_prob_passes_without_a_micro_batch_size_pack_to_their_token_budget(keys, old_pass, ref_pass):
    from grpo_npu.step_limits import log_prob_rows

    d = derive(load_config(BASE + ["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=300",
                                   "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=200", *keys]))
    got = [("budget" if d.log_prob_use_dynamic_bsz else d.log_prob_micro_batch_per_rank),
           ("budget" if d.ref_log_prob_use_dynamic_bsz else d.ref_log_prob_micro_batch_per_rank)]
    assert got == [old_pass, ref_pass]
    assert (d.log_prob_max_token_len, d.ref_log_prob_max_token_len) == (300, 200)
    # the memory plan's rows per log-prob micro-batch: the larger pass, a full budget of 100-token rows at most
    want = max(300 // 100 if old_pass == "budget" else old_pass, 200 // 100 if ref_pass == "budget" else ref_pass)
    assert log_prob_rows(d, 100) == want


@pytest.mark.parametrize("keys, dynamic, values_micro, values_budget", [
    ((), False, 2, 16384),  # the critic's update micro-batch (the actor's here) and its update budget
    (("critic.forward_micro_batch_size_per_gpu=8", "critic.forward_max_token_len_per_gpu=900"), False, 8, 900),
    (("actor_rollout_ref.actor.use_dynamic_bsz=True",), True, 2, 16384),  # verl: the critic follows the actor's
    (("actor_rollout_ref.actor.use_dynamic_bsz=True", "critic.use_dynamic_bsz=False"), False, 2, 16384),
])
def test_the_critics_passes_are_resolved_once(keys, dynamic, values_micro, values_budget):
    d = derive(load_config(BASE + ["algorithm.adv_estimator=gae", "critic.ppo_max_token_len_per_gpu=16384", *keys]))
    assert (d.critic_use_dynamic_bsz, d.values_micro_batch_per_rank, d.values_max_token_len) == (
        dynamic, values_micro, values_budget)


def test_derived_values_are_not_written_back():
    cfg = load_config(BASE[:1] + BASE[2:] + ["trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                                             "actor_rollout_ref.actor.clip_ratio_low=null"])
    d = derive(cfg)
    assert (d.clip_low, d.clip_high) == (0.2, 0.28)
    assert cfg.actor_rollout_ref.actor.clip_ratio_low is None  # still unset in the config itself
    assert cfg.actor_rollout_ref.rollout.response_length is None and d.response_length == 512


@pytest.mark.parametrize("overrides,reuse", [
    ((), True),
    (("actor_rollout_ref.actor.old_log_prob=recompute",), False),
    (("actor_rollout_ref.actor.ppo_epochs=2",), False),
    (("actor_rollout_ref.actor.ppo_mini_batch_size=4",), False),
    (("algorithm.use_kl_in_reward=True",), False),
])
def test_update_reuses_its_forward_as_old_log_probs_only_on_policy(overrides, reuse):
    """One optimizer step on the whole batch, nothing reading old log-probs before it: reuse; else a separate pass."""
    cfg = load_config(["trainer.n_gpus_per_node=1", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *overrides])
    assert derive(cfg, 1).old_logp_from_update is reuse


def test_negative_kl_coef_and_non_positive_learning_rates_are_refused():
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.kl_loss_coef=-0\.1 must be >= 0"):
        load_config(BASE + ["actor_rollout_ref.actor.kl_loss_coef=-0.1"])
    for key in ("critic.optim.lr", "actor_rollout_ref.actor.optim.lr"):
        for lr in ("0", "-1e-05"):
            with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}=.* must be > 0"):
                load_config(BASE + [f"{key}={lr}"])
    with pytest.raises(ConfigError, match=r"^trainer\.step_timeout_s=0"):
        load_config(BASE + ["trainer.step_timeout_s=0"])
    cfg = load_config(BASE + ["actor_rollout_ref.actor.kl_loss_coef=0", "critic.optim.lr=1e-6"])
    assert cfg.actor_rollout_ref.actor.kl_loss_coef == 0 and cfg.critic.optim.lr == 1e-6


@pytest.mark.parametrize("keys,bounds", [
    ((), (0.2, 0.2)),  # verl 0.9.1: clip_ratio_low and clip_ratio_high both default to 0.2
    (("actor_rollout_ref.actor.clip_ratio_high=0.28",), (0.2, 0.28)),
    (("actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_low=null"), (0.3, 0.2)),
    (("actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_low=null",
      "actor_rollout_ref.actor.clip_ratio_high=null"), (0.3, 0.3)),
    (("actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_low=0.3",
      "actor_rollout_ref.actor.clip_ratio_high=0.3"), (0.3, 0.3)),
])
def test_clip_bounds_follow_verl_where_clip_ratio_fills_only_a_null_end(keys, bounds):
    assert (lambda d: (d.clip_low, d.clip_high))(derive(load_config(BASE + list(keys)))) == bounds


def test_a_clip_ratio_that_no_end_uses_is_refused():
    """verl would train with 0.2 at both ends whatever clip_ratio says: refused here, not ignored."""
    with pytest.raises(ConfigError, match=r"clip_ratio=0.3 is not used: clip_ratio_low=0.2 and clip_ratio_high=0.2"):
        load_config(BASE + ["actor_rollout_ref.actor.clip_ratio=0.3"])


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.lr", "algorithm.kl_ctrl.kl_coef",
                                 "actor_rollout_ref.rollout.temperature", "critic.optim.lr"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_a_float_setting_must_be_finite(key, value):
    """lr=inf once trained NaN weights whose checkpoint was marked complete: every float key refuses inf and nan."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=-?(inf|nan) is not accepted: expected a finite number$"):
        load_config(BASE + [f"{key}={value}"])


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.ppo_micro_batch_size",
                                 "actor_rollout_ref.rollout.log_prob_micro_batch_size",
                                 "actor_rollout_ref.ref.log_prob_micro_batch_size", "critic.ppo_micro_batch_size",
                                 "critic.forward_micro_batch_size"])
def test_a_deprecated_global_micro_batch_beside_its_per_gpu_key_is_refused(key):
    """Each pair sizes the same passes; with both set one of them would be ignored."""
    both = [f"{key}=4", f"{key}_per_gpu=2"] + (["algorithm.adv_estimator=gae"] if key.startswith("critic") else [])
    with pytest.raises(ConfigError, match=rf"^set only one of {re.escape(key)} \(deprecated\) and {re.escape(key)}_per_gpu$"):
        load_config(BASE + both)
    load_config(BASE + both[1:])  # the per-GPU key alone is fine


@pytest.mark.parametrize("estimator", ["rloo", "gae", "opo", "reinforce_plus_plus"])
def test_norm_adv_by_std_in_grpo_false_is_refused_where_the_estimator_would_not_read_it(estimator):
    with pytest.raises(ConfigError, match=rf"^algorithm.norm_adv_by_std_in_grpo=False is read by adv_estimator grpo, "
                                          rf"gdpo, grpo_passk, grpo_vectorized only; adv_estimator={estimator} would"):
        load_config(BASE + [f"algorithm.adv_estimator={estimator}", "algorithm.norm_adv_by_std_in_grpo=False",
                            "critic.ppo_micro_batch_size_per_gpu=2"])
    load_config(BASE + ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False"])  # Dr.GRPO


def test_the_critics_global_value_forward_size_is_divided_over_its_data_parallel_groups():
    ppo = BASE + ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2"]
    assert derive(load_config(ppo + ["critic.forward_micro_batch_size=8"])).values_micro_batch_per_rank == 4  # 2 ranks
    assert derive(load_config(ppo)).values_micro_batch_per_rank == 2  # unset: the update's
    with pytest.raises(ConfigError, match=r"^critic.forward_micro_batch_size=7 \(global, deprecated\) is not divisible"):
        load_config(ppo + ["critic.forward_micro_batch_size=7"])


def test_a_reward_function_name_without_its_file_is_refused():
    """verl reads custom_reward_function.name only with .path: alone it would leave the built-in scorer running."""
    with pytest.raises(ConfigError, match=r"^custom_reward_function.name=my_fn names a function in "
                                          r"custom_reward_function.path, which is not set$"):
        load_config(BASE + ["custom_reward_function.name=my_fn"])
    load_config(BASE + ["custom_reward_function.name=compute_score"])  # verl's default, said out loud


@pytest.mark.parametrize("key,value,expected", [
    ("actor_rollout_ref.rollout.top_k", -5, "must be -1 or 0 (off) or >= 1"),
    ("actor_rollout_ref.rollout.val_kwargs.top_k", -2, "must be -1 or 0 (off) or >= 1"),
    ("actor_rollout_ref.rollout.val_kwargs.top_p", 0.0, "must be in (0, 1]"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature", -1.0, "must be >= 0"),
])
def test_sampling_settings_are_checked_at_load_naming_the_key(key, value, expected):
    """top_k=-5 was found only after the model had loaded, as 'SamplingConfig: top_k=-5 ...'."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(f'{key}={value} {expected}')}$"):
        load_config(BASE + [f"{key}={value}"])


def test_an_added_key_with_a_typo_gets_suggestions():
    with pytest.raises(ConfigError, match=r"does not declare and grpo_npu does not have\); did you mean "
                                          r"actor_rollout_ref\.actor\.ppo_mini_batch_size"):
        load_config(BASE + ["+actor_rollout_ref.actor.ppo_mini_batchsize=2"])


@pytest.mark.parametrize("setting", ["gpu_memory_utilization=0.3", "tensor_model_parallel_size=4", "max_num_seqs=8",
                                     "max_num_batched_tokens=100", "load_format=auto", "enable_prefix_caching=False"])
def test_vllm_engine_settings_are_refused_with_the_transformers_rollout(setting):
    """They used to be accepted and ignored with rollout.name=hf, which starts no engine."""
    name = setting.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^actor_rollout_ref\.rollout\.{name}=\S+ sets the vLLM engine, which "
                                          r"rollout\.name=hf does not start"):
        load_config(BASE + ["actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.rollout.{setting}"])
    if name != "tensor_model_parallel_size":  # 4 would not fit BASE's 2 ranks
        load_config(BASE + ["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.{setting}"])


def test_what_holds_for_the_transformers_rollout_too_is_accepted():
    load_config(BASE + ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                        "actor_rollout_ref.rollout.load_format=dummy"])


def test_validation_asked_for_without_validation_files_is_refused():
    with pytest.raises(ConfigError, match=r"^trainer\.test_freq=5 validates every 5 steps, but data\.val_files is empty"):
        load_config(BASE + ["trainer.test_freq=5"])
    with pytest.raises(ConfigError, match=r"^trainer\.val_only=True validates only, but data\.val_files is empty$"):
        load_config(BASE + ["trainer.val_only=True"])
    load_config(BASE + ["trainer.test_freq=5", "data.val_files=v.parquet"])
    load_config(BASE)  # val_before_train=True is the default: without files there is nothing to validate


def test_interpolations_on_the_command_line_resolve_against_the_whole_config(monkeypatch):
    """Hydra resolves ${...} in an override against the composed config: a key left at its default counts, and
    a resolver's colon is not a dict's."""
    monkeypatch.setenv("GRPO_NPU_TEST_RUN", "r7")
    cfg = load_config(BASE + ["trainer.experiment_name=run_${trainer.project_name}",
                              "trainer.default_local_dir=/tmp/${oc.env:GRPO_NPU_TEST_RUN}",
                              "data.train_files=t.parquet", "data.val_files=${data.train_files}"])
    assert cfg.trainer.experiment_name == f"run_{cfg.trainer.project_name}"
    assert cfg.trainer.default_local_dir == "/tmp/r7"
    assert list(cfg.data.val_files) == ["t.parquet"]
    with pytest.raises(ConfigError, match=r"^trainer\.experiment_name: Interpolation key 'trainer\.nope' not found"):
        load_config(BASE + ["trainer.experiment_name=${trainer.nope}"])


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_needs_sum_pi_squared_from_a_recomputed_old_log_prob_pass(estimator):
    otb = BASE + [f"algorithm.adv_estimator={estimator}"]
    with pytest.raises(ConfigError, match=rf"^algorithm\.adv_estimator={estimator} needs "
                                          r"actor_rollout_ref\.actor\.calculate_sum_pi_squared=True "):
        load_config(otb)
    one_mini_batch = BASE + ["actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    assert derive(load_config(one_mini_batch), 2).old_logp_from_update  # auto: the update's forward, nothing else asked
    for extra in (["actor_rollout_ref.actor.calculate_sum_pi_squared=True"],
                  ["actor_rollout_ref.actor.calculate_sum_pi_squared=True", f"algorithm.adv_estimator={estimator}"]):
        assert not derive(load_config(one_mini_batch + extra), 2).old_logp_from_update


def test_loss_scale_factor_of_actor_and_critic():
    d = derive(load_config(BASE + ["actor_rollout_ref.actor.loss_scale_factor=4096", "critic.loss_scale_factor=512"]), 2)
    assert (d.agg_horizon, d.critic_agg_horizon) == (4096, 512)
    d = derive(load_config(BASE), 2)
    assert d.agg_horizon == d.critic_agg_horizon == d.response_length
    with pytest.raises(ConfigError, match=r"^critic\.loss_scale_factor=0: expected a positive count or null$"):
        load_config(BASE + ["critic.loss_scale_factor=0"])


def test_max_samples_and_validation_shuffle_are_verls_keys():
    cfg = load_config(BASE + ["data.train_max_samples=100", "data.val_max_samples=20", "data.validation_shuffle=True"])
    assert (cfg.data.train_max_samples, cfg.data.val_max_samples, cfg.data.validation_shuffle) == (100, 20, True)
    with pytest.raises(ConfigError, match=r"^data\.val_max_samples=0: expected -1 \(all\) or > 0$"):
        load_config(BASE + ["data.val_max_samples=0"])


def test_verl_091_critic_engine_block_and_checkpoint_and_worker_keys():
    """verl 0.9.1 keeps the critic's FSDP settings in critic.fsdp (grpo_npu's critic.model.fsdp_config, older verl's
    home); a critic checkpoint retention equal to the actor's is what one shared checkpoint does; verl's
    legacy-worker switch runs the same algorithm at every value. Anything else is refused in one line."""
    ppo = BASE + ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=1"]
    fsdp = load_config(ppo + ["critic.fsdp.param_offload=True", "critic.fsdp.optimizer_offload=True",
                              "critic.fsdp.fsdp_size=1", "critic.fsdp.reshard_after_forward=False"]).critic.model.fsdp_config
    assert (fsdp.param_offload, fsdp.optimizer_offload, fsdp.fsdp_size, fsdp.reshard_after_forward) == (True, True, 1, False)
    assert load_config(ppo).critic.model.fsdp_config.param_offload is False
    with pytest.raises(ConfigError, match=r"^critic\.fsdp\.param_offload=True and critic\.model\.fsdp_config\.param_offload="
                                          r"False are one setting in grpo_npu"):
        load_config(ppo + ["critic.fsdp.param_offload=True", "critic.model.fsdp_config.param_offload=False"])
    load_config(ppo + ["trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1"])
    with pytest.raises(ConfigError, match=r"^not supported by grpo_npu: trainer\.max_critic_ckpt_to_keep=1 \(a critic "
                                          r"checkpoint retention of its own .*supported values: null, 2$"):
        load_config(ppo + ["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=1"])
    for value in ("auto", "disable", "enable"):
        load_config(BASE + [f"trainer.use_legacy_worker_impl={value}"])
    with pytest.raises(ConfigError, match=r"^not supported by grpo_npu: trainer\.use_legacy_worker_impl=v2 .*supported "
                                          r"values: auto, disable, enable$"):
        load_config(BASE + ["trainer.use_legacy_worker_impl=v2"])
    ep = "actor_rollout_ref.rollout.expert_parallel_size"
    assert load_config(BASE + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", f"{ep}=2"]).actor_rollout_ref.rollout.expert_parallel_size == 2
    with pytest.raises(ConfigError, match=rf"^{ep}=4: expected 1 or tensor_model_parallel_size=2 "):
        load_config(BASE + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", f"{ep}=4"])
    sizes = "actor_rollout_ref.rollout.cudagraph_capture_sizes"
    assert load_config(BASE + [f"{sizes}=[8, 16]"]).actor_rollout_ref.rollout.cudagraph_capture_sizes == (8, 16)
    for extra, message in ((["actor_rollout_ref.rollout.enforce_eager=True"], r"\[8\] with enforce_eager=True: an eager "
                                                                                 r"engine captures no graphs"),
                           (["actor_rollout_ref.rollout.name=hf"], r"\[8\] sets the vLLM engine"),
                           ([], None)):
        if message is None:
            with pytest.raises(ConfigError, match=rf"^{sizes}=\[0\]: expected a list of positive batch sizes$"):
                load_config(BASE + [f"{sizes}=[0]"])
            continue
        with pytest.raises(ConfigError, match=rf"^{sizes}={message}"):
            load_config(BASE + [f"{sizes}=[8]"] + extra)


def test_ulysses_sequence_parallelism_keys_and_their_limits():
    """verl's four homes of the Ulysses size act; the sizes change the per-rank arithmetic to data-parallel groups
    and the token budgets to the group's; what sequence parallelism cannot split is refused in one line."""
    sp = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    base = BASE + ["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_kl_loss=True"]
    cfg = load_config(base + ["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"])
    d = derive(cfg, 2)
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert (d.sp, d.ref_sp, d.critic_sp) == (2, 2, 1)  # the reference follows the actor, as verl interpolates it
    assert d.mini_batch_responses_per_rank == 4  # ppo_mini_batch_size x n = 4 x 1 over ONE data-parallel group of 2
    assert d.log_prob_max_token_len == 2 * cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    d = derive(load_config(base + [f"{sp}=2", "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=1",
                                   "critic.fsdp.ulysses_sequence_parallel_size=2", "critic.model.use_remove_padding=True"]), 2)
    assert (d.sp, d.ref_sp, d.critic_sp) == (2, 1, 2)
    with pytest.raises(ConfigError, match=rf"^actor_rollout_ref\.actor\.fsdp_config\.ulysses_sequence_parallel_size=4 "
                                          rf"and {sp}=2 are one setting in grpo_npu \({sp}\); give it once$"):
        load_config(base + ["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4", f"{sp}=2"])
    with pytest.raises(ConfigError, match=rf"^{sp}=2 splits packed rows: set actor_rollout_ref\.model\.use_remove_padding=True$"):
        load_config(BASE + [f"{sp}=2"])
    with pytest.raises(ConfigError, match=r"^critic\.ulysses_sequence_parallel_size=2 splits packed rows: set "
                                          r"critic\.model\.use_remove_padding=True$"):
        load_config(BASE + ["critic.ulysses_sequence_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.share_prompt_prefix=True packs each prompt once"):
        load_config(base + [f"{sp}=2", "actor_rollout_ref.model.share_prompt_prefix=True"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.ref\.ulysses_sequence_parallel_size=1: with LoRA the "
                                          r"reference is the actor's module"):
        load_config(base + [f"{sp}=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
                            "actor_rollout_ref.model.lora_rank=8"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.compile_layers=True compiles each decoder layer"):
        load_config(base + [f"{sp}=2", "actor_rollout_ref.model.compile_layers=True"])
    with pytest.raises(ConfigError, match=rf"^{sp}=3 must be >= 1 and divide the 2 ranks"):
        load_config(base + [f"{sp}=3"])
