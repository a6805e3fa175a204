"""verl's whole key surface is known: every key of verl 0.9.1's config is mapped or has a disposition, the
example corpus (tests/verl/) is accepted or refused in one line, and Hydra's forms behave as in verl."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo_npu.config import ConfigError, load_config, split_argv, to_dict
from grpo_npu.config.keys import schema_node
from grpo_npu.config.loading import read_overrides
from grpo_npu.config.support import alias, check_verl_value, rule_for
from grpo_npu.config.verl_keys import MISSING, interpolation, verl_keys

HERE = Path(__file__).resolve().parent / "verl"
BASE = ["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
DUMMIES = {"{TINY_MODEL}": "/tmp/t/model", "{TRAIN_PARQUET}": "/tmp/t/train.parquet",
           "{VAL_PARQUET}": "/tmp/t/val.parquet", "{RUN_DIR}": "/tmp/t/run", "{VERL_ROOT}": "/tmp/t/verl"}
# fsdp, text-only corpus lines (no guessed feature) that use something grpo_npu does not have: the first key refused
NOT_IMPLEMENTED = {
    "global_profiler.tool": "nsys, torch_memory",
    "hydra.searchpath": "Megatron-lite through a Hydra search path",
    "actor_rollout_ref.model.use_shm": "model loading through shared memory",
    "+actor_rollout_ref.actor.fsdp_config.model_dtype": "a + on a key verl 0.9.1 declares (Hydra refuses it too)",
}


def _corpus() -> list[dict]:
    return [json.loads(line) for line in (HERE / "verl_example_command_lines.jsonl").read_text().splitlines()]


def _outcome(args: list[str]) -> tuple[str, str]:
    for placeholder, value in DUMMIES.items():
        args = [a.replace(placeholder, value) for a in args]
    try:
        cmd = split_argv(args)
        load_config(cmd.overrides, cmd.yaml_path)
    except ConfigError as exc:
        return "refused", str(exc)
    return "accepted", ""


def test_every_verl_key_is_mapped_or_has_a_disposition():
    loaded = to_dict(load_config(BASE))
    for key, row in verl_keys().items():
        if schema_node(alias(key).split("."))[0] != "unknown":
            continue  # mapped onto grpo_npu's schema
        assert read_overrides([f"~{key}"]).deleted  # known: ~key is not an unknown key
        if row.default != MISSING and (rule_for(key) is None or rule_for(key).accepted is None):
            check_verl_value(key, json.dumps(row.default) if interpolation(row.default) is None else
                             json.dumps(_resolved(key, loaded)), loaded)  # verl's default: accepted
        with pytest.raises(ConfigError, match=rf"^not supported by grpo_npu: {key}="):
            check_verl_value(key, "[not, a, supported, value]", loaded)


def _resolved(key, loaded):
    from grpo_npu.config.support import verl_default
    return verl_default(key, loaded)[1]


def test_only_keys_verl_does_not_know_get_suggestions():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref\.actor\.grad_clipp'.*did you mean"):
        load_config(BASE + ["actor_rollout_ref.actor.grad_clipp=1"])
    with pytest.raises(ConfigError, match=r"^not supported by grpo_npu: data\.image_key=img \(vision-language"):
        load_config(BASE + ["data.image_key=img"])
    load_config(BASE + ["data.image_key=images", "actor_rollout_ref.ref.use_torch_compile=False"])  # verl's defaults


def test_second_homes_act():
    cfg = load_config(BASE + ["ray_kwargs.ray_init.num_cpus=3", "ray_kwargs.ray_init.runtime_env.py_executable=py",
                              "actor_rollout_ref.actor.optim.clip_grad=0.5", "reward.reward_manager.name=dapo"])
    assert cfg.ray_init.num_cpus == 3 and cfg.ray_init.runtime_env["py_executable"] == "py"
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5 and cfg.reward_model.reward_manager == "dapo"
    prefix = load_config(BASE + ["actor_rollout_ref.actor.use_prefix_grouper=True"])  # verl's PrefixGrouper
    assert prefix.actor_rollout_ref.model.share_prompt_prefix is True


@pytest.mark.parametrize("key,value,feature", [
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "2", "Megatron"),
    ("actor_rollout_ref.actor.strategy", "megatron", "training backend"),
    ("actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.ulysses_parallel_size", "2", "fsdp_turbo"),
    ("model_engine", "veomni", "model engine"),
    ("+algorithm.rollout_correction.rollout_token_veto_threshold", "0.1", "rollout correction"),
])
def test_whole_features_are_refused_naming_the_feature(key, value, feature):
    with pytest.raises(ConfigError, match=rf"^not supported by grpo_npu: {re.escape(key.lstrip('+'))}={value} \([^)]*{feature}"):
        load_config(BASE + [f"{key}={value}"])


def test_hydra_prefixes_behave_as_in_verl(tmp_path):
    with pytest.raises(ConfigError, match=r"verl already declares trainer\.total_epochs.*\+\+trainer\.total_epochs"):
        load_config(BASE + ["+trainer.total_epochs=3"])
    assert load_config(BASE + ["++trainer.total_epochs=3"]).trainer.total_epochs == 3
    assert load_config(BASE + ["+trainer.max_bad_steps=5"]).trainer.max_bad_steps == 5  # verl lacks it: + adds it
    yaml = tmp_path / "c.yaml"
    yaml.write_text("trainer:\n  total_epochs: 7\n")
    assert load_config(BASE + ["~trainer.total_epochs"], str(yaml)).trainer.total_epochs == 30  # back to default
    assert load_config(BASE + ["trainer.total_epochs=4", "~trainer.total_epochs"]).trainer.total_epochs == 30
    with pytest.raises(ConfigError, match=r"^not supported by grpo_npu: \+data\.no_such_key=1"):
        load_config(BASE + ["+data.no_such_key=1"])


@pytest.mark.parametrize("value, expected", [
    ("{rms_norm:[native],fused_add_rms_norm:[native]}", {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}),
    ("{a:1}", {"a": 1}),  # YAML alone reads this as the key 'a:1' with no value
    ("{a: 1, b: [x, y]}", {"a": 1, "b": ["x", "y"]}),  # YAML's own spacing still reads the same
    ("{a:{b:2},c:true}", {"a": {"b": 2}, "c": True}),
    ("{url:http://h:80/x}", {"url": "http://h:80/x"}),  # only the key's colon separates
    ("{a:'x:y,z'}", {"a": "x:y,z"}),  # quoted text untouched
    ("[1,2,3]", [1, 2, 3]),
])
def test_hydra_dict_and_list_values_read_as_in_verl(value, expected):
    cfg = load_config(BASE + [f"+actor_rollout_ref.rollout.engine_kwargs.vllm.k={value}"])
    assert to_dict(cfg)["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]["k"] == expected


def test_an_unreadable_value_is_one_line_naming_the_item():
    item = "+actor_rollout_ref.rollout.engine_kwargs.vllm.k={a:[x"
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.engine_kwargs\.vllm\.k=\{a:\[x: cannot read the "
                                          r"value \(while parsing a flow sequence\)") as err:
        load_config(BASE + [item])
    assert "\n" not in str(err.value)


def test_verl_builtin_config_names():
    default = load_config(BASE)
    for name in ("ppo_trainer", "ppo_trainer.yaml"):
        cmd = split_argv(["--config-path=config", f"--config-name={name}"] + BASE)
        assert cmd.yaml_path is None and load_config(cmd.overrides) == default
    cmd = split_argv(["--config-path=config", "--config-name=dapo_trainer"] + BASE)
    assert load_config(cmd.overrides).reward_model.reward_manager == "dapo"
    with pytest.raises(ConfigError, match=r"^not supported by grpo_npu: --config-name=ppo_megatron_trainer \(the Megatron"):
        split_argv(["--config-path=config", "--config-name=ppo_megatron_trainer"])


def test_corpus_lines_are_accepted_or_refused_in_one_line():
    lines = _corpus()
    assert len(lines) >= 50
    for r in lines:
        kind, message = _outcome(r["args"])
        assert "unknown config key" not in message and "\n" not in message, (r["script"], message)
        if kind == "refused":  # the message names the key (or the config name) it refuses
            named = message.startswith("not supported by grpo_npu: ") or re.search(r"[a-z_]+\.[a-z_.]+", message)
            assert named, message


def test_plain_fsdp_text_lines_are_accepted():
    """Every fsdp, text-only line that uses only what grpo_npu has is accepted (the rest name what is missing)."""
    for r in _corpus():
        if r["backend"] != "fsdp" or r["features"]:
            continue
        kind, message = _outcome(r["args"])
        if kind == "refused":
            named = [k for k in NOT_IMPLEMENTED if k + "=" in message or f"'{k}'" in message]
            assert named, (r["script"], message)


@pytest.mark.parametrize("script", ["examples/cispo_trainer/run_qwen3_8b_fsdp.sh", "examples/gmpo_trainer/run_qwen3_8b_fsdp.sh",
                                    "examples/gpg_trainer/run_qwen3_8b_fsdp.sh", "examples/remax_trainer/run_qwen3_8b_fsdp.sh"])
def test_verls_other_loss_mode_examples_are_accepted(script):
    """verl's CISPO, GMPO, GPG and ReMax example command lines (loss modes, the gpg and remax estimators) run as
    they are."""
    lines = [r for r in _corpus() if r["script"] == script]
    assert lines
    for r in lines:
        assert _outcome(r["args"]) == ("accepted", ""), (script, r["env"])


def test_the_weight_transfer_bucket_runs_the_same_and_other_checkpoint_engines_are_refused():
    key = "actor_rollout_ref.rollout.checkpoint_engine"
    cfg = load_config(BASE + [f"{key}.update_weights_bucket_megabytes=4096"])
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes == 4096
    with pytest.raises(ConfigError, match=rf"^{key}\.update_weights_bucket_megabytes=0 must be > 0$"):
        load_config(BASE + [f"{key}.update_weights_bucket_megabytes=0"])
    with pytest.raises(ConfigError, match=rf"{key}\.backend=nccl \(verl's checkpoint engines .*supported values: naive$"):
        load_config(BASE + [f"{key}.backend=nccl"])


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.entropy_checkpointing",
                                 "actor_rollout_ref.actor.entropy_checkpointing",
                                 "actor_rollout_ref.ref.entropy_from_logits_with_chunking",
                                 "actor_rollout_ref.actor.fsdp_config.use_orig_params",
                                 "critic.model.fsdp_config.use_orig_params",
                                 "actor_rollout_ref.rollout.multi_stage_wake_up"])
def test_switches_grpo_npu_always_has_take_either_value(key):
    for value in ("True", "False"):
        load_config(BASE + [f"{key}={value}"])
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}"):
        load_config(BASE + [f"{key}=sometimes"])


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.megatron.entropy_from_logits_with_chunking",
                                 "actor_rollout_ref.actor.veomni.entropy_checkpointing"])
def test_the_same_switch_of_an_engine_grpo_npu_lacks_is_refused_for_the_engine(key):
    with pytest.raises(ConfigError, match=r"the (Megatron backend|VeOmni engine)"):
        load_config(BASE + [f"{key}=True"])


def test_a_verl_yaml_is_read_with_the_same_dispositions(tmp_path):
    """A YAML holding verl keys grpo_npu lacks: accepted at verl's defaults, refused otherwise, aliases mapped."""
    good = tmp_path / "good.yaml"
    good.write_text("actor_rollout_ref:\n  rollout:\n    multi_turn:\n      enable: false\n"
                    "ray_kwargs:\n  ray_init:\n    num_cpus: 5\ndata:\n  image_key: images\n")
    cfg = load_config(BASE, str(good))
    assert cfg.ray_init.num_cpus == 5
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_rollout_ref:\n  rollout:\n    multi_turn:\n      enable: true\n")
    with pytest.raises(ConfigError, match=r"^not supported by grpo_npu: actor_rollout_ref\.rollout\.multi_turn\.enable="
                                          r"true \(multi-turn"):
        load_config(BASE, str(bad))


def test_the_table_has_no_dead_rows():
    """Each alias lands on a grpo_npu key; each pattern matches a key of verl's list, the schema or the corpus."""
    import fnmatch

    from grpo_npu.config.keys import all_keys
    from grpo_npu.config.support import ALIAS, RULES

    corpus_keys = {a.lstrip("+~").split("=", 1)[0] for r in _corpus() for a in r["args"] if not a.startswith("-")}
    known = set(verl_keys()) | set(all_keys()) | corpus_keys
    for rule in RULES:
        assert any(fnmatch.fnmatchcase(k, rule.pattern) for k in known), f"no key matches {rule.pattern!r}"
        if rule.action == ALIAS:
            target = rule.target.rstrip("*").rstrip(".")
            assert schema_node(target.split("."))[0] in ("leaf", "section"), rule
