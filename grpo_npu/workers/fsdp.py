"""FSDP2 plumbing shared by the actor, reference and critic.

- process group: :func:`init_distributed` (env/tcp rendezvous, the device layer's backend);
- models: :func:`load_hf_model` reads the checkpoint on rank 0 only (other ranks build on the meta
  device), :func:`shard_model` applies ``fully_shard`` per decoder layer then to the root, and
  :func:`load_full_state_dict` broadcasts rank 0's weights into the shards;
- weights out: :func:`iter_full_state_dict` streams one gathered parameter at a time (never two full
  copies of the model), :func:`export_hf` writes safetensors + config + tokenizer;
- sharded checkpoints: :func:`save_sharded` / :func:`load_sharded` (torch.distributed.checkpoint);
- host offload of parameters and optimizer state between phases, and the global gradient norm.

Every function that gathers or reduces is collective: all ranks call it in the same order.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import re
import socket
from contextlib import closing
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from grpo_npu import compat
from grpo_npu.checkpoint import load_state_file
from grpo_npu.device import Device, named_dtype
from grpo_npu.errors import UserError
from grpo_npu.io import atomic_path, write_json
from grpo_npu.workers.load_errors import dcp_call, unreadable_weights

log = logging.getLogger(__name__)

# FSDP2 lives in torch.distributed.fsdp from torch 2.6, in torch.distributed._composable.fsdp on torch 2.5.
_FSDP2 = compat.fsdp2()
CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy = _FSDP2.CPUOffloadPolicy, _FSDP2.FSDPModule, _FSDP2.MixedPrecisionPolicy
OffloadPolicy, fully_shard = _FSDP2.OffloadPolicy, _FSDP2.fully_shard

# Default attention kernel: SDPA runs everywhere and isolates packed sequences via position_ids.
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"
# HF's own default shard size for safetensors exports.
EXPORT_SHARD_BYTES = 5 * 1024**3
SAFETENSORS_INDEX = "model.safetensors.index.json"
DCP_SUBDIR = "dcp"


# ------------------------------------------------------------------------------------------------
# Process group
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(dev: Device, *, rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout: Any = None) -> bool:
    """Initialise the default process group with the device layer's backend; False if one was already up.
    On accelerators it is mixed (``cpu:gloo,npu:hccl``); ``timeout`` (a timedelta): actor_rollout_ref.nccl_timeout."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) already exists; "
                f"cannot join as rank {rank} of {world_size}"
            )
        return False
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    dist.init_process_group(backend=dev.dist_backend(mixed=True), init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, **({"timeout": timeout} if timeout else {}))
    return True


def destroy_distributed() -> None:
    """Leave the default process group and forget the meshes built on it."""
    _MESHES.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


_MESHES: dict[tuple[object, str, int], DeviceMesh] = {}


