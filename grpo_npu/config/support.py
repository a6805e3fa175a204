"""What grpo_npu does with each verl key its schema lacks, and with each of its own keys it does not act on.

One table, :data:`RULES`, read top to bottom, first match wins (``fnmatch`` patterns over dotted keys):

- ``ALIAS``: verl has two homes for the setting (``ray_kwargs.ray_init.*`` and ``ray_init.*``, the
  ``reward.*`` section and ``reward_model.*``, ...); the key means the grpo_npu key named by ``target``.
- ``REFUSE``: accepted at the values in ``accepted`` (``None``: verl's default, with verl's
  interpolations resolved against the loaded config), refused otherwise in one line naming the key, the
  value, the feature and the supported values. A schema key listed here is one grpo_npu keeps for verl's
  command lines without acting on any other value (``tests/test_config_fields.py`` holds every schema key
  read nowhere to such a row).
- ``SAME``: the values in ``accepted`` all run the same in grpo_npu (``feature`` says why); others are refused.
- A verl key no rule matches is accepted at verl's default and refused otherwise (``GENERIC``).

A feature that lands flips its rows (e.g. ``algorithm.rollout_correction.*``) from ``REFUSE`` to schema
keys; nothing else changes. Torch-free.
"""

from __future__ import annotations

import fnmatch
import functools
import json
from dataclasses import dataclass
from typing import Any

import yaml

from grpo_npu.config.verl_keys import MISSING, config_defaults, interpolation, is_verl_key, verl_keys
from grpo_npu.errors import ConfigError

ALIAS, REFUSE, SAME = "alias", "refuse", "same"

# The features grpo_npu does not have, named once: a refusal says which one a key belongs to.
MEGATRON = "the Megatron backend; grpo_npu trains with FSDP2"
BACKEND = "a training backend other than FSDP2 (megatron, fsdp_turbo, veomni, torchtitan)"
MODEL_ENGINE = "a model engine other than verl's dp (FSDP) engine"
VEOMNI = "the VeOmni engine"
TORCHTITAN = "the TorchTitan engine"
FSDP_TURBO = "the fsdp_turbo engine"
VISION = "vision-language data (images, videos, audio)"
ROLLOUT_CORRECTION = "rollout correction (algorithm.rollout_correction)"
LORA_CRITIC = "LoRA on the critic (the actor takes actor_rollout_ref.model.lora_rank)"
QAT = "quantization-aware training"
MTP = "multi-token prediction"
MULTI_TURN = "multi-turn, tool-calling and agent-loop rollouts"
DISTILLATION = "distillation"
REWARD_MODEL = "model-based rewards (a reward model or reward loop)"
PROFILER = ("a profiler setting grpo_npu does not have (it has global_profiler.tool / steps / save_path and each "
            "role's profiler.enable / ranks / all_ranks / tool_config.torch|npu)")
TRANSFER_QUEUE = "TransferQueue"
ROLLOUT_SKIP = "rollout dumping and skipping"
ASYNC_TRAINER = "verl's asynchronous trainer modes"
DISAGGREGATION = "prefill/decode disaggregation"
CHECKPOINT_ENGINE = "verl's checkpoint engines (weight transfer between processes or machines); grpo_npu's engine shares the trainer's process"
HYDRA = "Hydra's own settings and config-group choices; grpo_npu reads key=value overrides"
TORCH_COMPILE = "torch.compile of the log-prob computation"
GENERIC = ""


@dataclass(frozen=True)
class Rule:
    """What happens to the keys matching ``pattern``."""

    pattern: str
    action: str = REFUSE
    feature: str = GENERIC
    accepted: tuple | None = None
    target: str = ""


def _refuse(feature: str, *patterns: str, accepted: tuple | None = None) -> list[Rule]:
    return [Rule(p, REFUSE, feature, accepted) for p in patterns]


