"""The policy: response log-probs (actor, old policy, reference) and the PPO/GRPO update of the actor.

Shapes: B rows of this rank, b rows of a micro-batch, T response tokens. The model is a
:class:`~grpo_npu.workers.response_model.CausalLMLogProbs`; the update runs through the shared
:class:`~grpo_npu.workers.update_loop.UpdateLoop`, and this module holds only the actor's own part:
the per-micro-batch loss (policy loss + KL loss - entropy bonus, from :mod:`grpo_npu.algo`) and the
verl-named ``actor/*`` metrics.

Old log-probs from the update (``actor_rollout_ref.actor.old_log_prob=auto``, named
``old_logp_from_update`` from the config to the loss): when the update is one optimizer step on the
whole batch, the old policy IS the policy of the update's forward, so the trainer skips the separate
old-log-prob pass and sends the batch without ``old_logp``; the loss then uses the detached
log-probs of its own forward (ratio exactly 1), and ``actor/entropy`` and ``rollout/logp_diff_*``
come from that forward too.
"""

from __future__ import annotations

import functools

import torch

from grpo_npu.algo import kl as kl_lib
from grpo_npu.algo import losses, rollout_corr
from grpo_npu.algo.names import POLICY_LOSS_PARAMS, POLICY_LOSS_READS
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import ActorConfig, Derived, RolloutCorrectionConfig
from grpo_npu.device import Device
from grpo_npu.rollout.metrics import logp_abs_diff
from grpo_npu.workers import fsdp
from grpo_npu.workers.micro_batch import forward_in_micro_batches
from grpo_npu.workers.model_inputs import build_inputs
from grpo_npu.workers.response_model import CausalLMLogProbs
from grpo_npu.workers.update_loop import MicroLoss, UpdateLoop, global_counts, params_on


