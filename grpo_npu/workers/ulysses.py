"""Ulysses sequence parallelism for the trained and scored models: ``sp`` ranks share each packed micro-batch.

The driver sends every rank of a sequence-parallel group the same rows (:class:`grpo_npu.rank_groups.RankGroups`),
so each rank builds the same packed micro-batch, (1, n_tokens). :func:`shard_inputs` pads it to a multiple of
``sp`` with one extra segment of its own and keeps this rank's contiguous 1/sp of the tokens; attention swaps
tokens for heads and back (:mod:`grpo_npu.ops.sequence_parallel`), everything else runs on the slice. A
response token is predicted by the hidden state just before it, so the rank holding that position computes its
log-prob (or value); :func:`gather_predictions` assembles all N of them on every rank of the group. The group's
ranks then compute the same loss, and each one's backward reaches only the tokens it holds.

Gradient scale: the gather is an all-reduce (sum) of the ranks' disjoint parts, whose backward sums the ranks'
identical output gradients, ``sp`` times one rank's. The update loop normalises by token counts summed over all
ranks, which counts each group's rows ``sp`` times. The two factors cancel, and FSDP's average over all ranks
then equals the data-parallel gradient over the groups: 1 rank, 2 ranks of one group and 2 groups of 1 agree
(``tests/workers/test_ulysses.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grpo_npu.ops.sequence_parallel import SumOverGroup, heads_per_rank
from grpo_npu.workers.model_inputs import ModelInputs

_groups: dict[int, dist.ProcessGroup | None] = {}


def sequence_group(size: int) -> dist.ProcessGroup | None:
    """This rank's group of ``size`` consecutive ranks (None for 1). Collective the first time for a size: every
    rank creates every group, in the same order, as ``new_group`` requires."""
    if size == 1:
        return None
    if size not in _groups:
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = None
        for first in range(0, world, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine = group
        _groups[size] = mine
    return _groups[size]


def check_heads(hf_config, size: int, key: str) -> None:
    """Refuse, in one line naming ``key``, a model whose attention heads ``size`` ranks cannot split."""
    heads = hf_config.num_attention_heads
    reason = heads_per_rank(heads, getattr(hf_config, "num_key_value_heads", None) or heads, size)
    if reason is not None:
        raise ValueError(f"{key}.ulysses_sequence_parallel_size={size}: {reason}")


def shard_inputs(inputs: ModelInputs, group: dist.ProcessGroup) -> tuple[ModelInputs, torch.Tensor]:
    """This rank's slice of a packed micro-batch, and the (n,) indices into the N predictions of those it holds.

    The tokens are padded to a multiple of sp with one segment of their own (token 0, positions from 0), which no
    prediction reads. The slice's ``predict_index`` and ``labels`` are the n predictions whose hidden state lies in
    it; ``packed_kwargs`` keep the whole (padded) sequence's offsets, which attention reads after its all-to-all,
    and add ``sp_group``.
    """
    if inputs.attention_mask is not None or "cu_seq_lens_q" not in inputs.packed_kwargs:
        raise ValueError("sequence parallelism needs packed rows (model.use_remove_padding=True)")
    if "kv_index" in inputs.packed_kwargs:
        raise ValueError("sequence parallelism does not split shared-prompt packing (model.share_prompt_prefix)")
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, pos, kwargs = inputs.input_ids, inputs.position_ids, dict(inputs.packed_kwargs)
    total = ids.shape[1]
    pad = -total % sp
    if pad:
        ids = F.pad(ids, (0, pad))
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)[None]], 1)
        cu = kwargs["cu_seq_lens_q"]
        cu = torch.cat([cu, cu[-1:] + pad])
        longest = max(kwargs["max_length_q"], pad)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    width = (total + pad) // sp
    lo = rank * width
    where = ((inputs.predict_index >= lo) & (inputs.predict_index < lo + width)).nonzero()[:, 0]  # (n,)
    local = dataclasses.replace(
        inputs, input_ids=ids[:, lo:lo + width], position_ids=pos[:, lo:lo + width],
        predict_index=inputs.predict_index[where] - lo, labels=inputs.labels[where],
        packed_kwargs={**kwargs, "sp_group": group})
    return local, where


def gather_predictions(values: torch.Tensor, where: torch.Tensor, total: int,
                       group: dist.ProcessGroup) -> torch.Tensor:
    """(n, ...) outputs at this rank's predictions -> (total, ...) of the whole micro-batch, on every rank of the
    group (differentiable; see the module docstring for the gradient's scale). Collective."""
    full = values.new_zeros((total, *values.shape[1:])).index_put((where,), values)
    return SumOverGroup.apply(full, group)


def predictions(inputs: ModelInputs, group: dist.ProcessGroup | None
                ) -> tuple[ModelInputs, Callable[..., tuple[torch.Tensor, ...]]]:
    """(the inputs this rank runs, gather): ``gather(*values)`` turns (n,) outputs into the (N,) of the whole
    micro-batch, all of them in one collective. Without a group the inputs as they are and ``gather`` hands the values
    back untouched."""
    if group is None:
        return inputs, lambda *values: values
    local, where = shard_inputs(inputs, group)
    total = inputs.labels.shape[0]
    return local, lambda *values: gather_predictions(torch.stack(values, -1), where, total, group).unbind(-1)