RULES: tuple[Rule, ...] = tuple([
    # verl's second home of a setting grpo_npu has
    Rule("ray_kwargs.ray_init.num_cpus", ALIAS, target="ray_init.num_cpus"),
    Rule("ray_kwargs.ray_init.runtime_env*", ALIAS, target="ray_init.runtime_env"),
    Rule("ray_kwargs.timeline_json_file", ALIAS, target="ray_init.timeline_json_file"),
    Rule("reward.custom_reward_function.path", ALIAS, target="custom_reward_function.path"),
    Rule("reward.custom_reward_function.name", ALIAS, target="custom_reward_function.name"),
    Rule("reward.reward_manager.name", ALIAS, target="reward_model.reward_manager"),
    Rule("reward.reward_model.enable", ALIAS, target="reward_model.enable"),
    Rule("reward.num_workers", ALIAS, target="reward_model.num_workers"),
    Rule("reward.reward_kwargs.overlong_buffer_cfg.*", ALIAS, target="reward_model.overlong_buffer.*"),
    Rule("reward_model.reward_kwargs.overlong_buffer_cfg.*", ALIAS, target="reward_model.overlong_buffer.*"),
    *_refuse("a DAPO length other than data.max_response_length", "reward.reward_kwargs.max_resp_len",
             "reward_model.reward_kwargs.max_resp_len", accepted=(None, "${data.max_response_length}")),
    *[Rule(f"actor_rollout_ref.actor.policy_loss.{tau}", REFUSE,
           f"verl's SAPO loss reads actor_rollout_ref.actor.{tau} and leaves this copy in the policy_loss block unread: "
           f"set actor_rollout_ref.actor.{tau}", (f"${{actor_rollout_ref.actor.{tau}}}",)) for tau in ("tau_pos", "tau_neg")],
    Rule("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", ALIAS,
         target="actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    Rule("actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size", ALIAS,
         target="actor_rollout_ref.ref.ulysses_sequence_parallel_size"),
    Rule("critic.fsdp.ulysses_sequence_parallel_size", ALIAS, target="critic.ulysses_sequence_parallel_size"),
    # verl 0.9.1's critic engine block (critic.fsdp) is grpo_npu's critic.model.fsdp_config (older verl's home)
    *[Rule(f"critic.fsdp.{key}", ALIAS, target=f"critic.model.fsdp_config.{key}")
      for key in ("param_offload", "optimizer_offload", "offload_policy", "reshard_after_forward", "fsdp_size",
                  "forward_prefetch", "model_dtype", "use_no_sync_for_gradient_accumulation")],
    # verl's PrefixGrouper: each prompt's forward shared by its responses, what share_prompt_prefix does
    Rule("actor_rollout_ref.actor.use_prefix_grouper", ALIAS, target="actor_rollout_ref.model.share_prompt_prefix"),
    Rule("actor_rollout_ref.actor.optim.clip_grad", ALIAS, target="actor_rollout_ref.actor.grad_clip"),
    Rule("critic.optim.clip_grad", ALIAS, target="critic.grad_clip"),
    Rule("actor_rollout_ref.actor.optim.lr_scheduler_type", ALIAS, target="actor_rollout_ref.actor.optim.warmup_style"),
    Rule("critic.optim.lr_scheduler_type", ALIAS, target="critic.optim.warmup_style"),
    # schema keys grpo_npu keeps for verl's command lines, acting on no other value
    *_refuse("only the colocated hybrid engine", "actor_rollout_ref.hybrid_engine", accepted=(True,)),
    *_refuse("Liger kernels (CUDA-only; actor_rollout_ref.model.use_fused_kernels=True uses grpo_npu.ops)",
             "actor_rollout_ref.model.use_liger", accepted=(False,)),
    *_refuse("HDFS upload", "trainer.default_hdfs_dir", accepted=(None,)),
    *_refuse("deleting the local checkpoint after loading it (with no HDFS copy here it is the only one)",
             "trainer.del_local_ckpt_after_load", accepted=(False,)),
    *_refuse("scoring in the background", "reward_model.launch_reward_fn_async", accepted=(False,)),
    *_refuse("asynchronous checkpoint saves (verl implements them for its Megatron backend only)",
             "*.checkpoint.async_save", accepted=(False,)),
    *_refuse("a critic checkpoint retention of its own (the critic is saved in the same checkpoint: "
             "trainer.max_actor_ckpt_to_keep)", "trainer.max_critic_ckpt_to_keep",
             accepted=(None, "${trainer.max_actor_ckpt_to_keep}")),
    Rule("data.return_raw_chat", SAME,
         "verl keeps the messages for rollouts that template them themselves (its agent loop); grpo_npu's single-turn "
         "rollout generates from the prompt as the dataset templates it, the same tokens", (False, True)),
    *_refuse("keeping the templated prompt text", "data.return_full_prompt", accepted=(False,)),
    *_refuse("raw input ids for a reward model with its own tokenizer", "data.return_raw_input_ids", accepted=(False,)),
    *_refuse("data-loader worker processes (prompts are tokenized up front)", "data.dataloader_num_workers",
             accepted=(0,)),
    *_refuse("module buffers in another dtype (FSDP2 keeps buffers as loaded)", "*.mixed_precision.buffer_dtype",
             accepted=("float32", "fp32")),
    *_refuse("custom FSDP wrap policies (FSDP2 wraps each decoder layer, then the root)", "*.fsdp_config.wrap_policy",
             accepted=({}, {"min_num_params": 0})),
    *_refuse("custom FSDP wrap policies (FSDP2 wraps each decoder layer, then the root)",
             "*.fsdp_config.wrap_policy.min_num_params", accepted=(0,)),
    *_refuse(TORCH_COMPILE, "*use_torch_compile", accepted=(False,)),
    Rule("trainer.use_legacy_worker_impl", SAME,
         "verl's switch between its legacy FSDP workers and its model-engine workers, which run the same algorithm; "
         "grpo_npu has one worker implementation (newer verl removed the legacy one)", ("auto", "disable", "enable")),
    # whole features
    *_refuse(HYDRA, "hydra.*", "*@*", accepted=()),
    *_refuse(MEGATRON, "*.megatron.*", accepted=None),
    *_refuse(BACKEND, "*.strategy", accepted=("fsdp", "fsdp2")),
    *_refuse(MODEL_ENGINE, "model_engine", "*.model_engine", accepted=("dp",)),
    *_refuse(MODEL_ENGINE, "*.engine.*"),
    *_refuse(VEOMNI, "*.veomni.*"),
    *_refuse(TORCHTITAN, "*.torchtitan.*"),
    *_refuse(FSDP_TURBO, "*.turbo_config.*"),
    *_refuse(VISION, "data.image_key", "data.video_key", "data.audio_key", "data.image_patch_size",
             "data.return_multi_modal_inputs", "data.mm_processor_kwargs*", "*freeze_vision*", "*limit_images"),
    *_refuse(ROLLOUT_CORRECTION, "algorithm.rollout_correction.*"),
    Rule("actor_rollout_ref.rollout.mode", SAME,
         "verl 0.9.1 has only async, its single-turn agent loop, which samples each prompt's n responses from the "
         "chat-templated prompt as grpo_npu's rollout does (older verl's sync generated them in one batch); one "
         "difference: verl's loop left-truncates a prompt longer than data.max_prompt_length whatever "
         "data.truncation says. Multi-turn and tool agent loops are refused by their own keys", ("async", "sync")),
    Rule("actor_rollout_ref.rollout.layered_summon", SAME,
         "verl gathers the FSDP weights one layer at a time for a LoRA sync when it is on; grpo_npu's sync always "
         "gathers one tensor at a time, workers/fsdp.py::iter_full_state_dict", (False, True)),
    *_refuse("the Megatron engine's LoRA block (FSDP LoRA: actor_rollout_ref.model.lora_rank / lora_alpha / "
             "target_modules; of the block only lora.merge is grpo_npu's)", "actor_rollout_ref.model.lora.*"),
    *_refuse(LORA_CRITIC, "critic.model.lora_*", "critic.model.lora.*", "critic.model.target_modules",
             "critic.model.exclude_modules"),
    *_refuse(QAT, "*.qat", "*.qat.*"),
    *_refuse(MTP, "actor_rollout_ref.model.mtp.*", "actor_rollout_ref.rollout.mtp"),
    *_refuse(MULTI_TURN, "actor_rollout_ref.rollout.multi_turn.*", "actor_rollout_ref.rollout.agent.*",
             "data.tool_config_path", "data.function_tool_path", "*sandbox_fusion.*"),
    *_refuse(DISTILLATION, "distillation.*"),
    *_refuse(REWARD_MODEL, "reward_model.enable", accepted=(False,)),
    *_refuse(REWARD_MODEL, "reward.reward_model.*", "reward_model.model.*", "reward_model.rollout.*",
             "reward_model.enable_resource_pool", "reward_model.n_gpus_per_node", "reward_model.nnodes",
             "reward_model.reward_loop_*", "reward.reward_manager.*"),
    *_refuse("nsys (the workers would have to start under Nsight Systems), torch_memory and precision_debugger",
             "global_profiler.tool", accepted=(None, "torch", "npu")),
    Rule("*profiler.relocate_results", SAME, "verl moves the traces a framework writes elsewhere (its vLLM server's "
         "profiler) into save_path; grpo_npu's engine runs in the worker's process and every trace is written into "
         "save_path", accepted=(False, True)),
    *_refuse(PROFILER, "*profiler.*"),
    *_refuse(TRANSFER_QUEUE, "transfer_queue.*"),
    *_refuse(ROLLOUT_SKIP, "skip.*"),
    *_refuse(ASYNC_TRAINER, "trainer.v1.*", "trainer.use_v1"),
    *_refuse(DISAGGREGATION, "actor_rollout_ref.rollout.disaggregation.*"),
    Rule("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", SAME,
         "verl packs the weights into buckets of this size for its transfer into the vLLM server process; grpo_npu's "
         "engine lives in the trainer's process and loads one tensor at a time, with no buffer to size"),
    *_refuse(CHECKPOINT_ENGINE, "actor_rollout_ref.rollout.checkpoint_engine.*"),
    # memory switches verl offers and grpo_npu always has on (after the whole-engine rules above: first match wins)
    *[Rule(p, SAME, "grpo_npu's log-prob and entropy op always works in row chunks and recomputes each chunk's softmax "
                    "in the backward pass (grpo_npu/ops/logprob.py), which is what this switch turns on in verl",
           accepted=(False, True)) for p in ("*entropy_checkpointing", "*entropy_from_logits_with_chunking")],
    Rule("*.use_orig_params", SAME, "an FSDP1 flag; grpo_npu's FSDP2 (fully_shard) always keeps each original "
                                    "parameter, as one DTensor", accepted=(False, True)),
    Rule("actor_rollout_ref.rollout.multi_stage_wake_up", SAME,
         "verl reads it for its SGLang rollout only (its rollout.yaml); its vLLM rollout, as grpo_npu's, does not",
         accepted=(False, True)),
])


