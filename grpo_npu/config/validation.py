"""Validation of a loaded config: accepted values, unsupported features, the batch-size arithmetic.

Each message names the key, its value and what is accepted. The accepted values of a ``choice``
field are the ones the owning code declares in its torch-free ``names`` module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Mapping

from grpo_npu.algo.names import (FILTER_METRICS, NORM_BY_STD_READERS, POLICY_LOSS_PARAMS, POLICY_LOSS_READS,
                                 ROLLOUT_IS_LEVELS, parse_rollout_is_threshold, parse_rollout_rs)
from grpo_npu.config.derived import derive, loaded_contents, require
from grpo_npu.config.schema import Config
from grpo_npu.errors import ConfigError
from grpo_npu.names import CHECKPOINT_CONTENTS


# actor_rollout_ref.rollout settings only the vLLM engine reads (grpo_npu/rollout/vllm_settings.py and its callers).
VLLM_ONLY = ("gpu_memory_utilization", "enforce_eager", "free_cache_engine", "enable_sleep_mode", "sleep_level",
             "load_format", "tensor_model_parallel_size", "max_num_batched_tokens", "max_model_len", "max_num_seqs",
             "enable_chunked_prefill", "enable_prefix_caching", "disable_log_stats", "cudagraph_capture_sizes",
             "expert_parallel_size")


def _settings(obj: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, tuple]]:
    """(dotted key, field, its values) of every setting below ``obj``; a tuple or list setting gives its items."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _settings(value, key + ".")
        else:
            yield key, f, tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _check_choices(cfg: Config) -> None:
    for key, f, values in _settings(cfg):
        choices = f.metadata.get("choices")
        for v in values if choices else ():
            if v not in choices:
                raise ConfigError(f"{key}={v!r} is not accepted; choose one of: {', '.join(map(str, choices))}")


def _check_finite(cfg: Config) -> None:
    """Every float setting is a finite number: an lr of inf trains NaN weights that pass every later check."""
    for key, _, values in _settings(cfg):
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key}={v!r} is not accepted: expected a finite number")


# A setting a loss mode does not read, accepted anyway: every GSPO command line of verl's examples sets
# clip_ratio_c=10.0, which verl's GSPO does not read either.
UNREAD_BUT_ACCEPTED = {("gspo", "clip_ratio_c")}


def _check_loss_settings(actor: Any) -> None:
    """The policy loss's own settings (names.POLICY_LOSS_READS): the chosen loss_mode's are checked, another
    mode's are refused at a value other than the default (verl would ignore them)."""
    mode, key = actor.policy_loss.loss_mode, "actor_rollout_ref.actor"
    reads = POLICY_LOSS_READS[mode]
    for name in POLICY_LOSS_PARAMS:
        owner, _, attr = name.rpartition(".")
        obj = actor.policy_loss if owner else actor
        value, default = getattr(obj, attr), getattr(type(obj), attr)
        require(name in reads or (mode, name) in UNREAD_BUT_ACCEPTED or value == default,
                f"{key}.{name}={value} is not read by {key}.policy_loss.loss_mode={mode} "
                f"(it reads: {', '.join(reads) or 'none of them'}); remove it or choose the loss mode that reads it")
    for name in ("tau_pos", "tau_neg"):
        require(getattr(actor, name) > 0, f"{key}.{name}={getattr(actor, name)} must be > 0")
    pl = actor.policy_loss
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        require(0 < getattr(pl, name) <= 1, f"{key}.policy_loss.{name}={getattr(pl, name)} must be in (0, 1]")
    require(pl.clip_cov_lb < pl.clip_cov_ub, f"{key}.policy_loss.clip_cov_lb={pl.clip_cov_lb} must be below "
                                             f"clip_cov_ub={pl.clip_cov_ub}")
    require(pl.ppo_kl_coef >= 0, f"{key}.policy_loss.ppo_kl_coef={pl.ppo_kl_coef} must be >= 0")
    beta = actor.policy_loss.dro_beta
    require(mode != "dro" or (beta is not None and beta > 0),
            f"{key}.policy_loss.dro_beta={beta}: loss_mode=dro needs a penalty weight > 0")


def _positive(key: str, value: Any) -> None:
    require(value is None or value > 0, f"{key}={value!r} must be > 0")


