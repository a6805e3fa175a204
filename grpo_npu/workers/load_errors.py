"""Load and save failures a user can fix, told in one line: weight files that cannot be read, and sharded
checkpoints that do not fit the model they are loaded into (torch DCP's errors made plain).

Used by :mod:`grpo_npu.workers.fsdp`; the messages name the config key or checkpoint directory.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.api import CheckpointException

from grpo_npu.errors import UserError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def unreadable_weights(path: str) -> str | None:
    """``<file>: <what is wrong>`` for the first weight file in directory ``path`` that cannot be parsed, else None."""
    files = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES)) if os.path.isdir(path) else []
    for name in files:
        file = os.path.join(path, name)
        try:
            if name.endswith(".safetensors"):
                with safe_open(file, framework="pt") as f:  # the header, and that the file holds what it lists
                    for k in f.keys():
                        f.get_slice(k)
            else:
                torch.load(file, map_location="meta", weights_only=True)
        except (SafetensorError, RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{file}: {text.removeprefix('Error while deserializing header: ')}"
    return None


class CheckpointMismatch(UserError):
    """A sharded checkpoint whose tensors do not fit the model it is loaded into: ``kind`` is "another shape"
    or "another architecture", ``detail`` names the tensor (``model.embed_tokens.weight: saved [..], this model [..]``)."""

    def __init__(self, in_dir: str, kind: str, detail: str):
        super().__init__(f"checkpoint {in_dir} holds weights of {kind} than this model ({detail})")
        self.in_dir, self.kind, self.detail = in_dir, kind, detail


_SIZE_MISMATCH = re.compile(r"Size mismatch between saved torch\.Size\((\[.*?\])\) and current: "
                            r"torch\.Size\((\[.*?\])\) for (\S+)")
_MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: (\S+?)\.?$")


def _tensor_name(fqn: str) -> str:
    """A DCP key as the HF model names it: without the state's section and the wrapper's ``hf.``."""
    fqn = re.sub(r"^(?:model|optimizer\.state|optimizer\.param_groups)\.", "", fqn)
    return fqn.removeprefix("hf.")


def dcp_call(call, in_dir: str, *args: Any, **kwargs: Any) -> Any:
    """``dcp.save`` / ``dcp.load``, whose CheckpointException (a BaseException: it would pass every handler
    and end the process with a traceback) becomes the first failed rank's own exception; a checkpoint that
    does not fit the model becomes :class:`CheckpointMismatch`."""
    try:
        return call(*args, **kwargs)
    except CheckpointException as exc:
        failures = [f[0] if isinstance(f, tuple) else f for _, f in sorted(exc.failures.items())]
        first = next((f for f in failures if isinstance(f, BaseException)), None)
        for failure in failures:
            text = str(failure)
            if m := _SIZE_MISMATCH.search(text):
                raise CheckpointMismatch(in_dir, "another shape",
                                         f"{_tensor_name(m.group(3))}: saved {m.group(1)}, this model {m.group(2)}") from exc
            if m := _MISSING_KEY.search(text.strip()):
                raise CheckpointMismatch(in_dir, "another architecture",
                                         f"{_tensor_name(m.group(1))}: not in the checkpoint") from exc
        if isinstance(first, Exception):
            raise first from exc
        raise RuntimeError(str(exc).strip().splitlines()[-1] if str(exc).strip() else "checkpoint failed") from exc