# verl's built-in config names (``--config-name``): "" = grpo_npu's defaults (plus the recipe's own
# defaults from verl's key list, for the DAPO recipe), else the feature the config is made for.
BUILTIN_CONFIGS: dict[str, str] = {
    "ppo_trainer": "", "dapo_trainer": "", "ppo_megatron_trainer": MEGATRON, "dapo_megatron_trainer": MEGATRON,
    "ppo_torchtitan_trainer": TORCHTITAN, "ppo_veomni_trainer": VEOMNI, "dapo_qat_trainer": QAT,
    "dapo_qat_megatron_trainer": QAT, "deepeyes_multiturn_grpo": MULTI_TURN,
}
RECIPE_DEFAULTS = {"dapo_trainer": "dapo_recipe"}  # the key-list config whose defaults the name brings


def builtin_config(name: str) -> list[str]:
    """The overrides a verl built-in config name stands for; a one-line refusal for one grpo_npu cannot run."""
    base = name.rsplit("/", 1)[-1].removesuffix(".yaml").removesuffix(".yml")
    feature = BUILTIN_CONFIGS[base]
    if feature:
        raise ConfigError(f"not supported by grpo_npu: --config-name={name} ({feature})")
    recipe = config_defaults(RECIPE_DEFAULTS[base]) if base in RECIPE_DEFAULTS else {}
    return [f"{k}={json.dumps(v)}" for k, v in recipe.items() if interpolation(v) is None and not isinstance(v, (dict, list))]


