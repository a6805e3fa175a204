"""The configuration schema: typed, documented once, verl-compatible key names.

Every default lives in these dataclasses, exactly once, as a field followed by a one-line docstring
(``--help`` reads those docstrings from the source). Key names and meanings follow verl's
``main_ppo`` so existing command lines keep working. This module holds the root :class:`Config`
and its smaller sections; the ``actor_rollout_ref`` section is :mod:`grpo_npu.config.actor_rollout_ref`.
Accepted values of a ``choice`` field are declared by the code that acts on them, in its torch-free
``names`` module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from grpo_npu.algo.names import ADV_ESTIMATORS, BYPASS_LOSS_TYPES, KL_CTRL_TYPES, KL_TYPES, PF_PPO_REWEIGHT_METHODS
from grpo_npu.config.actor_rollout_ref import (ActorRolloutRefConfig, CheckpointConfig, FSDPConfig, OptimConfig,
                                              TiledMlpConfig)
from grpo_npu.config.fields import choice, free_dict, many
from grpo_npu.config.profiler import GlobalProfilerConfig, RoleProfilerConfig
from grpo_npu.data.names import TRUNCATION_MODES
from grpo_npu.names import DEVICE_CHOICES, EXISTING_RUN_POLICIES, LOGGERS, RESUME_MODES
from grpo_npu.reward.names import REWARD_MANAGER_NAMES, SANDBOX_DEFAULTS
from grpo_npu.workers.names import STRATEGIES


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
    truncation: str = choice("error", TRUNCATION_MODES)
    """What to do with a prompt longer than max_prompt_length: error|left|right|middle."""
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
    """Keep each prompt's chat messages for rollouts that template them themselves (verl's agent loop)."""
    return_full_prompt: bool = False
    """Keep the templated prompt text with each prompt."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by data.seed)."""
    seed: int = 1
    """Seed of the training-prompt shuffle (and of the *_max_samples draw)."""
    train_max_samples: int = -1
    """Use at most this many training rows (-1: all): drawn at random (data.seed) with data.shuffle, else the first ones."""
    val_max_samples: int = -1
    """Use at most this many validation rows (-1: all), chosen as data.train_max_samples chooses."""
    validation_shuffle: bool = False
    """Shuffle the validation prompts (seeded by data.seed): which ones val batches and logged generations hold."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length before training (and report how many)."""
    filter_overlong_prompts_workers: int = 1
    """Threads that tokenize the prompts when the dataset is built (verl: processes of the overlong filter)."""
    trust_remote_code: bool = False
    """Allow tokenizers with custom code."""
    dataloader_num_workers: int = 0
    """Kept for verl compatibility; prompts are tokenized up front."""
    apply_chat_template_kwargs: Dict[str, Any] = free_dict()
    """Extra arguments of the chat template, e.g. +data.apply_chat_template_kwargs.enable_thinking=False."""


@dataclass(frozen=True)
class CriticModelConfig:
    path: Optional[str] = None
    """Critic model directory (None: the actor's model path)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory if different."""
    override_config: Dict[str, Any] = free_dict()
    """Overrides for the HF model config."""
    enable_gradient_checkpointing: bool = True
    """Recompute decoder-layer activations in the critic's backward, every layer's but the last."""
    enable_activation_offload: bool = False
    """Keep the critic update's saved activations in host memory between forward and backward (on NPU/GPU)."""
    use_remove_padding: bool = False
    """Pack sequences without padding (varlen attention, no (N, N) mask)."""
    trust_remote_code: bool = False
    """Allow models with custom code."""
    external_lib: Optional[str] = None
    """A module to import before loading the critic (registers custom architectures)."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings of the critic."""
    tiled_mlp: TiledMlpConfig = field(default_factory=TiledMlpConfig)
    """Tiled MLP for the critic."""


