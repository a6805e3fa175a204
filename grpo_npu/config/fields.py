"""Field constructors of the schema: a choice among declared names, a list, a free-form dict.

The metadata they attach is what validation (``choices``), loading (``free_form``) and ``--help``
read; the accepted names themselves come from the torch-free ``names`` module of the code that
acts on them (e.g. :mod:`grpo_npu.algo.names`).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def choice(default: Any, choices: tuple) -> Any:
    """A field whose value must be one of ``choices`` (checked by validation.validate)."""
    return field(default=default, metadata={"choices": choices})


def many(default: list, choices: tuple | None = None) -> Any:
    """A list field (a scalar override is accepted as a one-element list)."""
    meta = {"choices": choices} if choices else {}
    return field(default_factory=lambda: list(default), metadata=meta)


def free_dict() -> Any:
    """A free-form mapping: new keys are added with ``+key=value``."""
    return field(default_factory=dict, metadata={"free_form": True})