def validate(cfg: Config) -> None:
    """Accepted values, unsupported features and the batch-size arithmetic, with explanations."""
    _check_choices(cfg)
    _check_finite(cfg)
    d, arr, alg, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout, model = arr.actor, arr.rollout, arr.model

    for key, value in [
        ("data.train_batch_size", d.train_batch_size),
        ("data.max_prompt_length", d.max_prompt_length),
        ("data.max_response_length", d.max_response_length),
        ("data.gen_batch_size", d.gen_batch_size),
        ("data.val_batch_size", d.val_batch_size),
        ("actor_rollout_ref.rollout.n", rollout.n),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout.tensor_model_parallel_size),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", rollout.log_prob_micro_batch_size_per_gpu),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", arr.ref.log_prob_micro_batch_size_per_gpu),
        ("trainer.n_gpus_per_node", tr.n_gpus_per_node),
        ("trainer.nnodes", tr.nnodes),
        ("trainer.total_epochs", tr.total_epochs),
        ("trainer.total_training_steps", tr.total_training_steps),
        ("trainer.max_bad_steps", tr.max_bad_steps),
        ("trainer.step_timeout_s", tr.step_timeout_s),
        ("actor_rollout_ref.actor.optim.lr", actor.optim.lr),
        ("critic.optim.lr", cfg.critic.optim.lr),
    ]:
        _positive(key, value)
    require(actor.kl_loss_coef >= 0, f"actor_rollout_ref.actor.kl_loss_coef={actor.kl_loss_coef} must be >= 0 "
                                     "(a negative coefficient rewards moving away from the reference)")
    require(0.0 < rollout.gpu_memory_utilization <= 1.0,
            f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1]")
    for prefix, sampling in (("actor_rollout_ref.rollout", rollout), ("actor_rollout_ref.rollout.val_kwargs",
                                                                       rollout.val_kwargs)):
        require(sampling.temperature >= 0, f"{prefix}.temperature={sampling.temperature} must be >= 0")
        require(0 < sampling.top_p <= 1, f"{prefix}.top_p={sampling.top_p} must be in (0, 1]")
        require(sampling.top_k >= -1, f"{prefix}.top_k={sampling.top_k} must be -1 or 0 (off) or >= 1")
    require(rollout.name != "hf" or rollout.dtype == "auto",
            f"actor_rollout_ref.rollout.dtype={rollout.dtype} with rollout.name=hf: that rollout generates with the "
            "actor's module in the actor's compute dtype (fsdp_config.mixed_precision.param_dtype); leave it auto")
    require(rollout.expert_parallel_size in (1, rollout.tensor_model_parallel_size),
            f"actor_rollout_ref.rollout.expert_parallel_size={rollout.expert_parallel_size}: expected 1 or "
            f"tensor_model_parallel_size={rollout.tensor_model_parallel_size} (verl's rule: tensor x data parallel size, "
            "and grpo_npu's engine has data parallel size 1)")
    sizes = rollout.cudagraph_capture_sizes
    require(sizes is None or (len(sizes) > 0 and all(isinstance(n, int) and n > 0 for n in sizes)),
            f"actor_rollout_ref.rollout.cudagraph_capture_sizes={list(sizes or ())}: expected a list of positive batch sizes")
    require(sizes is None or rollout.enforce_eager is not True,
            f"actor_rollout_ref.rollout.cudagraph_capture_sizes={list(sizes or ())} with enforce_eager=True: an eager engine "
            "captures no graphs; set enforce_eager=False or drop the sizes")
    if rollout.name == "hf":  # settings of the vLLM engine, which the transformers rollout does not start
        for name in VLLM_ONLY:
            value, default = getattr(rollout, name), getattr(type(rollout), name)
            true_of_hf = ((name == "tensor_model_parallel_size" and value == 1)  # one copy of the model per rank
                          or (name == "load_format" and value.startswith("dummy")))  # weights come from the actor
            require(value == default or true_of_hf,
                    f"actor_rollout_ref.rollout.{name}={list(value) if isinstance(value, tuple) else value} sets the vLLM engine, which rollout.name=hf does not "
                    "start (it generates with the actor's module): remove it, or use rollout.name=vllm")
    for engine, section in rollout.engine_kwargs.items():
        where = f"actor_rollout_ref.rollout.engine_kwargs.{engine}"
        require(section is None or isinstance(section, Mapping),
                f"{where}={section!r}: expected a mapping of engine arguments (+{where}.NAME=VALUE)")
        given = [k for k, v in (section or {}).items() if v is not None]  # null: the engine's default (verl)
        require(not given or engine == rollout.name == "vllm",
                f"{where}.{given[0] if given else ''}: rollout.name={rollout.name} "
                + ("takes no engine arguments (it generates with the actor's module)" if rollout.name == "hf"
                   else "reads engine_kwargs.vllm only") + "; remove it")
    require(rollout.sleep_level in (None, 1, 2),
            f"actor_rollout_ref.rollout.sleep_level={rollout.sleep_level} must be 1, 2 or null")
    require(rollout.checkpoint_engine.update_weights_bucket_megabytes > 0,
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes="
            f"{rollout.checkpoint_engine.update_weights_bucket_megabytes} must be > 0")
    sc = rollout.sync_check
    for key, v in [("first_syncs", sc.first_syncs), ("every_n_steps", sc.every_n_steps)]:
        require(v >= 0, f"actor_rollout_ref.rollout.sync_check.{key}={v} must be >= 0")
    require(sc.probe_prompts >= 1, f"actor_rollout_ref.rollout.sync_check.probe_prompts={sc.probe_prompts} must be >= 1")
    require(sc.threshold is None or sc.threshold > 0,
            f"actor_rollout_ref.rollout.sync_check.threshold={sc.threshold} must be > 0 or null (by dtype)")
    require(d.max_prompt_length >= 2 or not sc.enable or sc.first_syncs == sc.every_n_steps == 0,
            f"data.max_prompt_length={d.max_prompt_length}: the sync check teacher-forces prompts of 2 tokens or more; "
            "allow longer prompts, or turn the check off (actor_rollout_ref.rollout.sync_check.enable=False)")
    require(actor.clip_ratio_c > 1.0,
            f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 (vanilla's dual-clip bound on "
            "-A x ratio; the ratio's truncation in dppo_tv / dppo_kl)")
    for key, v in [("clip_ratio", actor.clip_ratio), ("clip_ratio_low", actor.clip_ratio_low),
                   ("clip_ratio_high", actor.clip_ratio_high)]:
        require(v is None or v >= 0, f"actor_rollout_ref.actor.{key}={v} must be >= 0")
    # verl 0.9.1 reads clip_ratio only for an end whose clip_ratio_low/high is null; both default to 0.2, so a
    # clip_ratio set alone changes nothing there. Refused rather than ignored (or acted on, unlike verl).
    default_clip = type(actor).clip_ratio  # the dataclass default
    require(actor.clip_ratio == default_clip or actor.clip_ratio_low is None or actor.clip_ratio_high is None
            or actor.clip_ratio_low == actor.clip_ratio_high == actor.clip_ratio,
            f"actor_rollout_ref.actor.clip_ratio={actor.clip_ratio} is not used: clip_ratio_low={actor.clip_ratio_low} "
            f"and clip_ratio_high={actor.clip_ratio_high} take precedence (as in verl); set those, or null them")
    _check_loss_settings(actor)
    require(actor.optim.lr >= 0, f"actor_rollout_ref.actor.optim.lr={actor.optim.lr} must be >= 0")
    require(0.0 <= actor.optim.lr_warmup_steps_ratio <= 1.0,
            f"actor_rollout_ref.actor.optim.lr_warmup_steps_ratio={actor.optim.lr_warmup_steps_ratio} must be in [0, 1]")

    # Keys kept for verl's command lines that act on one value only: grpo_npu/config/support.py (RULES).
    require(model.lora_rank >= 0, f"actor_rollout_ref.model.lora_rank={model.lora_rank} must be >= 0 (0: full fine-tuning)")
    if model.lora_rank > 0:
        require(model.lora_alpha > 0, f"actor_rollout_ref.model.lora_alpha={model.lora_alpha} must be > 0 with LoRA")
        require(len(model.target_modules) > 0, "actor_rollout_ref.model.target_modules is empty: name modules or all-linear")
        require("all-linear" not in model.target_modules or len(model.target_modules) == 1,
                f"actor_rollout_ref.model.target_modules={list(model.target_modules)}: all-linear stands alone "
                "(or list module names)")
    require(model.lora.merge is not True or (_lora_on(model) and rollout.name == "vllm"),
            "actor_rollout_ref.model.lora.merge=True needs LoRA (model.lora_rank > 0 or lora_adapter_path) and "
            "rollout.name=vllm: it "
            "chooses how a LoRA actor's weights reach the vLLM engine (the hf rollout generates with the actor itself)")
    require(alg.kl_penalty not in ("full",), "algorithm.kl_penalty=full is not defined for token log-probs")
    _check_gdpo(alg)
    require("optimal_token_baseline" not in alg.adv_estimator or arr.actor.calculate_sum_pi_squared,
            f"algorithm.adv_estimator={alg.adv_estimator} needs actor_rollout_ref.actor.calculate_sum_pi_squared=True "
            "(its baseline weighs each token by 1 - 2 pi + sum pi^2 from the old-log-prob pass)")
    require(alg.adv_estimator != "grpo_vectorized" or alg.norm_adv_by_std_in_grpo,
            "algorithm.adv_estimator=grpo_vectorized with algorithm.norm_adv_by_std_in_grpo=False: verl 0.9.1's "
            "grpo_vectorized divides by the std whatever this key says; use adv_estimator=grpo for Dr.GRPO")
    require(alg.norm_adv_by_std_in_grpo or alg.adv_estimator in NORM_BY_STD_READERS,
            f"algorithm.norm_adv_by_std_in_grpo=False is read by adv_estimator {', '.join(NORM_BY_STD_READERS)} only; "
            f"adv_estimator={alg.adv_estimator} would not read it: remove it")
    require(alg.adv_estimator != "grpo_passk" or rollout.n >= 2,
            f"algorithm.adv_estimator=grpo_passk needs actor_rollout_ref.rollout.n >= 2 (it rewards each group's best "
            f"response against its second best), got {rollout.n}")

    # DAPO
    fg = alg.filter_groups
    if fg.enable:
        require(fg.metric in FILTER_METRICS,
                f"algorithm.filter_groups.metric={fg.metric!r} must be one of {', '.join(FILTER_METRICS)} "
                "when algorithm.filter_groups.enable=True")
        require(fg.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches must be >= 0 (0: unlimited)")
    _check_rollout_correction(cfg)
    _check_pf_ppo(alg)
    _check_tiled_mlp(cfg)
    _check_checkpoint_contents(cfg)
    _check_reference_fsdp(cfg)
    ob = cfg.reward_model.overlong_buffer
    if ob.enable:
        require(cfg.reward_model.reward_manager == "dapo",
                "reward_model.overlong_buffer.enable=True needs reward_model.reward_manager=dapo (naive adds no shaping)")
        require(0 < ob.len <= d.max_response_length,
                f"reward_model.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={d.max_response_length}]")

    if not d.val_files:  # validation asked for by a non-default setting needs data to validate on
        require(not tr.val_only, "trainer.val_only=True validates only, but data.val_files is empty")
        require(tr.test_freq <= 0, f"trainer.test_freq={tr.test_freq} validates every {tr.test_freq} steps, but "
                                   "data.val_files is empty: name the validation files, or set test_freq=-1")
    for key, factor in (("actor_rollout_ref.actor", actor.loss_scale_factor), ("critic", cfg.critic.loss_scale_factor)):
        require(factor is None or factor > 0, f"{key}.loss_scale_factor={factor}: expected a positive count or null")
    for key in ("train_max_samples", "val_max_samples"):
        require(getattr(d, key) == -1 or getattr(d, key) > 0, f"data.{key}={getattr(d, key)}: expected -1 (all) or > 0")
    crf = cfg.custom_reward_function
    require(crf.path is not None or crf.name == type(crf).name,
            f"custom_reward_function.name={crf.name} names a function in custom_reward_function.path, which is not set")

    # Micro-batch settings: exactly one way to size micro-batches.
    require(actor.use_dynamic_bsz or actor.ppo_micro_batch_size or actor.ppo_micro_batch_size_per_gpu,
            "set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (or use_dynamic_bsz=True with "
            "ppo_max_token_len_per_gpu)")
    _check_sequence_parallel(cfg)
    derive(cfg)  # the size arithmetic raises ConfigError with the explanation


def _check_sequence_parallel(cfg: Config) -> None:
    """Ulysses sequence parallelism splits packed rows (model.use_remove_padding), never shared-prompt packing; with
    LoRA the reference is the actor's own module, so it splits as the actor does."""
    arr = cfg.actor_rollout_ref
    model, actor, ref = arr.model, arr.actor, arr.ref
    actor_sp = actor.ulysses_sequence_parallel_size
    ref_sp = ref.ulysses_sequence_parallel_size or actor_sp  # null: the actor's
    critic_sp = cfg.critic.ulysses_sequence_parallel_size
    for key, size, padding_key, remove_padding in (
            ("actor_rollout_ref.actor", actor_sp, "actor_rollout_ref.model", model.use_remove_padding),
            ("actor_rollout_ref.ref", ref_sp, "actor_rollout_ref.model", model.use_remove_padding),
            ("critic", critic_sp, "critic.model", cfg.critic.model.use_remove_padding)):
        if size > 1:
            require(remove_padding, f"{key}.ulysses_sequence_parallel_size={size} splits packed rows: set "
                                    f"{padding_key}.use_remove_padding=True")
    if max(actor_sp, ref_sp) > 1:
        require(model.share_prompt_prefix is not True,
                "actor_rollout_ref.model.share_prompt_prefix=True packs each prompt once for all its responses, which "
                "sequence parallelism (ulysses_sequence_parallel_size > 1) does not split; leave it null (auto: off "
                "then) or set False")
    if max(actor_sp, ref_sp, critic_sp) > 1:
        require(not model.compile_layers,
                "actor_rollout_ref.model.compile_layers=True compiles each decoder layer, whose attention holds "
                "collectives under sequence parallelism (ulysses_sequence_parallel_size > 1): the two together are "
                "untested; set one of them off")
    if _lora_on(model) and ref.ulysses_sequence_parallel_size is not None:
        require(ref.ulysses_sequence_parallel_size == actor_sp,
                f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={ref.ulysses_sequence_parallel_size}: with LoRA "
                "the reference is the actor's module with its adapters off, so it runs with the actor's "
                f"ulysses_sequence_parallel_size={actor_sp}")


def _lora_on(model: Any) -> bool:
    """LoRA on the actor: a rank, or a saved adapter to start from (which brings its own)."""
    return model.lora_rank > 0 or bool(model.lora_adapter_path)


def _check_gdpo(alg: Any) -> None:
    """GDPO's reward components: named when it is the estimator, and read by no other."""
    keys, weights = alg.gdpo_reward_keys, alg.gdpo_reward_weights
    if alg.adv_estimator != "gdpo":
        require(keys is None and weights is None,
                f"algorithm.gdpo_reward_keys / gdpo_reward_weights are read by algorithm.adv_estimator=gdpo only, not "
                f"{alg.adv_estimator}; remove them or choose gdpo")
        return
    require(bool(keys), "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the keys of the reward "
                        "function's result dict to normalise one by one (e.g. ['accuracy_reward', 'format_reward'])")
    require(weights is None or len(weights) == len(keys),
            f"algorithm.gdpo_reward_weights has {len(weights or ())} weights for {len(keys)} gdpo_reward_keys")


def _check_reference_fsdp(cfg: Config) -> None:
    """The reference only runs forward passes: a setting of its fsdp_config that shapes an update is refused."""
    ref = cfg.actor_rollout_ref.ref.fsdp_config
    require(not ref.use_no_sync_for_gradient_accumulation,
            "actor_rollout_ref.ref.fsdp_config.use_no_sync_for_gradient_accumulation=True: the reference computes no "
            "gradients; set it on actor_rollout_ref.actor.fsdp_config or critic.model.fsdp_config")


def _check_checkpoint_contents(cfg: Config) -> None:
    """*.checkpoint.save_contents / load_contents: what grpo_npu's checkpoints can leave out and load."""
    for key, ckpt in (("actor_rollout_ref.actor.checkpoint", cfg.actor_rollout_ref.actor.checkpoint),
                      ("critic.checkpoint", cfg.critic.checkpoint)):
        saved = list(ckpt.save_contents)
        require("model" in saved and "extra" in saved,
                f"{key}.save_contents={saved}: grpo_npu's checkpoints always hold the model and extra (step, LR "
                "schedule, RNG), what a resume starts from; list both")
        require(key.startswith("actor") or "hf_model" not in saved,
                f"{key}.save_contents={saved}: hf_model (a Hugging Face export) is written for the actor only; remove it")
        loaded = list(loaded_contents(ckpt))
        unknown = [c for c in loaded if c not in CHECKPOINT_CONTENTS]
        require(not unknown, f"{key}.load_contents={loaded}: {unknown[0] if unknown else ''!r} is not accepted; "
                             f"choose among: {', '.join(CHECKPOINT_CONTENTS)}")
        require("model" in loaded, f"{key}.load_contents={loaded}: a resume loads the model; list it")


def _check_tiled_mlp(cfg: Config) -> None:
    """model.tiled_mlp (actor and reference) and critic.model.tiled_mlp: a count >= 1, read only when enabled."""
    model = cfg.actor_rollout_ref.model
    for key, block in (("actor_rollout_ref.model.tiled_mlp", model.tiled_mlp),
                       ("critic.model.tiled_mlp", cfg.critic.model.tiled_mlp)):
        if block.enabled:
            require(block.num_shards >= 1, f"{key}.num_shards={block.num_shards} must be >= 1")
            require(not model.compile_layers, f"{key}.enabled=True with actor_rollout_ref.model.compile_layers=True: "
                    "the tiles' activation checkpointing inside a compiled layer is untested; set one of them off")
        else:
            require(block.num_shards == type(block)().num_shards,
                    f"{key}.num_shards={block.num_shards} is read only with {key}.enabled=True")


def _check_pf_ppo(alg) -> None:
    """algorithm.use_pf_ppo / pf_ppo: GAE only (as verl applies it), and no setting left unread."""
    pf, default = alg.pf_ppo, type(alg.pf_ppo)()
    if alg.use_pf_ppo:
        require(alg.adv_estimator == "gae", f"algorithm.use_pf_ppo=True with algorithm.adv_estimator={alg.adv_estimator}: "
                "PF-PPO resamples the batch after GAE's advantages, and verl applies it with adv_estimator=gae only")
        require(pf.weight_pow >= 0 and math.isfinite(pf.weight_pow),
                f"algorithm.pf_ppo.weight_pow={pf.weight_pow} must be a finite number >= 0")
        require(pf.reweight_method == "pow" or pf.weight_pow == default.weight_pow,
                f"algorithm.pf_ppo.weight_pow={pf.weight_pow} is read by reweight_method=pow only "
                f"(reweight_method={pf.reweight_method})")
    else:
        changed = [f"{k}={getattr(pf, k)}" for k in ("reweight_method", "weight_pow") if getattr(pf, k) != getattr(default, k)]
        require(not changed, f"algorithm.pf_ppo.{changed[0] if changed else ''} is read only with algorithm.use_pf_ppo=True")


def _check_rollout_correction(cfg: Config) -> None:
    """algorithm.rollout_correction: accepted values, and the rollout log-probs it needs."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    require(rc.rollout_is in (None,) + ROLLOUT_IS_LEVELS,
            f"{key}.rollout_is={rc.rollout_is!r} is not accepted; choose one of: {', '.join(ROLLOUT_IS_LEVELS)}, null")
    try:
        parse_rollout_is_threshold(rc.rollout_is_threshold)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    require(rc.rollout_is is not None or not rc.rollout_is_batch_normalize,
            f"{key}.rollout_is_batch_normalize=True needs {key}.rollout_is=token or sequence")
    require(rc.rollout_rs is not None or rc.rollout_rs_threshold is None,
            f"{key}.rollout_rs_threshold={rc.rollout_rs_threshold!r} needs {key}.rollout_rs (it is unused without it)")
    if rc.rollout_rs is not None:
        try:
            parse_rollout_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if rc.rollout_is is not None or rc.rollout_rs is not None:
        require(cfg.actor_rollout_ref.rollout.calculate_log_probs,
                f"{key}.rollout_is={rc.rollout_is} / rollout_rs={rc.rollout_rs} needs the engine's log-probs: "
                "set actor_rollout_ref.rollout.calculate_log_probs=True")
    actor = cfg.actor_rollout_ref.actor
    if not rc.bypass_mode:
        require(rc.loss_type == "ppo_clip", f"{key}.loss_type={rc.loss_type} is the bypass mode's loss: set "
                                            f"{key}.bypass_mode=True, or leave loss_type at ppo_clip")
        return
    require(cfg.actor_rollout_ref.rollout.calculate_log_probs,
            f"{key}.bypass_mode=True takes the engine's log-probs as the old policy: set "
            "actor_rollout_ref.rollout.calculate_log_probs=True")
    require(actor.policy_loss.loss_mode == "vanilla",
            f"{key}.bypass_mode=True replaces the policy loss with {key}.loss_type={rc.loss_type} (as verl does); "
            f"actor_rollout_ref.actor.policy_loss.loss_mode={actor.policy_loss.loss_mode} would not be used: leave it "
            "vanilla")
    require(actor.old_log_prob != "recompute",
            f"{key}.bypass_mode=True skips the old-log-prob pass that actor_rollout_ref.actor.old_log_prob=recompute "
            "asks for: choose one")
    require(not actor.calculate_sum_pi_squared,
            f"{key}.bypass_mode=True skips the old-log-prob pass, which actor_rollout_ref.actor.calculate_sum_pi_squared "
            "computes sum pi^2 in: choose one")
