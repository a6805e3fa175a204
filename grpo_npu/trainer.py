"""The RL loop: rollout -> reward -> [dynamic sampling] -> log-probs -> advantages -> update -> log.

``Trainer.fit()`` reads like the algorithm; each phase is a named method. The driver holds no model
weights: every model lives in the workers (``grpo_npu.workers``), which the trainer drives through a
worker group with the same calls whether the group is in-process or a set of Ray actors.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

from grpo_npu import config as C
from grpo_npu.algo.advantages import batch_advantages, estimator_inputs
from grpo_npu.algo.dapo import filter_groups, filter_metric_values
from grpo_npu.algo.kl import apply_kl_in_reward, make_kl_controller
from grpo_npu.algo.pf_ppo import resample_batch
from grpo_npu.algo.rollout_corr import correct_batch
from grpo_npu.batch import RolloutBatch, balance_order, cat_right_padded
from grpo_npu.checkpoint import CheckpointManager, checkpoint_hook, load_state_file, optim_changes, optim_settings, save_plan
from grpo_npu.cluster import Workers
from grpo_npu.data.rl_dataset import PromptBatch, PromptLoader, RLDataset
from grpo_npu.data.tokenizer import load_tokenizer
from grpo_npu.device import get_device
from grpo_npu.errors import StoppedBySignal, TrainingStopped
from grpo_npu.input_checks import check_inputs
from grpo_npu.logs import attach_run_log, detach
from grpo_npu.metrics import (compute_data_metrics, compute_throughput_metrics, compute_timing_metrics, reduce_metrics,
                              variance_proxy_metrics)
from grpo_npu.preflight import log_checks, run_checks
from grpo_npu.replay import RolloutSource, engine_needed
from grpo_npu.reward.manager import reward_managers
from grpo_npu.reward.score import make_compute_score
from grpo_npu.rollout import baseline_sampling, logp_diff_metrics, training_sampling, validation_sampling
from grpo_npu.rollout.base import SamplingConfig
from grpo_npu.run_control import StopRequest, Timer, Watchdog, stopped_workers_mean_signal
from grpo_npu.rundir import RunDirLock, prepare_fresh_start
from grpo_npu.samples import decode_samples, write_jsonl
from grpo_npu.step_limits import StepLimits
from grpo_npu.tracking import Tracker
from grpo_npu.workers.optim import check_optimizers

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
# Seeds of step s are base + s * SEED_STRIDE (+ rank inside the workers): a resumed run samples
# exactly what the uninterrupted run sampled, with no RNG state to carry.
SEED_STRIDE = 10_007
# A step whose rewards reach this size is a bad step (like a non-finite one): a reward of 1e30 in a group makes
# its std huge and every advantage ~0, so the step would "succeed" while learning nothing. Real rule and model
# rewards stay many orders of magnitude below it.
MAX_ABS_REWARD = 1e6


class Trainer:
    """GRPO / DAPO / PPO (and RLOO, REINFORCE++, Dr.GRPO, GSPO through the registries)."""

    def __init__(self, cfg: C.Config, workers=None) -> None:
        self.cfg = cfg
        t = cfg.trainer
        self.device = get_device(t.device)
        self.world_size = t.nnodes * t.n_gpus_per_node
        self.derived = C.derive(cfg, self.world_size)
        self.baseline_sampling = (baseline_sampling(cfg.actor_rollout_ref.rollout, self.derived.response_length)
                                  if "reward_baselines" in estimator_inputs(cfg.algorithm.adv_estimator) else None)  # ReMax
        if workers is None:  # a caller that brings its own workers has built them from its own inputs
            check_inputs(cfg, use_critic=self.derived.use_critic)
            check_optimizers(cfg, use_critic=self.derived.use_critic)
        self.run_dir = Path(t.default_local_dir)
        self.lock = RunDirLock(self.run_dir).acquire()  # before anything is written there; released by close()
        self.run_log = attach_run_log(self.run_dir)  # train.log: everything, tracebacks included
        try:
            rollout = cfg.actor_rollout_ref.rollout
            log_checks(run_checks(sleep_mode=rollout.name == "vllm" and rollout.enable_sleep_mode), log)

            self.tokenizer = load_tokenizer(cfg)
            self.train_set = RLDataset.from_config("train_files", self.tokenizer, cfg.data)
            self.loader = PromptLoader(self.train_set, self.derived.gen_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
            self.val_set = RLDataset.from_config("val_files", self.tokenizer, cfg.data) if cfg.data.val_files else None
            self.total_steps = t.total_training_steps or len(self.loader) * t.total_epochs

            compute_score = make_compute_score(cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                                               dict(cfg.reward_model.reward_kwargs),  # the data's scorers exist
                                               [*self.train_set.data_sources, *(self.val_set.data_sources if self.val_set else [])])
            self.reward_fn, self.val_reward_fn = reward_managers(cfg, self.tokenizer, compute_score,
                                                                 self.derived.response_length)
            kc = cfg.algorithm.kl_ctrl
            self.kl_ctrl = make_kl_controller(kc.type, kl_coef=kc.kl_coef, target_kl=kc.target_kl, horizon=kc.horizon)

            self.ckpt = CheckpointManager(self.run_dir, max_to_keep=t.max_actor_ckpt_to_keep,
                                          on_commit=checkpoint_hook(t.checkpoint_callback_class, cfg, self))
            self.resume_from = self.ckpt.resolve_resume(t.resume_mode, t.resume_from_path)
            self.rollouts = RolloutSource(cfg, self.derived, self.rollout_and_reward, self.tokenizer, first_step=(
                self.resume_from or (0,))[0] + 1, last_step=self.total_steps, baselines=self.baseline_sampling is not None)
            if self.resume_from is None:  # a fresh start: another run's files must not mix with this one's
                prepare_fresh_start(self.run_dir, t.existing_run_dir)
            self.workers = workers if workers is not None else Workers.build(
                cfg, total_training_steps=self.total_steps, with_rollout=engine_needed(cfg))  # replay: no engine unless validating
            self.limits = StepLimits(cfg, self.device, world_size=self.world_size, use_critic=self.derived.use_critic)
            self.tracker = Tracker(self.run_dir, tuple(t.logger), project=t.project_name, experiment=t.experiment_name,
                                   config_dict=C.to_dict(cfg), total_steps=self.total_steps)
            self.global_step = 0
            self.bad_steps = 0
            self._batches = iter(())
        except BaseException as exc:
            log.debug("the trainer could not start", exc_info=exc)
            detach(self.run_log)
            self.lock.release()
            raise

    # ------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to total_steps; returns the last step's metrics."""
        t = self.cfg.trainer
        self._resume()
        last: dict[str, float] = {}
        if self.global_step >= self.total_steps and not t.val_only:
            log.warning("the run in %s is already complete at step %d (trainer.total_training_steps=%d): nothing to "
                        "train; raise trainer.total_training_steps to continue it, or use a new "
                        "trainer.default_local_dir", self.run_dir, self.global_step, self.total_steps)
            return last
        log.info(save_plan(t.save_freq, self.total_steps, self.run_dir, t.max_actor_ckpt_to_keep,
                           self.cfg.actor_rollout_ref.actor.checkpoint.save_contents))
        if t.val_before_train and self.val_set is not None:
            last = self.validate()
            self.tracker.log(last, step=self.global_step)
        if t.val_only:
            return last
        with StopRequest() as stop, Watchdog(t.step_timeout_s) as watchdog, \
                stopped_workers_mean_signal(stop, lambda: self.global_step + 1):
            while self.global_step < self.total_steps:
                step = self.global_step + 1
                timer = Timer()
                self.workers.group.deadline = watchdog.start_step(step, timer)
                with timer("step"), self.workers.profiling(step):  # global_profiler: traces of the listed steps
                    self.limits.probe(timer)  # a CPU's bandwidth, measured again just before generating
                    batch, metrics = self.rollouts(step, timer)  # rollout_and_reward (+ dump), or a replayed dump
                    rows = (batch.prompt_lengths.tolist(), batch.response_lengths.tolist())  # generation order
                    if not self._sane_rewards(batch):
                        self._bad_step(step, f"non-finite rewards or rewards beyond +-{MAX_ABS_REWARD:g}")
                        continue
                    batch, model_metrics = self.score_with_models(batch, step, timer)
                    metrics.update(model_metrics)
                    batch, adv_metrics = self.advantages(batch, timer)
                    metrics.update(adv_metrics)
                    metrics.update(self.update(batch, step, timer))
                if not self._finite(metrics):
                    self._bad_step(step, "non-finite loss or gradient")
                    continue
                self.bad_steps = 0
                self.global_step = step
                metrics.update(self._step_metrics(batch, timer))
                metrics.update(self.limits.report(timer.seconds, metrics, *rows, n=self.derived.n))
                if t.test_freq > 0 and (step % t.test_freq == 0 or step == self.total_steps) and self.val_set is not None:
                    with timer("testing"):
                        metrics.update(self.validate())
                    metrics["timing_s/testing"] = timer.seconds["testing"]
                if t.save_freq > 0 and (step % t.save_freq == 0 or step == self.total_steps or stop.requested):
                    metrics["timing_s/save_checkpoint"] = self.save_checkpoint()
                self.tracker.log(metrics, step=step)
                watchdog.end_step()
                stop.step_done.set()
                last = metrics
                if stop.requested:
                    saved = (f"checkpoint saved in {self.run_dir}; resume with trainer.resume_mode=auto"
                             if t.save_freq > 0 else "no checkpoint (trainer.save_freq <= 0)")
                    raise StoppedBySignal(stop.signum, f"stopped by {stop.requested} at step {step}, {saved}")
        self.workers.group.deadline = None
        return last

    # ------------------------------------------------------------------------------------------
    # Phases
    # ------------------------------------------------------------------------------------------
    def rollout_and_reward(self, step: int, timer: Timer) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate n responses per prompt and score them; DAPO keeps generating until enough groups vary."""
        fg = self.cfg.algorithm.filter_groups
        want = self.cfg.data.train_batch_size
        kept: list[RolloutBatch] = []
        metrics: dict[str, float] = {}
        num_prompts = num_gen = 0
        while True:
            num_gen += 1
            prompts = self._next_prompts()
            with timer("gen"):
                batch, gen_metrics, greedy = self.generate(prompts, self.train_sampling(step, num_gen),
                                                           uid_prefix=f"s{step}g{num_gen}", baseline=self.baseline_sampling)
            metrics.update(gen_metrics)
            with timer("reward"):
                batch, reward_metrics = self.reward(batch, self.reward_fn)
                if greedy is not None:  # ReMax: a prompt's greedy response, scored, is its responses' baseline
                    greedy, failed = self.reward(greedy, self.reward_fn)  # its failed rows: reward_baseline/*
                    reward_metrics.update({"reward_baseline/" + k.removeprefix("reward/"): v for k, v in failed.items()})
                    batch = batch.replace(reward_baselines=greedy.token_level_scores.sum(-1).repeat_interleave(
                        len(batch) // len(greedy)))
            for key, value in reward_metrics.items():  # failed-row counts add up over generation batches
                metrics[key] = metrics.get(key, 0.0) + value
            if not fg.enable:
                return batch, metrics
            keep = filter_groups(batch.token_level_scores, batch.uid,  # (B, T): summed per row
                                 filter_metric_values(fg.metric, batch.token_level_scores, batch.reward_extra))
            batch = batch.select(keep)
            kept.append(batch)
            num_prompts += len(set(batch.uid))
            if num_prompts >= want:
                full = RolloutBatch.concat(kept)
                full = full.select(list(range(want * self.derived.n)))
                metrics["train/num_gen_batches"] = float(num_gen)
                return full, metrics
            if fg.max_num_gen_batches and num_gen >= fg.max_num_gen_batches:
                raise RuntimeError(
                    f"dynamic sampling: after {num_gen} generation batches only {num_prompts} of {want} prompts have "
                    f"groups with varying {fg.metric} (algorithm.filter_groups.max_num_gen_batches="
                    f"{fg.max_num_gen_batches}); raise it (0 = unlimited) or make the task less saturated")
            log.info("dynamic sampling: %d/%d prompts kept after %d batches; generating more", num_prompts, want, num_gen)

    def generate(self, prompts: PromptBatch, sampling: SamplingConfig, uid_prefix: str,
                 baseline: SamplingConfig | None = None) -> tuple[RolloutBatch, dict, RolloutBatch | None]:
        """B prompts -> B*n responses (rows i*n..i*n+n-1 answer prompt i), spread over the ranks; with ``baseline``
        sampling also one response per prompt, in the same engine wake (ReMax's greedy ones)."""
        n = sampling.n
        B = len(prompts)
        ids, mask = prompts.input_ids, prompts.attention_mask
        if B % self.world_size:  # too few prompts to split: repeat them and sample once each
            ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
            sampling = SamplingConfig(**{**sampling.__dict__, "n": 1})
        outs = self.workers.generate(ids, mask, sampling, step=self.global_step + 1,  # the step these weights serve
                                     baseline=baseline)
        return self._responses(prompts, outs, uid_prefix), reduce_metrics([o.metrics for o in outs]), (
            self._responses(prompts, [o.baseline for o in outs], f"{uid_prefix}b") if baseline else None)

    def _responses(self, prompts: PromptBatch, outs: list, uid_prefix: str) -> RolloutBatch:
        """The rank groups' outputs as rows, the same number of consecutive rows answering each prompt."""
        n = sum(len(o.response_ids) for o in outs) // len(prompts)
        response_ids = cat_right_padded([o.response_ids for o in outs], self.tokenizer.pad_token_id)
        response_mask = cat_right_padded([o.response_mask for o in outs], 0)
        rollout_logp = None
        if all(o.logprobs is not None for o in outs):
            rollout_logp = cat_right_padded([o.logprobs for o in outs], 0.0)
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
        return RolloutBatch(
            prompt_ids=prompts.input_ids.repeat_interleave(n, 0),
            prompt_mask=prompts.attention_mask.repeat_interleave(n, 0),
            response_ids=response_ids,
            response_mask=response_mask,
            uid=rep([f"{uid_prefix}-{i}" for i in prompts.indices]),
            data_source=rep(prompts.data_sources),
            ground_truth=rep(prompts.ground_truths),
            extra_info=rep(prompts.extra_infos),
            stop_reason=[r for o in outs for r in o.stop_reason],
            rollout_logp=rollout_logp,
        )

    def reward(self, batch: RolloutBatch, reward_fn) -> tuple[RolloutBatch, dict[str, float]]:
        """Scores on each response's last token, and the reward call's reward/timeouts and reward/errors."""
        out = reward_fn(batch.response_ids, batch.response_mask, batch.data_source, batch.ground_truth, batch.extra_info)
        return batch.replace(token_level_scores=out.token_level_scores, reward_extra=out.extra), out.metrics

    def old_logp_from_update(self, step: int) -> bool:
        """The actor update supplies the old log-probs itself (see actor.old_log_prob)."""
        return self.derived.old_logp_from_update and step > self.cfg.trainer.critic_warmup

    def score_with_models(self, batch: RolloutBatch, step: int, timer: Timer) -> tuple[RolloutBatch, dict[str, float]]:
        """Old log-probs (actor, unless they come from the update), reference log-probs and values,
        on balanced rank shards."""
        if self.cfg.trainer.balance_batch:
            order = balance_order((batch.prompt_lengths + batch.response_lengths).tolist(), self.world_size)
            batch = batch.select(order)
        metrics: dict[str, float] = {}
        if self.derived.old_logp_from_rollout:  # rollout correction's bypass mode
            batch = batch.replace(old_logp=batch.rollout_logp)
        elif not self.old_logp_from_update(step):
            with timer("old_log_prob"):
                old_logp, metrics, sum_sq = self.workers.compute_log_prob(batch)
                batch = batch.replace(old_logp=old_logp, sum_pi_squared=sum_sq)
        if self.derived.use_reference:
            with timer("ref"):
                batch = batch.replace(ref_logp=self.workers.compute_ref_log_prob(batch))
        if self.derived.use_critic:
            with timer("values"):
                batch = batch.replace(values=self.workers.compute_values(batch))
        return batch, metrics

    def advantages(self, batch: RolloutBatch, timer: Timer) -> tuple[RolloutBatch, dict[str, float]]:
        alg = self.cfg.algorithm
        metrics: dict[str, float] = {}
        with timer("adv"):
            rewards = batch.token_level_scores
            if alg.use_kl_in_reward:
                rewards, kl_metrics = apply_kl_in_reward(batch.token_level_scores, batch.old_logp, batch.ref_logp,
                                                         batch.response_mask, self.kl_ctrl, alg.kl_penalty)
                metrics.update({k: float(v) for k, v in kl_metrics.items()})
                self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=len(batch))
            batch = correct_batch(batch, alg.rollout_correction, metrics)  # rollout IS weights / rejection (verl's order)
            adv, ret = batch_advantages(batch, rewards, alg)
            batch = batch.replace(token_level_rewards=rewards, advantages=adv, returns=ret)
            if alg.use_pf_ppo:  # PF-PPO: the update (and the step's metrics) see a score-weighted resample
                batch = resample_batch(batch, alg.pf_ppo.reweight_method, alg.pf_ppo.weight_pow,
                                       seed=self.cfg.trainer.seed + (self.global_step + 1) * SEED_STRIDE)
        return batch, metrics

    def update(self, batch: RolloutBatch, step: int, timer: Timer) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.derived.use_critic:
            with timer("update_critic"):
                metrics.update(self.workers.update_critic(batch))
        if step > self.cfg.trainer.critic_warmup:
            with timer("update_actor"):
                metrics.update(self.workers.update_actor(batch))
        if batch.rollout_logp is not None and not (self.old_logp_from_update(step) or self.derived.old_logp_from_rollout):
            metrics.update(logp_diff_metrics(batch.rollout_logp, batch.old_logp, batch.response_mask))
        if batch.sum_pi_squared is not None:  # actor.calculate_sum_pi_squared
            metrics.update(variance_proxy_metrics(batch, metrics.get("actor/grad_norm")))
        return metrics

    def validate(self) -> dict[str, float]:
        """Generate on the validation set with val_kwargs; val-core/<data_source>/reward/mean@N."""
        rollout = self.cfg.actor_rollout_ref.rollout
        sampling = validation_sampling(rollout, self.derived.response_length, seed=rollout.seed)
        n = sampling.n
        loader = PromptLoader(self.val_set, self._val_batch_size(), shuffle=self.cfg.data.validation_shuffle,
                              seed=self.cfg.data.seed, drop_last=False)
        scores: dict[str, list[float]] = defaultdict(list)
        samples = []
        for prompts in loader:
            batch, _, _ = self.generate(prompts, sampling, uid_prefix="val")
            batch, _ = self.reward(batch, self.val_reward_fn)
            for source, extra in zip(batch.data_source, batch.reward_extra):
                scores[source].append(float(extra["score"]))
            if len(samples) < self.cfg.trainer.log_val_generations:
                samples += decode_samples(self.tokenizer, batch, self.cfg.trainer.log_val_generations - len(samples))
        for s in samples:
            log.info("val sample (score %.2f)\n  prompt: %s\n  response: %s", s["score"], s["prompt"][-200:], s["response"])
        if self.cfg.trainer.validation_data_dir:
            write_jsonl(Path(self.cfg.trainer.validation_data_dir) / f"val_step_{self.global_step}.jsonl", samples)
        return {f"val-core/{src}/reward/mean@{n}": sum(v) / len(v) for src, v in scores.items()}

    # ------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> float:
        start, step = time.perf_counter(), self.global_step
        tmp = self.ckpt.begin(step)
        try:
            self.workers.save_checkpoint(str(tmp), step)  # per-rank shards (+ an HF export if hf_model)
            torch.save({
                "global_step": step,
                "loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "rng": self.device.get_rng_state(),
                "world_size": self.world_size,
                "optim": optim_settings(self.cfg),
            }, tmp / TRAINER_STATE)
        except BaseException as exc:  # nothing of it is kept; a full disk is said in one line naming the checkpoint
            raise self.ckpt.abort(step, tmp, exc)
        self.ckpt.commit(step, tmp)
        log.info("saved checkpoint global_step_%d", step)
        return time.perf_counter() - start

    def _resume(self) -> None:
        if self.resume_from is None:
            return
        step, path = self.resume_from
        state = load_state_file(Path(path) / TRAINER_STATE)
        changed = optim_changes(state.get("optim", {}), self.cfg)
        self.workers.load_checkpoint(str(path))
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.device.set_rng_state(state["rng"])
        self.global_step = int(state["global_step"])
        self.tracker.truncate_after(self.global_step)
        if changed:
            log.warning("resumed with changed optimizer settings, honoured from here on: %s", "; ".join(changed))
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world != self.world_size:
            log.warning("resumed on %d ranks from a checkpoint written by %d: model and optimizer resharded, data "
                        "position kept, per-rank RNG streams re-derived from trainer.seed (the run is no longer "
                        "bitwise-reproducible against an uninterrupted one)", self.world_size, saved_world)
        log.info("resumed from %s (step %d)", path, self.global_step)

    # ------------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------------
    def train_sampling(self, step: int, attempt: int) -> SamplingConfig:
        r = self.cfg.actor_rollout_ref.rollout
        return training_sampling(r, self.derived.response_length, seed=r.seed + step * SEED_STRIDE + attempt)

    def _next_prompts(self) -> PromptBatch:
        for prompts in self._batches:
            return prompts
        self._batches = iter(self.loader)  # next epoch (the loader tracks epoch and position)
        return next(self._batches)

    def _val_batch_size(self) -> int | None:
        size = self.cfg.data.val_batch_size if self.cfg.data.val_batch_size is not None else len(self.val_set)
        return max(self.world_size, size - size % self.world_size)

    def _step_metrics(self, batch: RolloutBatch, timer: Timer) -> dict[str, float]:
        seconds, num_tokens = dict(timer.seconds), batch.num_tokens()
        metrics = compute_data_metrics(batch, use_critic=self.derived.use_critic,
                                       max_response_length=self.derived.response_length,
                                       max_prompt_length=self.derived.prompt_length,
                                       reward_component_keys=self.cfg.algorithm.gdpo_reward_keys or ())
        metrics.update(compute_timing_metrics(seconds, num_tokens, num_response_tokens=int(batch.response_mask.sum())))
        metrics.update(compute_throughput_metrics(num_tokens, seconds["step"], self.world_size))
        metrics.update(reduce_metrics(self.workers.memory_metrics()))
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    def _sane_rewards(self, batch: RolloutBatch) -> bool:
        """Finite and within +-MAX_ABS_REWARD: a larger reward swamps every group's advantage (all become 0)."""
        scores = batch.token_level_scores
        return bool(torch.isfinite(scores).all()) and float(scores.abs().max()) <= MAX_ABS_REWARD

    @staticmethod
    def _finite(metrics: dict[str, float]) -> bool:
        keys = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
        return all(math.isfinite(metrics[k]) for k in keys if k in metrics) and not metrics.get("actor/skipped_steps")

    def _bad_step(self, step: int, why: str) -> None:
        self.bad_steps += 1
        log.warning("step %d skipped: %s (%d in a row)", step, why, self.bad_steps)
        self.tracker.log({"train/bad_step": 1.0}, step=step)
        if self.bad_steps >= self.cfg.trainer.max_bad_steps:
            saved = "no checkpoint (trainer.save_freq <= 0)"
            if self.cfg.trainer.save_freq > 0:
                self.save_checkpoint()
                saved = f"saved the last good state as global_step_{self.global_step} in {self.run_dir}"
            raise TrainingStopped(f"{self.bad_steps} consecutive bad steps (last: {why}); {saved}")

    def _log_limits(self) -> None:
        """The end-of-run verdict and, where there is one, the advice (a closer: a failure here closes the rest)."""
        if self.limits.reports:
            for line in filter(None, (self.limits.verdict(), self.limits.advice())):
                log.info(line)

    def close(self) -> None:
        for closer in (self._log_limits, self.tracker.close, self.reward_fn.close, self.val_reward_fn.close,
                       self.workers.close, lambda: detach(self.run_log), self.lock.release):
            try:
                closer()
            except Exception as exc:  # keep closing the rest
                log.warning("error while closing: %s", exc)