def build_mesh(dev: Device, fsdp_size: int) -> DeviceMesh:
    """A 1-D shard mesh over all ranks, or a 2-D (replicate, shard) HSDP mesh when 1 <= fsdp_size < world.

    Cached per (default group, device kind, fsdp_size): actor, reference and critic share process groups.
    """
    ws = dist.get_world_size()
    shard = shard_group_size(ws, fsdp_size)
    shape, names = ((ws,), ("fsdp",)) if shard == ws else ((ws // shard, shard), ("ddp", "fsdp"))
    key = (dist.group.WORLD, dev.kind, shape[-1])  # the group object itself: a new group never hits
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(dev.kind, shape, mesh_dim_names=names)
    return _MESHES[key]


def shard_group_size(world_size: int, fsdp_size: int) -> int:
    """Ranks one parameter is sharded over: all of them for fsdp_size -1 (or the world size), else fsdp_size."""
    if fsdp_size in (-1, world_size):
        return world_size
    if fsdp_size < 1 or world_size % fsdp_size:
        raise ValueError(f"fsdp_config.fsdp_size={fsdp_size} must be -1 or divide the world size {world_size}")
    return fsdp_size


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum | max | min) over the default group; returns ``t``."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=ops[op])
    return t


# ------------------------------------------------------------------------------------------------
# Loading and sharding
# ------------------------------------------------------------------------------------------------
def resolve_dtype(name: str, dev: Device) -> torch.dtype:
    """A config dtype name; ``auto`` is bf16 on NPU/GPU and fp32 on CPU."""
    return dev.default_dtype() if name == "auto" else named_dtype(name)


def load_hf_config(path: str, override_config: dict[str, Any], *, trust_remote_code: bool, num_labels: int | None = None):
    """The HF config of ``path`` with ``override_config`` applied (attn_implementation included)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory (model.path expects a local HF checkpoint)")
    overrides = dict(override_config)
    attn = overrides.pop("attn_implementation", DEFAULT_ATTN_IMPLEMENTATION)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, attn_implementation=attn)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"model.override_config.{key}: {type(config).__name__} has no such field")
        setattr(config, key, value)
    if num_labels is not None:  # a value head: one output, no dropout (PPO critics use none)
        config.num_labels = num_labels
        config.classifier_dropout = 0.0
    return config


def load_hf_model(path: str, config, *, dtype: torch.dtype, value_head: bool, trust_remote_code: bool,
                  key: str = "model.path") -> nn.Module:
    """Rank 0 reads the checkpoint (on the host); other ranks build the same model on the meta device.

    A weight file that cannot be read (truncated, not safetensors / torch data) is a UserError naming ``key``
    (the config key that gave ``path``) and the file; any other failure is raised as it is."""
    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            return auto.from_pretrained(path, config=config, dtype=dtype, trust_remote_code=trust_remote_code)
        except (SafetensorError, RuntimeError, pickle.UnpicklingError, EOFError) as exc:
            problem = unreadable_weights(path)
            if problem is None:  # the files read fine: not theirs
                raise
            raise UserError(f"{key}={path}: cannot read its weights ({problem})") from exc
    with torch.device("meta"):
        return auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF decoder (``model.model.layers``), each becoming one FSDP unit."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at .model.layers to shard")
    return list(layers)


def shard_model(
    root: nn.Module,
    layers: list[nn.Module],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    master_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
    reshard_after_forward: bool,
    forward_prefetch: bool,
) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm and heads, tied or not)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype) if param_dtype != master_dtype else MixedPrecisionPolicy()
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    fully_shard(root, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    if forward_prefetch:
        for layer, nxt in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([nxt])
    return root


def load_full_state_dict(root: nn.Module, full_state: dict[str, torch.Tensor], device: torch.device, *, cpu_offload: bool) -> None:
    """Fill sharded ``root`` from rank 0's full state dict (other ranks pass {}); buffers are broadcast too."""
    if dist.get_world_size() == 1:
        return  # the single rank loaded real weights; fully_shard kept them
    if dist.get_rank() != 0:
        root.to_empty(device="cpu" if cpu_offload else device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload)
    set_model_state_dict(root, full_state, options=options)
    for buf in root.buffers():  # non-persistent buffers (rotary inv_freq) are not in the state dict
        local = buf.to_local() if isinstance(buf, DTensor) else buf
        staged = local.to(device)
        dist.broadcast(staged, src=0)
        local.copy_(staged)


# ------------------------------------------------------------------------------------------------
# Weights out
# ------------------------------------------------------------------------------------------------
def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def is_sharded(module: nn.Module) -> bool:
    """The module's parameters are FSDP2 shards (DTensors): reading them whole is a gather."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def iter_full_state_dict(
    module: nn.Module, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for every key of ``module.state_dict()``, gathering one at a time.

    Shards are cast to ``dtype`` BEFORE the all-gather (a bf16 sync moves and holds bf16 only).
    Tied weights appear under each of their names (as ``state_dict()`` lists them), as one tensor: gathered
    and cast once, so a consumer can tell the pair (the direct vLLM sync copies it once). Collective.
    """
    named = _named_tensors(module)
    aliases = _tied_aliases(module)
    tied = {id(named[name]) for name in aliases}
    done: dict[int, torch.Tensor] = {}  # a tied tensor's id -> what its first name yielded
    for name in module.state_dict().keys():
        if name in aliases:
            yield name, done[id(named[name])]
            continue
        t = named[name].detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        full = t.full_tensor() if isinstance(t, DTensor) else t
        full = full if device is None else full.to(device)
        if id(named[name]) in tied:
            done[id(named[name])] = full
        yield name, full


def _tied_aliases(module: nn.Module) -> set[str]:
    """State-dict names that alias an earlier name's tensor (the tied lm_head.weight)."""
    seen: dict[int, str] = {}
    aliases = set()
    named = _named_tensors(module)
    for name in module.state_dict().keys():
        key = id(named[name])
        if key in seen:
            aliases.add(name)
        seen[key] = name
    return aliases


def export_hf(
    module: nn.Module, out_dir: str, *, tokenizer_path: str | None, dtype: torch.dtype | None = None,
    shard_bytes: int = EXPORT_SHARD_BYTES, tensors: Iterator[tuple[str, torch.Tensor]] | None = None,
) -> None:
    """Write ``module`` (an HF PreTrainedModel, possibly sharded) as a from_pretrained-loadable directory.

    All ranks gather (``tensors``, on the host, instead of the module's own: LoRA's merged weights); rank 0
    writes safetensors files of at most ``shard_bytes`` each (temporary name, then renamed), the index, the
    config and the tokenizer.
    """
    rank0 = dist.get_rank() == 0 if dist.is_initialized() else True
    skip = _tied_aliases(module)
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
    files: list[tuple[str, list[str]]] = []
    bucket: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        name = f"model-part{len(files) + 1:05d}.safetensors"
        with atomic_path(os.path.join(out_dir, name)) as tmp:
            save_file(bucket, str(tmp), metadata={"format": "pt"})
        files.append((name, list(bucket)))
        bucket, size = {}, 0

    for name, full in tensors if tensors is not None else iter_full_state_dict(module, dtype=dtype, device="cpu"):
        if not rank0 or name in skip:
            continue
        nbytes = full.numel() * full.element_size()
        if bucket and size + nbytes > shard_bytes:
            flush()
        bucket[name] = full.contiguous()
        size += nbytes
    if not rank0:
        return
    flush()
    if len(files) == 1:
        os.replace(os.path.join(out_dir, files[0][0]), os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map = {}
        for i, (name, keys) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(os.path.join(out_dir, name), os.path.join(out_dir, final))
            weight_map.update({k: final for k in keys})
        write_json(os.path.join(out_dir, SAFETENSORS_INDEX), {"metadata": {}, "weight_map": weight_map}, indent=2, sort_keys=True)
    config = copy.deepcopy(module.config)  # the live model's config stays as it is
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(out_dir)
    if getattr(module, "generation_config", None) is not None and getattr(module, "can_generate", lambda: False)():
        module.generation_config.save_pretrained(out_dir)
    if tokenizer_path:
        AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out_dir)


# ------------------------------------------------------------------------------------------------
# Sharded checkpoints
# ------------------------------------------------------------------------------------------------
def save_sharded(out_dir: str, root: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]) -> None:
    """Each rank writes its model (+ optimizer) shard with DCP under ``out_dir/dcp`` and ``extra_rank{r}.pt``."""
    state: dict[str, Any] = {"model": get_model_state_dict(root)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(root, optimizer)
    dcp_call(dcp.save, out_dir, state, checkpoint_id=os.path.join(out_dir, DCP_SUBDIR))
    with atomic_path(os.path.join(out_dir, f"extra_rank{dist.get_rank()}.pt")) as tmp:
        torch.save(extra, tmp)
    dist.barrier()


def load_sharded(in_dir: str, root: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Inverse of :func:`save_sharded`; returns this rank's ``extra`` dict.

    Any world size: DCP reshards the model and optimizer onto this run's ranks. When the checkpoint was written
    by another number of ranks, every rank takes rank 0's extras (the schedule and shuffle state are the same on
    every rank) with ``rng`` set to None: per-rank RNG streams cannot be mapped, the caller re-derives them.
    """
    dcp_dir = os.path.join(in_dir, DCP_SUBDIR)
    saved_ranks = len([n for n in os.listdir(in_dir) if re.fullmatch(r"extra_rank\d+\.pt", n)]) if os.path.isdir(in_dir) else 0
    same_world = saved_ranks == dist.get_world_size()
    extra_path = os.path.join(in_dir, f"extra_rank{dist.get_rank() if same_world else 0}.pt")
    for path in (dcp_dir, extra_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {in_dir!r} has no {os.path.basename(path)}")
    state: dict[str, Any] = {"model": get_model_state_dict(root)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(root, optimizer)
    dcp_call(dcp.load, in_dir, state, checkpoint_id=dcp_dir)
    set_model_state_dict(root, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(root, optimizer, state["optimizer"])
    extra = load_state_file(extra_path)
    if not same_world:
        extra["rng"] = None
    return extra


# ------------------------------------------------------------------------------------------------
# Host offload
# ------------------------------------------------------------------------------------------------
def move_model(root: nn.Module, device: torch.device | str) -> None:
    """Move sharded parameters and buffers (param_offload between phases); FSDP2 re-registers shards."""
    root.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every optimizer state tensor (exp_avg, exp_avg_sq; sharded DTensors stay sharded) to ``device``."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------
def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm (0-d float32 tensor, same on every rank) of the gradients of ``params``. Collective."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        raise ValueError("grad_norm: no parameter has a gradient (was backward called?)")
    total = compat.total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return total.float()


def scale_grads(params: list[nn.Parameter], factor: float) -> None:
    """Multiply every gradient by ``factor`` in place (clipping)."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    """Every FSDP unit in ``module`` (itself included), root first."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard_all(module: nn.Module) -> None:
    """Free gathered parameters of every FSDP unit in ``module`` (after forward-only passes)."""
    for m in fsdp_units(module):
        m.reshard()