class Policy:
    """A sharded causal LM that computes response log-probs (the actor's forward and the reference)."""

    def __init__(self, module: CausalLMLogProbs, dev: Device, *, remove_padding: bool, temperature: float,
                 param_offload: bool, share_prefix: bool = False):
        if not temperature > 0:
            raise ValueError(
                f"actor_rollout_ref.rollout.temperature={temperature}: log-probs for training need a temperature > 0"
            )
        self.module, self.dev, self.temperature = module, dev, temperature
        self.remove_padding, self.share_prefix, self.param_offload = remove_padding, share_prefix, param_offload
        if param_offload and dev.is_accelerator:
            fsdp.move_model(module, "cpu")

    def forward(self, micro: RolloutBatch, with_entropy: bool, with_sum_pi_squared: bool = False):
        """(logp (b, T), entropy (b, T) | None[, sum_pi_squared (b, T)]) for one trimmed micro-batch on the device."""
        inputs = build_inputs(micro.to(self.dev.torch_device()), self.remove_padding, self.share_prefix)
        return self.module(inputs, self.temperature, with_entropy, with_sum_pi_squared)

    def log_probs(self, batch: RolloutBatch, *, micro_size: int | None, max_tokens: int | None,
                  with_entropy: bool, with_sum_pi_squared: bool = False) -> tuple[torch.Tensor | None, ...]:
        """(B, T) float32 log-probs, entropies (or None) and, if asked, sum_v pi_v^2 of this rank's rows, on the host.
        Collective."""
        self.module.eval()
        with params_on(self.module, self.dev, self.param_offload):
            def run(micro: RolloutBatch):
                return tuple(o for o in self.forward(micro, with_entropy, with_sum_pi_squared) if o is not None)

            outs = forward_in_micro_batches(run, batch, size=micro_size, max_tokens=max_tokens, dev=self.dev)
            fsdp.reshard_all(self.module)  # the root stays gathered after a forward without backward
        logp, *rest = outs
        return (logp, rest.pop(0) if with_entropy else None, *rest)  # rest: [entropy][, sum_sq]


    @torch.no_grad()
    def teacher_forced(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Log-probs at temperature 1 of tokens 1.. of each sequence, one (L-1,) float32 tensor each, through the
        training forward (the weight-sync canary's actor side; the engine scores raw logits). Collective; runs
        inside the caller's ``params_on`` (HybridWorker.generate: a nested one would offload mid-rollout)."""
        width = max(len(s) for s in sequences) - 1
        response = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, T), right-padded
        mask = torch.zeros_like(response)  # (B, T)
        for i, seq in enumerate(sequences):
            response[i, : len(seq) - 1] = torch.tensor(seq[1:], dtype=torch.long)
            mask[i, : len(seq) - 1] = 1
        first = torch.tensor([[s[0]] for s in sequences], dtype=torch.long)  # (B, 1): each row's context starts here
        batch = RolloutBatch(first, torch.ones_like(first), response, mask).to(self.dev.torch_device())
        self.module.eval()
        with self.module.whole_sequences():  # each rank's own probe, even where a sequence-parallel group shares rows
            logp, _ = self.module(build_inputs(batch, self.remove_padding, self.share_prefix), 1.0, False)
        fsdp.reshard_all(self.module)
        logp = logp.float().cpu()  # (B, T)
        return [logp[i, : len(seq) - 1] for i, seq in enumerate(sequences)]


# The policy losses' token-mean metrics, logged as actor/<name> when the loss mode gives them (gpg gives none,
# dro only ppo_kl, as in verl).
PG_TOKEN_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")


def policy_loss_settings(cfg: ActorConfig, derived: Derived) -> dict[str, float | None]:
    """The keyword settings the chosen policy loss reads (names.POLICY_LOSS_READS), by its parameter names."""
    values = {"clip_ratio_low": derived.clip_low, "clip_ratio_high": derived.clip_high,
              "clip_ratio_c": cfg.clip_ratio_c, "tau_pos": cfg.tau_pos, "tau_neg": cfg.tau_neg,
              "policy_loss.dro_beta": (pl := cfg.policy_loss).dro_beta, "policy_loss.clip_cov_ratio": pl.clip_cov_ratio,
              "policy_loss.clip_cov_lb": pl.clip_cov_lb, "policy_loss.clip_cov_ub": pl.clip_cov_ub,
              "policy_loss.kl_cov_ratio": pl.kl_cov_ratio, "policy_loss.ppo_kl_coef": pl.ppo_kl_coef}
    return {POLICY_LOSS_PARAMS[name]: values[name] for name in POLICY_LOSS_READS[cfg.policy_loss.loss_mode]}


class Actor(Policy):
    """The trained policy: Policy + its update loop + the PPO/GRPO loss."""

    def __init__(self, module: CausalLMLogProbs, dev: Device, cfg: ActorConfig, derived: Derived, *,
                 remove_padding: bool, temperature: float, total_steps: int, seed: int, share_prefix: bool = False,
                 offload_activations: bool = False, bypass: RolloutCorrectionConfig | None = None):
        super().__init__(module, dev, remove_padding=remove_padding, temperature=temperature,
                         param_offload=cfg.fsdp_config.param_offload, share_prefix=share_prefix)
        self.cfg = cfg
        self.derived = derived
        self.bypass = bypass  # algorithm.rollout_correction in bypass mode: corrected per micro-batch in the loss
        self.bypass_metrics = rollout_corr.bypass_metric_names(bypass) if bypass is not None else ()
        self.policy_loss_fn = losses.get_policy_loss_fn(cfg.policy_loss.loss_mode)
        self.policy_loss_settings = policy_loss_settings(cfg, derived)
        if cfg.loss_agg_mode not in losses.AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode={cfg.loss_agg_mode!r}; known: {', '.join(losses.AGG_MODES)}")
        shuffle_seed = cfg.data_loader_seed if cfg.data_loader_seed is not None else seed
        self.loop = UpdateLoop(
            module, dev, cfg.optim, cfg.fsdp_config, grad_clip=cfg.grad_clip, total_steps=total_steps,
            micro_size=derived.micro_batch_per_rank,
            max_tokens=derived.max_token_len if cfg.use_dynamic_bsz else None,
            horizon=derived.agg_horizon, shuffle_seed=shuffle_seed if cfg.shuffle else None,
            offload_activations=offload_activations and dev.is_accelerator,  # on the host they are there already
        )

    # -- old log-probs -------------------------------------------------------------------------
    def compute_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor | None]:
        """Old-policy log-probs (B, T), ``actor/entropy`` (loss_agg_mode over all ranks' rows) and, with
        ``actor.calculate_sum_pi_squared``, sum_v pi_v^2 (B, T) of each response token's distribution (else None).
        Collective."""
        d = self.derived
        logp, entropy, *sum_sq = self.log_probs(
            batch, micro_size=d.log_prob_micro_batch_per_rank,
            max_tokens=d.log_prob_max_token_len if d.log_prob_use_dynamic_bsz else None, with_entropy=True,
            with_sum_pi_squared=self.cfg.calculate_sum_pi_squared,
        )
        return logp, {"actor/entropy": self._global_agg(entropy, batch.response_mask)}, (sum_sq[0] if sum_sq else None)

    def _global_agg(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        """agg_loss of (B, T) values over all ranks' rows (this rank's share, normalised globally, summed)."""
        device = self.dev.torch_device()
        num_tokens, num_seqs = global_counts(mask, device)
        part = losses.agg_loss(values, mask, self.cfg.loss_agg_mode, num_tokens=num_tokens.cpu(),
                               num_seqs=num_seqs.cpu(), horizon=self.derived.agg_horizon)
        return float(fsdp.all_reduce(part.reshape(1).to(device)).item())  # (1,) float32

    # -- update ---------------------------------------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """ppo_epochs over mini-batches of this rank's rows; one scheduler step. Collective.

        Needs advantages (and ref_logp when use_kl_loss) and old_logp, except when the config takes the
        old log-probs from the update (``Derived.old_logp_from_update``: one epoch, one mini-batch) and the
        trainer sent none. Returns verl-named metrics, reduced over ranks, micro-batches and mini-batches.
        """
        cfg, d = self.cfg, self.derived
        old_logp_from_update = batch.old_logp is None
        if batch.advantages is None:
            raise ValueError("update_actor: the batch needs advantages")
        if old_logp_from_update and not d.old_logp_from_update:
            raise ValueError("update_actor: the batch needs old_logp (the update's forward is reused only with "
                             "actor.old_log_prob=auto, ppo_epochs=1 and ppo_mini_batch_size=train_batch_size)")
        if old_logp_from_update and len(batch) != d.mini_batch_responses_per_rank:
            raise ValueError(f"update_actor: old log-probs from the update need the whole batch as one mini-batch: "
                             f"{len(batch)} rows on this rank, mini-batch {d.mini_batch_responses_per_rank}")
        if cfg.use_kl_loss and batch.ref_logp is None:
            raise ValueError("update_actor: actor.use_kl_loss=True needs ref_logp in the batch")
        loss_fn = functools.partial(self.micro_loss, old_logp_from_update=old_logp_from_update)
        stats = self.loop.run(batch, loss_fn, epochs=cfg.ppo_epochs, mini_batch_size=d.mini_batch_responses_per_rank,
                              loss_tokens=self.loss_tokens)
        metrics = {
            "actor/pg_loss": stats.per_step("pg_loss"),
            **{f"actor/{name}": stats.per_token(name) for name in PG_TOKEN_METRICS if name in stats.sums},
            **stats.optimizer_metrics("actor"),
        }
        if cfg.use_kl_loss:
            metrics["actor/kl_loss"] = stats.per_step("kl_loss")
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        if cfg.entropy_coeff != 0 or cfg.calculate_entropy:  # verl's name for the update forward's entropy
            metrics["actor/entropy_loss"] = stats.per_step("entropy")
        if old_logp_from_update:  # the update's forward is the old-log-prob pass: its entropy is actor/entropy
            metrics["actor/entropy"] = stats.per_step("entropy")
        if cfg.mask_truncated_completions:  # rows left out / rows seen, over the same micro-batches
            metrics["response_length/truncated_masked_frac"] = stats.sums["truncated"] / max(stats.sums["rows"], 1.0)
        if old_logp_from_update and batch.rollout_logp is not None:
            metrics["rollout/logp_diff_mean"] = stats.per_token("logp_diff")
            metrics["rollout/logp_diff_max"] = stats.maxes["logp_diff"]
        corrected = max(stats.sums.get("corrected_micro_batches", 0.0), 1.0)
        metrics.update({name: stats.sums[name] / corrected for name in self.bypass_metrics})  # verl: the micro-batch mean
        return metrics

    def micro_loss(self, micro: RolloutBatch, agg: dict, old_logp_from_update: bool = False) -> MicroLoss:
        """Policy loss (+ KL loss, - entropy bonus) of one micro-batch, normalised by ``agg``'s global counts.

        The loss sees ``micro.loss_tokens()`` and, when the trainer set them, the rollout-correction IS weights.
        Metric parts: the mini-batch losses (pg_loss, kl_loss, entropy) and token-weighted sums of the
        token means (pg_clipfrac, pg_clipfrac_lower, ppo_kl); with old log-probs from the update and
        rollout log-probs, the sum and maximum of |rollout - old log-prob| over valid tokens.
        """
        cfg, d = self.cfg, self.derived
        mask = self.loss_tokens(micro)  # (b, T): less rollout-rejected tokens and, if asked, truncated rows
        with_entropy = cfg.entropy_coeff != 0 or cfg.calculate_entropy or old_logp_from_update
        logp, entropy = self.forward(micro, with_entropy)  # (b, T) each
        old_logp = logp.detach() if old_logp_from_update else micro.old_logp  # (b, T): ratio exactly 1 from the update
        corr = None
        if self.bypass is not None:  # old_logp are the engine's; the correction comes from this forward's logp
            pg_loss, m, corr = rollout_corr.bypass_policy_loss(logp, old_logp, micro.advantages, mask, self.bypass,
                                                               agg_mode=cfg.loss_agg_mode, all_reduce=sums_over_ranks,
                                                               **self.policy_loss_settings, **agg)
        else:
            pg_loss, m = self.policy_loss_fn(logp, old_logp, micro.advantages, mask, agg_mode=cfg.loss_agg_mode,
                                             rollout_is_weights=micro.rollout_is_weights, **self.policy_loss_settings,
                                             **agg)
        n = mask.bool().sum()
        loss = pg_loss
        sums = {"pg_loss": pg_loss, **{name: value * n for name, value in m.items()}}  # the loss mode's token means
        if self.bypass is not None:  # every rank reports every name; a micro-batch without tokens adds 0 to the mean
            sums.update({name: mask.new_tensor(corr[name] if corr else 0.0, dtype=torch.float32)
                         for name in self.bypass_metrics})
            sums["corrected_micro_batches"] = mask.new_tensor(1.0 if corr else 0.0, dtype=torch.float32)
        maxes = {}
        if cfg.mask_truncated_completions:
            sums["truncated"] = truncated_rows(micro).sum().float()
            sums["rows"] = torch.tensor(float(len(micro)), device=mask.device)
        if cfg.use_kl_loss:
            kl = kl_lib.kl_penalty(logp, micro.ref_logp, cfg.kl_loss_type)
            kl_loss = losses.agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            sums["kl_loss"] = kl_loss
        if with_entropy:
            ent = entropy if cfg.entropy_coeff != 0 else entropy.detach()
            ent_loss = losses.agg_loss(ent, mask, cfg.loss_agg_mode, **agg)
            sums["entropy"] = ent_loss
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * ent_loss
        if old_logp_from_update and micro.rollout_logp is not None:
            diff = logp_abs_diff(micro.rollout_logp, old_logp, micro.response_mask)  # (n,) generated tokens
            sums["logp_diff"] = diff.sum()
            maxes["logp_diff"] = diff.max() if diff.numel() else diff.new_zeros(())
        return MicroLoss(loss, sums, maxes)

    def loss_tokens(self, batch: RolloutBatch) -> torch.Tensor:
        """(B, T) the tokens the losses count: ``batch.loss_tokens()`` (the response mask less rollout-rejected
        tokens), less the rows cut at the length limit when ``actor.mask_truncated_completions`` is on (their
        tokens then weigh nothing, as if the rows were absent)."""
        mask = batch.loss_tokens()
        if not self.cfg.mask_truncated_completions:
            return mask
        keep = ~truncated_rows(batch)  # (B,)
        return mask * keep.to(mask.device, mask.dtype)[:, None]


def sums_over_ranks(total: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, count) summed over every rank, in float32 (one all-reduce; HCCL has no float64 one). Collective."""
    both = fsdp.all_reduce(torch.stack([total.float(), count.float()]))
    return both[0].to(total.dtype), both[1].to(total.dtype)


def truncated_rows(batch: RolloutBatch) -> torch.Tensor:
    """(B,) bool on the response mask's device: the responses the engine stopped at the length limit
    (stop_reason 'length': no eos)."""
    if len(batch.stop_reason) != len(batch):
        raise ValueError("actor_rollout_ref.actor.mask_truncated_completions=True needs each response's stop_reason "
                         f"('stop' | 'length'); this batch has {len(batch.stop_reason)} for {len(batch)} rows")
    return torch.tensor([r == "length" for r in batch.stop_reason], device=batch.response_mask.device)
