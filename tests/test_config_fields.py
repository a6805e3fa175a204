"""Every config key acts or is refused: a schema field read nowhere outside the config package must be one
that grpo_npu/config/support.py limits to the values it acts on, and each such limit has its refusal test.

"Read" is judged on the package's source (ast): an attribute access ``<receiver>.<field>`` (not a method call)
whose receiver is the field's section (``...actor.use_torch_compile``, a variable assigned from
``....actor``, or a parameter annotated with the section's class); a receiver the walk cannot place
(``self.cfg``) counts for every field of that name. ``config/derived.py`` counts as a reader: the values it
derives are what the workers use.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest

from grpo_npu.config import ConfigError, load_config
from grpo_npu.config.keys import all_keys, iter_keys
from grpo_npu.config.schema import Config
from grpo_npu.config.support import REFUSE, SAME, refused_schema_keys, rule_for

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_npu"
BASE = ["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]


def _sections(cls: type = Config, name: str = "") -> dict[str, set[str]]:
    """Section class name -> the field names it appears under."""
    out: dict[str, set[str]] = {cls.__name__: {name}}
    inst = cls()
    for f in dataclasses.fields(cls):
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):
            for k, names in _sections(type(value), f.name).items():
                out.setdefault(k, set()).update(names)
    return out


def _annotation_name(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.rsplit(".", 1)[-1]
    return None


@functools.cache
def _reads() -> tuple[tuple[frozenset | None, str], ...]:
    """(sections the receiver may be, or None when unknown; attribute) for every attribute read."""
    class_sections = _sections()
    section_names = set().union(*class_sections.values()) - {""}
    reads = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "config" and path.name != "derived.py":
            continue
        tree = ast.parse(path.read_text())
        alias: dict[str, set[str]] = {}
        called: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                called.add(id(node.func))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    name = _annotation_name(arg.annotation)
                    if name in class_sections:
                        alias[arg.arg] = class_sections[name]
            if isinstance(node, ast.Assign):
                pairs = []
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(target.elts, node.value.elts)
                    else:
                        pairs.append((target, node.value))
                for target, value in pairs:
                    if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr in section_names:
                        alias[target.id] = {value.attr}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in called:
                continue
            receiver = node.value
            if isinstance(receiver, ast.Attribute):
                parents = {receiver.attr} if receiver.attr in section_names else None
            elif isinstance(receiver, ast.Name):
                parents = alias.get(receiver.id, {receiver.id} if receiver.id in section_names else None)
            else:
                parents = None
            reads.append((frozenset(parents) if parents else None, node.attr))
    return tuple(reads)


def _read_somewhere(key: str) -> bool:
    parts = key.split(".")
    parent = parts[-2] if len(parts) > 1 else ""
    return any(attr == parts[-1] and (parents is None or parent in parents) for parents, attr in _reads())


@pytest.mark.parametrize("key", all_keys())
def test_every_field_acts_or_is_refused(key):
    if _read_somewhere(key):
        return
    rule = rule_for(key)
    assert rule is not None and (rule.action == REFUSE and rule.accepted is not None or rule.action == SAME and rule.feature), (
        f"{key} is read nowhere outside grpo_npu/config/: make it act, limit it in support.RULES, or say there why "
        "every value runs the same")


def test_the_walk_sees_reads_and_misses():
    assert _read_somewhere("actor_rollout_ref.actor.grad_clip")
    assert _read_somewhere("reward_model.overlong_buffer.penalty_factor")
    assert not _read_somewhere("trainer.del_local_ckpt_after_load")
    assert not _read_somewhere("reward_model.launch_reward_fn_async")
    assert _read_somewhere("reward_model.overlong_buffer.log")  # ob.log; tracker.log(...) alone (a call) would not count


def _other_value(key: str, accepted: tuple, default):
    """A value of the key's type that the rule does not accept."""
    if default is None and next(s for s in iter_keys() if s.key == key).type.startswith("int"):
        return "3"
    if isinstance(default, bool) or default is None and True in accepted:
        return "True" if False in accepted or None in accepted else "False"
    if isinstance(default, int):
        return str(max(int(v) for v in accepted if isinstance(v, (int, float)) and not isinstance(v, bool)) + 7)
    if isinstance(default, dict):
        return None
    return "not_a_supported_value"


@pytest.mark.parametrize("key", refused_schema_keys(all_keys()))
def test_each_limited_key_is_refused_in_one_line(key):
    default = _default(key)
    accepted = rule_for(key).accepted
    assert any(default == v for v in accepted), f"{key}: the schema default {default!r} must be an accepted value"
    value = _other_value(key, accepted, default)
    if value is None:  # a free-form dict: one new entry
        item = f"+{key}.some_entry=1"
    else:
        item = f"{key}={value}"
    with pytest.raises(ConfigError) as err:
        load_config(BASE + [item])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"not supported by grpo_npu: {key}"), message


def _default(key: str):
    node = Config()
    for part in key.split("."):
        node = getattr(node, part)
    return node