def is_builtin_config(name: str) -> bool:
    """Whether ``name`` is one of verl's built-in config names (with or without .yaml)."""
    return name.rsplit("/", 1)[-1].removesuffix(".yaml").removesuffix(".yml") in BUILTIN_CONFIGS


@functools.cache
def rule_for(key: str) -> Rule | None:
    """The first rule matching ``key`` (None: no rule; a verl key is then accepted at verl's default only)."""
    return next((r for r in RULES if fnmatch.fnmatchcase(key, r.pattern)), None)


def alias(key: str) -> str:
    """The grpo_npu key a verl key means (``key`` itself when it has no second home)."""
    rule = rule_for(key)
    if rule is None or rule.action != ALIAS:
        return key
    if rule.pattern.endswith("*"):
        return rule.target.rstrip("*") + key[len(rule.pattern) - 1:]
    return rule.target


def hydra_flow_to_yaml(text: str) -> str:
    """Hydra's dict values in YAML's flow syntax: ``{a:1,b:[x]}`` -> ``{a: 1,b: [x]}``.

    Hydra separates a dict key from its value by a bare colon; YAML needs a space after it, and without one
    reads ``{a:1}`` as the key ``'a:1'`` and ``{a:[x]}`` not at all. Only the first colon after a key of a
    ``{...}`` is touched (a value keeps its own: ``{url:http://h}``); quoted text is left alone."""
    out: list[str] = []
    brackets: list[str] = []
    quote = ""
    at_key = False
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "{[":
            brackets.append(ch)
            at_key = ch == "{"
        elif ch in "}]":
            if brackets:
                brackets.pop()
            at_key = False
        elif ch == ",":
            at_key = bool(brackets) and brackets[-1] == "{"
        elif ch == ":" and at_key:
            out.append(": ")
            at_key = False
            continue
        out.append(ch)
    return "".join(out)


