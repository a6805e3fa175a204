"""Decode-step attention for the transformers rollout: grouped-query attention without copying the KV cache.

transformers' ``sdpa`` attention hands SDPA a padding mask during generation, and with a mask it
expands every layer's whole KV cache from Nkv to Nq heads (``repeat_kv``: a full copy of the cache)
at every decoding step, because the fused GQA path of SDPA is only taken without a mask. With one
query token per row the same attention needs no copy: the G = Nq / Nkv query heads that share a
KV head become G query rows of that head, (B, Nq, 1, D) -> (B, Nkv, G, D), and the padding mask
(B, 1, 1, S) broadcasts over them. Each output is the same softmax-weighted sum over the same keys,
so the tokens generated are the same (tests/rollout/test_hf_rollout.py).

Prefill (several query tokens) and models without grouped heads go to transformers' own
``sdpa_attention_forward`` unchanged. :func:`decode_attention` switches a model whose
``attn_implementation`` is ``"sdpa"`` (or ``"grpo_npu"``, the ops attention patched in for shared-prompt
training and packed rows, where it runs its PyTorch reference) to this entry for the duration of a
generation call and back afterwards; training forwards never see it. Other implementations (the
``"grpo_npu"`` attention on NPU, whose fused kernel takes GQA natively; eager; flash) are left as they are. On CPU the
one-token step is three batched products rather than SDPA's CPU kernel (:func:`_cpu_decode`).

Measured on the step benchmark's 3M Qwen2 (4 heads, 2 KV heads; 16 prompts x 4 samples x 64
tokens, 2 threads): docs/performance.md.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from grpo_npu.ops import attention as attention_op
from grpo_npu.ops.patch import ATTN_IMPLEMENTATION as PATCHED  # grpo_npu.ops' attention: replaced where unfused

ATTN_IMPLEMENTATION = "grpo_npu_decode"  # the name registered in transformers' AttentionInterface
REPLACES = "sdpa"  # the implementation this one stands in for
_registered = False


def decode_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """``sdpa_attention_forward`` with the decode step's GQA done by reshaping queries. BNSD in, (B, S, Nq, D) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, head_dim = query.shape  # (B, Nq, Sq, D)
    kv_heads = key.shape[1]  # key/value: (B, Nkv, Skv, D)
    if q_len != 1 or heads == kv_heads or dropout or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)  # (B, Nkv, G, D): q head h = kv * G + g
    if query.device.type == "cpu":
        out = _cpu_decode(grouped, key, value, attention_mask, scaling)
    else:
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)  # (B, Nkv, G, D)
    return out.reshape(batch, 1, heads, head_dim), None  # (B, 1, Nq, D), as sdpa_attention_forward returns


def _cpu_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                scaling: float | None) -> torch.Tensor:
    """Softmax attention as three batched products, for one query row per head group on CPU.

    SDPA's CPU kernel tiles queries and keys for long prompts; with G query rows per KV head it spends most
    of a decode step on that set-up (137 ms of a 506 ms generation, 64 rows x 64 tokens of the step
    benchmark's 3M model, profiled). ``mask``: bool (True = attend) or additive, broadcasting over (B, Nkv, G, S).
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (B, Nkv, G, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)  # (B, Nkv, G, S)
    return torch.matmul(weights, value)  # (B, Nkv, G, D)


def register() -> None:
    """Add ``ATTN_IMPLEMENTATION`` (with sdpa's mask builder) to transformers' registries; adds a key, changes none."""
    global _registered
    if _registered:
        return
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, decode_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _registered = True


@contextlib.contextmanager
def decode_attention(model: nn.Module) -> Iterator[bool]:
    """Inside the block an ``sdpa`` model (or a ``grpo_npu``-attention one on its reference path) attends through
    :func:`decode_attention_forward`; yields whether it does. The model's own implementation is back after."""
    config = getattr(model, "config", None)
    set_impl = getattr(model, "set_attn_implementation", None)
    original = getattr(config, "_attn_implementation", None)
    if config is None or set_impl is None or original not in _replaceable(model):
        yield False
        return
    register()
    set_impl(ATTN_IMPLEMENTATION)
    try:
        yield config._attn_implementation == ATTN_IMPLEMENTATION
    finally:
        set_impl(original)


def _replaceable(model: nn.Module) -> tuple[str, ...]:
    """``sdpa`` everywhere; also the ``grpo_npu`` attention (patched in for shared-prompt packing and for packed
    rows, model.use_remove_padding) wherever a decode step runs its plain-PyTorch reference, which there is
    masked attention with the KV heads expanded: the ``reference`` backend, and the ``cuda`` one, whose
    flash kernel serves packed rows only. Its NPU kernel takes GQA natively and stays."""
    param = next(model.parameters(), None)
    if param is None or attention_op.BACKEND.pick(param) == "npu":
        return (REPLACES,)
    return (REPLACES, PATCHED)
