"""verl's key surface, known at run time: every key of verl 0.9.1's ``ppo_trainer`` config and its default.

The list is ``verl_0.9.1_keys.tsv`` beside this module (package data; made by
``scripts/extract_verl_keys.py`` from verl's wheel, with the keys ``ppo_megatron_trainer``,
``ppo_torchtitan_trainer``, ``ppo_veomni_trainer`` and the DAPO recipe add). Loading asks it whether a
key grpo_npu's schema lacks is one verl knows (then :mod:`grpo_npu.config.support` says what happens to
it) or a typo (then it gets suggestions). Torch-free.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERL_VERSION = "0.9.1"
KEYS_FILE = Path(__file__).with_name(f"verl_{VERL_VERSION}_keys.tsv")
# Hydra's placeholder for a value the user must give: no default to compare against
MISSING = "???"
_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?\s*([^,}]+?)\s*(?:,\s*(.*))?\}$")


@dataclass(frozen=True)
class VerlKey:
    """One key of verl's config: its default (decoded JSON) and the config file(s) declaring it."""

    key: str
    default: Any
    configs: tuple[str, ...]


@functools.cache
def _rows() -> tuple[tuple[str, Any, str], ...]:
    """(key, default, config) for every row of the list."""
    rows = []
    for line in KEYS_FILE.read_text().splitlines():
        if not line or line.startswith("#") or line.startswith("key\t"):
            continue
        key, default, _source, config = line.split("\t")
        rows.append((key, json.loads(default), config))
    return tuple(rows)


def config_defaults(config: str) -> dict[str, Any]:
    """key -> default of the keys one config of the list declares (e.g. ``dapo_recipe``)."""
    return {key: default for key, default, c in _rows() if c == config}


@functools.cache
def verl_keys() -> dict[str, VerlKey]:
    """key -> VerlKey for every row of the list (the first row's default when configs disagree)."""
    rows: dict[str, VerlKey] = {}
    for key, default, config in _rows():
        if key in rows:
            rows[key] = VerlKey(key, rows[key].default, rows[key].configs + (config,))
        else:
            rows[key] = VerlKey(key, default, (config,))
    return rows


@functools.cache
def _prefixes() -> frozenset[str]:
    return frozenset(".".join(k.split(".")[:i]) for k in verl_keys() for i in range(1, k.count(".") + 1))


def is_verl_key(key: str) -> bool:
    """Whether verl declares ``key`` as a value (a leaf of its config)."""
    return key in verl_keys()


def in_base_config(key: str) -> bool:
    """Whether verl's ``ppo_trainer`` config itself declares ``key`` (Hydra's ``+key`` is an error then)."""
    row = verl_keys().get(key)
    return row is not None and "ppo_trainer" in row.configs


def is_verl_section(key: str) -> bool:
    """Whether ``key`` is a section of verl's config (a prefix of some of its keys)."""
    return key in _prefixes()


def free_dict_parent(key: str) -> str | None:
    """The verl key holding ``key`` when it is an entry of one of verl's free-form dicts (default {} or null)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = verl_keys().get(".".join(parts[:i]))
        if parent is not None:
            return parent.key if parent.default in ({}, None) else None
    return None


def interpolation(default: Any) -> tuple[str, str | None] | None:
    """``(key, fallback)`` of a default written as ``${key}`` or ``${oc.select:key,fallback}``; else None."""
    if not isinstance(default, str):
        return None
    m = _INTERPOLATION.match(default.strip())
    return (m.group(1), m.group(2)) if m else None
