"""Pure RL algorithms over (B, T) tensors: advantages, KL, policy/value losses, aggregation, DAPO pieces.

The accepted names live in the torch-free :mod:`grpo_npu.algo.names`; importing this package imports
no torch, so the config can read them before torch loads. The algorithm modules (torch) load on use.
"""

import importlib

_MODULES = ("advantages", "dapo", "kl", "losses")


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"grpo_npu.algo.{name}")
    raise AttributeError(f"module 'grpo_npu.algo' has no attribute {name!r}")


__all__ = list(_MODULES)