def parse_value(text: str) -> Any:
    """A command-line value as Hydra reads it (``True`` -> True, ``null`` -> None, ``[a,b]`` -> a list,
    ``{a:1}`` -> a dict)."""
    try:
        value = yaml.safe_load(hydra_flow_to_yaml(text)) if text.strip() else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):  # YAML 1.1 reads 1e-08 as text; Hydra as a float
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, str) and a.lower() == str(b).lower())
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _lookup(tree: dict, key: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def verl_default(key: str, loaded: dict) -> tuple[bool, Any]:
    """(known, value): verl's default of ``key``, its interpolations resolved against the ``loaded`` config."""
    row = verl_keys().get(key)
    if row is None or row.default == MISSING:
        return False, None
    default = row.default
    for _ in range(8):  # interpolation chains are short; a cycle ends here
        ref = interpolation(default)
        if ref is None:
            return True, default
        target, fallback = ref
        if target.startswith("."):
            target = key.rsplit(".", 1)[0] + target
        found, value = _lookup(loaded, alias(target))
        if found:
            return True, value
        if target in verl_keys():
            key, default = target, verl_keys()[target].default
            continue
        return True, parse_value(fallback) if fallback is not None else None
    return False, None


def accepted_values(key: str, loaded: dict) -> tuple:
    """The values of ``key`` grpo_npu accepts: its rule's, else verl's default (empty: none)."""
    rule = rule_for(key)
    if rule is not None and rule.accepted is not None:
        return tuple(_lookup(loaded, ref[0])[1] if (ref := interpolation(v)) else v for v in rule.accepted)
    known, default = verl_default(key, loaded)
    return (default,) if known else ()


def _shown(values: tuple) -> str:
    return ", ".join("null" if v is None else str(v) for v in values) or "none (leave it unset)"


def refusal(key: str, raw: str, accepted: tuple) -> ConfigError:
    """The one-line refusal of ``key=raw``, naming its feature and what is supported."""
    rule = rule_for(key)
    feature = f" ({rule.feature})" if rule is not None and rule.feature else ""
    return ConfigError(f"not supported by grpo_npu: {key}={raw}{feature}; supported values: {_shown(accepted)}")


def limit_note(key: str) -> str:
    """For ``--help``: the values a schema key is limited to and the feature other values need, or why every value
    runs the same ('' when neither)."""
    rule = rule_for(key)
    if rule is not None and rule.action == SAME:
        return f"Every value runs the same here: {rule.feature}."
    if rule is None or rule.action != REFUSE or rule.accepted is None or not rule.feature:
        return ""
    return f"Only {_shown(rule.accepted)} here; other values are refused (not in grpo_npu: {rule.feature})."


def check_verl_value(key: str, raw: str, loaded: dict) -> None:
    """Accept ``key=raw`` (a key grpo_npu's schema lacks) at an accepted value; else a one-line refusal."""
    accepted = accepted_values(key, loaded)
    if not any(_same(parse_value(raw), v) for v in accepted):
        raise refusal(key, raw, accepted)


def refused_schema_keys(keys: tuple[str, ...]) -> list[str]:
    """The schema keys (of ``keys``) a REFUSE rule limits to its accepted values."""
    return [k for k in keys if (r := rule_for(k)) is not None and r.action == REFUSE and r.accepted is not None]


def check_schema_values(loaded: dict, keys: tuple[str, ...]) -> None:
    """Refuse a schema key set to a value its REFUSE rule does not accept (the config as a nested dict)."""
    for key in refused_schema_keys(keys):
        _, value = _lookup(loaded, key)
        accepted = accepted_values(key, loaded)  # the rule's, interpolations resolved
        if not any(_same(value, v) for v in accepted):
            raise refusal(key, "null" if value is None else str(value), accepted)


def known_to_verl(key: str) -> bool:
    """Whether verl knows ``key`` (declares it, or a rule covers its family)."""
    return is_verl_key(key) or rule_for(key) is not None