@dataclass(frozen=True)
class CriticConfig:
    enable: Optional[bool] = None
    """Build a critic (None: only when algorithm.adv_estimator=gae)."""
    strategy: str = choice("fsdp2", STRATEGIES)
    """Data-parallel strategy (FSDP2)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What the critic's part of a checkpoint holds and what resume loads of it."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """The value model."""
    ppo_mini_batch_size: Optional[int] = None
    """Prompts per critic optimizer step (None: actor.ppo_mini_batch_size)."""
    ppo_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size."""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per critic forward/backward on one device (None: actor's)."""
    forward_micro_batch_size: Optional[int] = None
    """Deprecated global size of a value-forward micro-batch (divided by the data-parallel groups; verl's older key)."""
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
    loss_scale_factor: Optional[int] = None
    """The constant loss_agg_mode=seq-mean-token-sum-norm divides the value loss by (None: actor.loss_scale_factor)."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism of the critic (1: off; needs critic.model.use_remove_padding)."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the critic's value passes and updates (global_profiler picks the tool and steps)."""


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong shaping: penalise responses in the last `len` tokens before the limit."""
    len: int = 0
    """Length of the soft-penalty buffer (tokens)."""
    penalty_factor: float = 1.0
    """Penalty at the hard limit."""
    log: bool = False
    """Log the batch's mean overlong reward and overlong fraction (reward/overlong_reward/mean, reward/overlong/mean)."""


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = False
    """Model-based reward (not implemented: rule rewards only; must stay False)."""
    reward_manager: str = choice("naive", REWARD_MANAGER_NAMES)
    """How scores become token rewards: naive | dapo (adds overlong shaping)."""
    launch_reward_fn_async: bool = False
    """Score in the background while old log-probs are computed."""
    reward_kwargs: Dict[str, Any] = free_dict()
    """Extra keyword arguments for the score function."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong shaping."""
    num_workers: int = 0
    """Reward worker processes (0: one per CPU, at most 16); >= 2 also sends the bounded built-in scorers to them."""
    timeout_s: float = SANDBOX_DEFAULTS["timeout_s"]
    """Seconds one reward call may run before its worker is killed and the row gets fallback_score."""
    fallback_score: float = SANDBOX_DEFAULTS["fallback_score"]
    """Score of a row whose reward call timed out, raised, crashed its worker or returned a non-number."""
    max_failed_fraction: float = SANDBOX_DEFAULTS["max_failed_fraction"]
    """Stop the run when more than this fraction of a batch's reward calls fail (1.0: never stop)."""
    memory_limit_mb: int = SANDBOX_DEFAULTS["memory_limit_mb"]
    """Resident MB a reward worker may hold: above it killed (its row fails), above half replaced; 0: no limit."""


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
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = None
    """Truncated IS weights pi_old / pi_rollout on the policy loss: token | sequence | null (none); needs rollout.calculate_log_probs."""
    rollout_is_threshold: str = "2.0"
    """One number: the upper bound IS weights are truncated to (TIS); "lower_upper" (e.g. 0.5_2.0): weights outside the bounds are set to 0 (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated IS weights by their batch mean (over tokens, or sequences for rollout_is=sequence)."""
    rollout_rs: Optional[str] = None
    """Rejection sampling: comma-separated token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3 (null: none)."""
    rollout_rs_threshold: Optional[str] = None
    """Rejection bounds, one per rollout_rs option or one for all: k1 "lower_upper" ratio bounds, k2/k3 an upper bound."""
    bypass_mode: bool = False
    """verl's bypass mode: the engine's log-probs are the old policy (no old-log-prob pass); IS weights and rejection come from the policy being trained, per update micro-batch; needs rollout.calculate_log_probs."""
    loss_type: str = choice("ppo_clip", BYPASS_LOSS_TYPES)
    """The bypass mode's loss: ppo_clip (PPO clip with ratio pi_theta / pi_rollout, no IS weights) or reinforce (-A w log pi_theta, w the IS weights)."""


@dataclass(frozen=True)
class PfPpoConfig:
    reweight_method: str = choice("pow", PF_PPO_REWEIGHT_METHODS)
    """How a response's score weighs its draw: pow (|score| ** weight_pow) | max_min (only the batch's best and worst) | max_random (best 0.4, others 0.1)."""
    weight_pow: float = 2.0
    """The exponent of reweight_method=pow."""


@dataclass(frozen=True)
class AlgorithmConfig:
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    adv_estimator: str = choice("gae", ADV_ESTIMATORS)
    """Advantage estimator: gae (PPO) | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gpg | remax | gdpo | optimal_token_baseline | tir_optimal_token_baseline | opo | grpo_passk | grpo_vectorized | rloo_vectorized."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO (and GDPO's per-component step): divide by the group std (False: Dr.GRPO)."""
    gdpo_reward_keys: Optional[List[str]] = None
    """GDPO: keys of the reward function's result dict, one reward component each (e.g. [accuracy_reward, format_reward])."""
    gdpo_reward_weights: Optional[List[float]] = None
    """GDPO: each component's weight in the sum (None: 1 each)."""
    use_kl_in_reward: bool = False
    """Subtract beta x KL from token rewards."""
    kl_penalty: str = choice("kl", KL_TYPES)
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """KL-in-reward coefficient controller."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Rollout-vs-training policy mismatch: truncated IS weights, rejection sampling, rollout_corr/* metrics."""
    use_pf_ppo: bool = False
    """PF-PPO (policy filtration, GAE only): resample the batch with replacement, weighted by each response's score, before the update."""
    pf_ppo: PfPpoConfig = field(default_factory=PfPpoConfig)
    """PF-PPO's resampling weight."""


@dataclass(frozen=True)
class TrainerConfig:
    device: str = choice("auto", DEVICE_CHOICES)
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
    """Metric sinks: console, jsonl, file (verl's JSON-lines file logger), tensorboard, wandb, mlflow."""
    log_val_generations: int = 0
    """Validation generations printed/logged per validation."""
    rollout_data_dir: Optional[str] = None
    """Dump every step's rollouts here: {step}.jsonl (decoded text, scores) and {step}.safetensors (ids, masks, scores, log-probs, uids)."""
    replay_rollouts_from: Optional[str] = None
    """Take each step's rollouts and scores from this rollout_data_dir dump instead of generating (docs/parity.md)."""
    deterministic: bool = False
    """Determinism preset: torch deterministic algorithms, CUBLAS_WORKSPACE_CONFIG, HCCL_DETERMINISTIC (grpo_npu/determinism.py)."""
    validation_data_dir: Optional[str] = None
    """Dump validation generations as jsonl here."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""
    n_gpus_per_node: int = 8
    """Devices (worker processes on CPU) per node."""
    save_freq: int = -1
    """Checkpoint every N steps and at the last step; <= 0: no checkpoint at all (as in verl)."""
    resume_mode: str = choice("auto", RESUME_MODES)
    """auto (latest checkpoint in default_local_dir) | disable | resume_path."""
    resume_from_path: Optional[str] = None
    """global_step_N directory to resume from with resume_mode=resume_path."""
    existing_run_dir: str = choice("refuse", EXISTING_RUN_POLICIES)
    """A run that does not resume, into a default_local_dir holding another run: refuse | move_aside (to previous_runs/)."""
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
    checkpoint_callback_class: Optional[str] = None
    """A class (package.module.ClassName) built with config=the config; its on_save(trainer, global_step, checkpoint_dir, async_save) runs on the driver after each committed checkpoint (verl's hook, e.g. to upload it)."""
    seed: int = 42
    """Seed of model init noise, sampling and every RNG."""
    step_timeout_s: float = 1800.0
    """Longest a training step may take: past it the run stops (exit 1) naming the phase and the ranks that did not answer."""
    max_bad_steps: int = 3
    """Stop (with a checkpoint of the last good state if save_freq > 0) after this many consecutive bad steps."""
    ray_wait_register_center_timeout: int = 300
    """Seconds to wait for Ray workers to start."""


@dataclass(frozen=True)
class RayInitConfig:
    num_cpus: Optional[int] = None
    """CPUs Ray may use on a local cluster (None: all)."""
    timeline_json_file: Optional[str] = None
    """Write Ray's timeline (chrome://tracing JSON) here when the run ends; the workers then run under Ray."""
    runtime_env: Dict[str, Any] = free_dict()
    """Ray runtime environment of the worker processes (e.g. py_executable; verl: ray_kwargs.ray_init.runtime_env)."""


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
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    """Which profiler, on which steps, where its traces go (each role's profiler.* says whether and where it runs)."""
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    """Ray start-up."""
