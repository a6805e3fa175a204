"""Tiled MLP (verl's ``model.tiled_mlp``): each decoder layer's MLP runs over its tokens in tiles.

The MLP is the per-token part of a layer whose intermediate activations are the largest: gate, up and their
product are tokens x intermediate_size each (4.9x the hidden size in Qwen2.5-0.5B), and in a backward pass
(gradient checkpointing recomputes the layer first) they all exist at once for every token of the
micro-batch. Tiled, the tokens are split into ``num_shards`` row tiles:

- with autograd recording, each tile runs under non-reentrant activation checkpointing: forward keeps only
  the tile's input, and backward recomputes one tile at a time, so the MLP's intermediates exist for one
  tile only. The parameter gradients are summed over the tiles by autograd itself;
- without (log-prob passes, decoding), the tiles run one after another, which bounds the same peak.

The result and the gradients are the MLP's, up to the order of floating-point sums; the cost is one more
MLP forward per backward. It wraps whatever the MLP's forward is at the time (HF's, grpo_npu's fused SwiGLU,
LoRA-wrapped projections), as an instance attribute like :mod:`grpo_npu.ops.patch`; FSDP2's and gradient
checkpointing's hooks wrap ``__call__`` and are untouched. verl patches the MLP class of Llama and Qwen2/3
models for the whole process; this wraps the MLPs of the models it is given, of any architecture whose
decoder layers have an ``mlp`` module.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

TILED = "_grpo_npu_tiled_mlp"  # the attribute marking a wrapped MLP (its value: the number of tiles)


def tiled_forward(forward: Callable[[torch.Tensor], torch.Tensor], num_shards: int, x: torch.Tensor) -> torch.Tensor:
    """``forward`` over the rows of ``x`` (..., hidden) in ``num_shards`` tiles (see the module docstring)."""
    rows = x.reshape(-1, x.shape[-1])
    tiles = rows.chunk(num_shards)
    if torch.is_grad_enabled():
        outs = [checkpoint(forward, tile, use_reentrant=False) for tile in tiles]
    else:
        outs = [forward(tile) for tile in tiles]
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.view(*x.shape[:-1], out.shape[-1])


def tile_mlps(layers: list[nn.Module], num_shards: int, key: str) -> int:
    """Wrap the ``mlp`` of every layer in :func:`tiled_forward`; the number wrapped. ``key`` names the setting
    in the one-line error for a layer without an ``mlp`` module or a count below 1."""
    if num_shards < 1:
        raise ValueError(f"{key}.num_shards={num_shards} must be >= 1")
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(f"{key}.enabled=True: decoder layer {i} ({type(layer).__name__}) has no mlp module "
                             "to tile; set it to False for this model")
        if getattr(mlp, TILED, None):
            continue
        mlp.forward = functools.partial(tiled_forward, mlp.forward, num_shards)
        setattr(mlp, TILED, num_shards)
    return len(layers)
