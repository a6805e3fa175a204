"""The schema seen as dotted keys: each leaf's type, default, docstring and accepted values.

``--help`` lists :func:`iter_keys`; loading classifies every override and YAML key with
:func:`schema_node` and answers an unknown one with :func:`suggest`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Dict, List

from grpo_npu.config.schema import Config


def _field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings that follow each field in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value).strip()
    return docs


@dataclass(frozen=True)
class KeySpec:
    """One leaf key of the schema."""

    key: str
    type: str
    default: Any
    doc: str
    choices: tuple | None
    free_form: bool


def iter_keys(cls: type = Config, prefix: str = "") -> list[KeySpec]:
    """Every key of the schema, depth first, with its type, default and doc."""
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    specs = []
    instance = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            specs.extend(iter_keys(type(value), key + "."))
            continue
        specs.append(
            KeySpec(
                key=key,
                type=_type_name(hints[f.name]),
                default=value,
                doc=docs.get(f.name, ""),
                choices=f.metadata.get("choices"),
                free_form=bool(f.metadata.get("free_form")),
            )
        )
    return specs


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)][0]
        return f"{_type_name(inner)} | null"
    if origin in (list, List):
        return f"list[{_type_name(args[0])}]"
    if origin in (dict, Dict):
        return "dict"
    return getattr(tp, "__name__", str(tp))


def schema_node(path: list[str]) -> tuple[str, Any]:
    """Classify a dotted key against the schema: ('leaf'|'section'|'free'|'unknown', spec)."""
    cls: Any = Config
    for i, part in enumerate(path):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return "unknown", None
        f = fields[part]
        default = getattr(cls(), part)
        if dataclasses.is_dataclass(default):
            cls = type(default)
            if i == len(path) - 1:
                return "section", cls
            continue
        if f.metadata.get("free_form"):
            return ("leaf" if i == len(path) - 1 else "free"), f
        return ("leaf", f) if i == len(path) - 1 else ("unknown", None)
    return "section", cls


@functools.cache
def all_keys() -> tuple[str, ...]:
    """Every leaf key of the schema (cached)."""
    return tuple(s.key for s in iter_keys())


def suggest(key: str) -> str:
    """'; did you mean a, b?' naming the known keys closest to an unknown ``key`` (or '')."""
    known = all_keys()
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    same_leaf = sorted((k for k in known if k.rsplit(".", 1)[-1] == leaf),
                       key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())
    # a close match with the same leaf, else the most similar key with that leaf (a key that moved), then the rest
    ordered = [k for k in close if k in same_leaf] + same_leaf[:1] + close + same_leaf
    close = list(dict.fromkeys(ordered))[:4]
    if not close:
        close = [k for k in known if difflib.SequenceMatcher(None, leaf, k.rsplit(".", 1)[-1]).ratio() > 0.75][:4]
    return f"; did you mean {', '.join(close)}?" if close else ""
