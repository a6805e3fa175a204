"""Values that follow from the config and the world size, computed, never written back into it.

:func:`derive` also checks that the batch-size arithmetic works out (validation runs it), and
explains the numbers when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_npu.config.schema import Config
from grpo_npu.errors import ConfigError


def require(cond: bool, message: str) -> None:
    """Raise ConfigError(``message``) unless ``cond``: one line naming the key, value and expectation."""
    if not cond:
        raise ConfigError(message)


def loaded_contents(checkpoint) -> tuple[str, ...]:
    """A role's ``checkpoint.load_contents``, null meaning its ``save_contents`` (verl's ``${.save_contents}``)."""
    contents = checkpoint.load_contents if checkpoint.load_contents is not None else checkpoint.save_contents
    return tuple(contents)


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
    critic_ppo_epochs: int  # critic.ppo_epochs, else the actor's
    critic_use_dynamic_bsz: bool  # critic.use_dynamic_bsz, else the actor's
    values_micro_batch_per_rank: int | None  # the critic's value forward: critic.forward_micro_batch_size_per_gpu, else its update's
    values_max_token_len: int  # ... and its token budget: critic.forward_max_token_len_per_gpu, else its update's
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
    old_logp_from_update: bool = False  # old log-probs come from the update's forward (actor.old_log_prob=auto, no rollout correction)
    old_logp_from_rollout: bool = False  # the engine's log-probs are the old ones (algorithm.rollout_correction.bypass_mode)
    agg_horizon: int = 0  # the seq-mean-token-sum-norm divisor of the actor's losses: actor.loss_scale_factor, else response_length
    critic_agg_horizon: int = 0  # ... of the value loss: critic.loss_scale_factor, else the actor's
    max_token_len: int = 0  # the actor update's micro-batch token budget: ppo_max_token_len_per_gpu x sp (a group's)
    critic_max_token_len: int = 0  # ... the critic update's
    sp: int = 1  # Ulysses sequence-parallel ranks of the actor (old log-probs, update): they share each micro-batch
    ref_sp: int = 1  # ... of the reference pass
    critic_sp: int = 1  # ... of the critic


def rollout_correction_on(cfg: Config) -> bool:
    """IS weights or rejection sampling are on: they need the old log-probs on the driver before the update."""
    rc = cfg.algorithm.rollout_correction
    return rc.rollout_is is not None or rc.rollout_rs is not None


def derive(cfg: Config, world_size: int | None = None) -> Derived:
    """Per-rank batch sizes and inherited values, checking that the arithmetic works out."""
    d, arr, tr, alg = cfg.data, cfg.actor_rollout_ref, cfg.trainer, cfg.algorithm
    actor, rollout = arr.actor, arr.rollout
    ws = world_size if world_size is not None else tr.nnodes * tr.n_gpus_per_node
    n = rollout.n
    sp = sequence_parallel(actor.ulysses_sequence_parallel_size, "actor_rollout_ref.actor", ws)
    ref_sp = sequence_parallel(arr.ref.ulysses_sequence_parallel_size or sp, "actor_rollout_ref.ref", ws)
    critic_sp = sequence_parallel(cfg.critic.ulysses_sequence_parallel_size, "critic", ws)
    dp, critic_dp = ws // sp, ws // critic_sp  # data-parallel groups: each holds whole rows of the batch
    ranks = f"{ws} ranks" if sp == 1 else f"{dp} data-parallel groups ({ws} ranks / ulysses_sequence_parallel_size={sp})"
    train_responses = d.train_batch_size * n
    require(train_responses % ws == 0,
            f"data.train_batch_size x rollout.n = {d.train_batch_size} x {n} = {train_responses} responses "
            f"cannot be split evenly over {ws} ranks (trainer.nnodes x trainer.n_gpus_per_node)")
    require(d.train_batch_size >= actor.ppo_mini_batch_size,
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} prompts is larger than "
            f"data.train_batch_size={d.train_batch_size}")
    require(d.train_batch_size % actor.ppo_mini_batch_size == 0,
            f"data.train_batch_size={d.train_batch_size} is not a multiple of actor_rollout_ref.actor."
            f"ppo_mini_batch_size={actor.ppo_mini_batch_size}: every optimizer step must see a full mini-batch")
    mini_responses = actor.ppo_mini_batch_size * n
    require(mini_responses % dp == 0,
            f"ppo_mini_batch_size x rollout.n = {actor.ppo_mini_batch_size} x {n} = {mini_responses} responses "
            f"per mini-batch cannot be split evenly over {ranks}")
    mini_per_rank = mini_responses // dp

    def per_rank_micro(key: str, global_mb: int | None, per_gpu: int | None, groups: int = dp) -> int | None:
        require(not (global_mb and per_gpu), f"set only one of {key} (deprecated) and {key}_per_gpu")
        if per_gpu is not None:
            return per_gpu
        if global_mb is not None:
            require(global_mb % groups == 0,
                    f"{key}={global_mb} (global, deprecated) is not divisible by {groups} data-parallel groups")
            return global_mb // groups
        return None

    micro = per_rank_micro("actor_rollout_ref.actor.ppo_micro_batch_size",
                           actor.ppo_micro_batch_size, actor.ppo_micro_batch_size_per_gpu)
    if not actor.use_dynamic_bsz:
        require(micro is not None and mini_per_rank % micro == 0,
                f"per-rank mini-batch = ppo_mini_batch_size x rollout.n / data-parallel groups = "
                f"{actor.ppo_mini_batch_size} x {n} / {dp} = {mini_per_rank} responses is not a multiple of "
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}")
    lp_micro = per_rank_micro("actor_rollout_ref.rollout.log_prob_micro_batch_size",
                              rollout.log_prob_micro_batch_size, rollout.log_prob_micro_batch_size_per_gpu)
    ref_micro = per_rank_micro("actor_rollout_ref.ref.log_prob_micro_batch_size",
                               arr.ref.log_prob_micro_batch_size, arr.ref.log_prob_micro_batch_size_per_gpu, ws // ref_sp)

    use_critic = cfg.critic.enable if cfg.critic.enable is not None else alg.adv_estimator == "gae"
    critic = cfg.critic
    critic_mini = (critic.ppo_mini_batch_size or actor.ppo_mini_batch_size) * n
    critic_micro = per_rank_micro("critic.ppo_micro_batch_size", critic.ppo_micro_batch_size,
                                  critic.ppo_micro_batch_size_per_gpu, critic_dp) or micro
    critic_dyn = critic.use_dynamic_bsz if critic.use_dynamic_bsz is not None else actor.use_dynamic_bsz
    if use_critic:
        require(critic_mini % critic_dp == 0, f"critic.ppo_mini_batch_size x rollout.n = {critic_mini} responses "
                f"cannot be split evenly over {critic_dp} data-parallel groups")
        if not critic_dyn:
            require(critic_micro is not None and (critic_mini // critic_dp) % critic_micro == 0,
                    f"per-rank critic mini-batch {critic_mini // critic_dp} is not a multiple of "
                    f"critic.ppo_micro_batch_size_per_gpu={critic_micro}")

    gen = d.gen_batch_size or d.train_batch_size
    if alg.filter_groups.enable:
        require(gen * n % ws == 0, f"data.gen_batch_size x rollout.n = {gen} x {n} cannot be split over {ws} ranks")
    clip_low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    clip_high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    # A log-prob pass without a micro-batch size of its own packs rows to its token budget: it keeps no activations for
    # a backward, so the training micro-batch it used to borrow only multiplied the passes (and on an accelerator each
    # pass is host-bound: docs/performance.md). verl itself requires one of the two settings.
    lp_dyn = (rollout.log_prob_use_dynamic_bsz if rollout.log_prob_use_dynamic_bsz is not None
              else actor.use_dynamic_bsz or lp_micro is None)
    ref_dyn = (arr.ref.log_prob_use_dynamic_bsz if arr.ref.log_prob_use_dynamic_bsz is not None
               else actor.use_dynamic_bsz or (ref_micro is None and lp_micro is None))
    response_length = rollout.response_length or d.max_response_length
    return Derived(
        world_size=ws, n=n,
        train_batch_responses=train_responses,
        gen_batch_size=gen,
        mini_batch_responses_per_rank=mini_per_rank,
        micro_batch_per_rank=micro,
        log_prob_micro_batch_per_rank=lp_micro or micro,
        ref_log_prob_micro_batch_per_rank=ref_micro or lp_micro or micro,
        critic_mini_batch_responses_per_rank=critic_mini // critic_dp,
        critic_micro_batch_per_rank=critic_micro,
        critic_ppo_epochs=critic.ppo_epochs or actor.ppo_epochs,
        critic_use_dynamic_bsz=critic_dyn,
        values_micro_batch_per_rank=per_rank_micro("critic.forward_micro_batch_size", critic.forward_micro_batch_size,
                                                   critic.forward_micro_batch_size_per_gpu, critic_dp) or critic_micro,
        values_max_token_len=(critic.forward_max_token_len_per_gpu or critic.ppo_max_token_len_per_gpu) * critic_sp,
        prompt_length=rollout.prompt_length or d.max_prompt_length,
        response_length=response_length,
        clip_low=clip_low, clip_high=clip_high,
        use_critic=bool(use_critic),
        use_reference=actor.use_kl_loss or alg.use_kl_in_reward,
        log_prob_use_dynamic_bsz=lp_dyn,
        log_prob_max_token_len=(rollout.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu) * sp,
        ref_log_prob_use_dynamic_bsz=ref_dyn,
        ref_log_prob_max_token_len=(arr.ref.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu) * ref_sp,
        old_logp_from_update=(actor.old_log_prob == "auto" and actor.ppo_epochs == 1
                              and actor.ppo_mini_batch_size == d.train_batch_size and not alg.use_kl_in_reward
                              and not rollout_correction_on(cfg) and not actor.calculate_sum_pi_squared
                              and not alg.rollout_correction.bypass_mode),
        old_logp_from_rollout=alg.rollout_correction.bypass_mode,
        agg_horizon=actor.loss_scale_factor or response_length,
        critic_agg_horizon=critic.loss_scale_factor or actor.loss_scale_factor or response_length,
        max_token_len=actor.ppo_max_token_len_per_gpu * sp,
        critic_max_token_len=critic.ppo_max_token_len_per_gpu * critic_sp,
        sp=sp, ref_sp=ref_sp, critic_sp=critic_sp,
    )


def sequence_parallel(size: int, section: str, world_size: int) -> int:
    """``{section}.ulysses_sequence_parallel_size``, checked: at least 1, dividing the ranks."""
    require(size >= 1 and world_size % size == 0,
            f"{section}.ulysses_sequence_parallel_size={size} must be >= 1 and divide the {world_size} ranks "
            "(trainer.nnodes x trainer.n_gpus_per_node)")
    return size
