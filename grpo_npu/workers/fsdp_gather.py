"""Holding a sharded model gathered for generation: every FSDP unit unsharded once, for a whole block.

transformers ``generate`` calls forward once per new token; with FSDP's per-forward gather and free that
is one all-gather per layer per token (1.9x a plain model's generate time measured on an H100).
:func:`gathered` unshards every unit once and switches reshard-after-forward off for the block, as verl's
summon_full_params around its HF rollout does, then restores both. With ``hooks_off`` FSDP's forward hooks
are also lifted for the block: with every unit already gathered they have nothing left to do, but they
still run Python at every layer of every token, and the first unit to run as root makes FSDP's
communication streams wait on the compute stream, which a CUDA graph capture cannot contain. Nothing in
the block is then a collective, so each rank decodes on its own.

A torch without ``FSDPModule.set_reshard_after_forward`` (2.5.1, 2.7.1) cannot hold the gather: the block
runs with the per-forward gathers and the hooks in place, and :func:`gathered` yields False.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

from grpo_npu import compat
from grpo_npu.workers.fsdp import FSDPModule, fsdp_units


@contextmanager
def gathered(module: nn.Module, *, hooks_off: bool = False) -> Iterator[bool]:
    """Every FSDP unit of ``module`` stays unsharded for the block; yields whether the gather is held."""
    if not compat.current().fsdp_reshard_toggle:
        yield False
        return
    units = fsdp_units(module)
    saved = [_reshard_setting(m) for m in units]
    lifted: list[tuple[OrderedDict, OrderedDict]] = []
    try:
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        if hooks_off:
            lifted = [_lift_fsdp_hooks(table) for m in units for table in (m._forward_pre_hooks, m._forward_hooks)]
        yield True
    finally:
        for table, kept in lifted:  # back in their original order
            table.clear()
            table.update(kept)
        for m, setting in zip(units, saved):
            _restore_reshard_setting(m, setting)
            m.reshard()


def _lift_fsdp_hooks(table: OrderedDict) -> tuple[OrderedDict, OrderedDict]:
    """Remove the hooks FSDP's state registered (bound methods of ``FSDPState``) from a module's hook table."""
    kept = OrderedDict(table)
    for key, hook in kept.items():
        if type(getattr(hook, "__self__", None)).__name__ == "FSDPState":
            del table[key]
    return table, kept


def _param_groups(state: Any) -> list:
    """The unit's parameter groups: a list since torch 2.12 (``_fsdp_param_groups``), one group before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _reshard_setting(m: FSDPModule) -> tuple:
    """FSDP2 keeps reshard-after-forward per parameter group with no public getter: read its fields."""
    state = m._get_fsdp_state()
    return (getattr(state, "_auto_reshard_after_forward", None),
            [g.post_forward_mesh_info for g in _param_groups(state)])


def _restore_reshard_setting(m: FSDPModule, setting: tuple) -> None:
    auto, infos = setting
    state = m._get_fsdp_state()
    if auto is not None:
        state._auto_reshard_after_forward = auto
    for group, info in zip(_param_groups(state), infos):
        group.post_forward_mesh_info = info
