"""Loading: the schema's defaults <- an optional YAML <- ``key=value`` overrides, through OmegaConf.

Every key is checked against the schema before merging. A key the schema lacks but verl knows (its
0.9.1 key list, :mod:`grpo_npu.config.verl_keys`) is mapped to its grpo_npu home, or accepted at verl's
default and refused otherwise (:mod:`grpo_npu.config.support`); only a key verl does not know either
is called unknown, with suggestions. Hydra's forms behave as in verl: ``+key=value`` adds a key (an
error for a key verl declares), ``++key=value`` sets or adds, ``~key`` deletes (back to the default).
A scalar given for a list key becomes a one-element list. The merged result is converted to the frozen dataclasses, frozen all the way down, and
validated (:func:`grpo_npu.config.validation.validate`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_npu.config.keys import all_keys, iter_keys, schema_node, suggest
from grpo_npu.config.schema import Config
from grpo_npu.config.support import alias, check_schema_values, check_verl_value, hydra_flow_to_yaml, known_to_verl
from grpo_npu.config.validation import validate
from grpo_npu.config.verl_keys import VERL_VERSION, free_dict_parent, in_base_config, is_verl_key, is_verl_section
from grpo_npu.errors import ConfigError

# A number with digit-separating underscores, which YAML 1.1 (and so OmegaConf) reads as that number.
_YAML_NUMBER = re.compile(r"[-+]?[0-9][0-9_]*(\.[0-9_]*)?([eE][-+]?[0-9]+)?")


@dataclass
class Overrides:
    """A command line's ``key=value`` items, sorted: schema values, verl-only keys, deletions."""

    tree: DictConfig
    """The values of grpo_npu's own keys (verl's second homes already mapped onto them)."""
    verl_only: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(key, value as written) of keys verl knows and the schema lacks: checked once the config is loaded."""
    deleted: list[str] = dataclasses.field(default_factory=list)
    """Keys removed with Hydra's ``~key``: back to their default, whatever the YAML said."""


def _classify(key: str, value: str, prefix: str) -> tuple[str, str]:
    """('schema', grpo_npu key) | ('verl', verl key) for one override; refuses an unknown key in one line."""
    if prefix == "+" and in_base_config(key):
        raise ConfigError(f"+{key}={value}: verl already declares {key}, so Hydra refuses to add it; "
                          f"write {key}={value} (or ++{key}={value})")
    target = alias(key)
    kind, _ = schema_node(target.split("."))
    if kind == "section":
        raise ConfigError(f"{key!r} is a config section, not a value; set one of its keys (see --help)")
    if kind == "free" and not prefix and not is_verl_key(key):
        raise ConfigError(f"{key!r} adds a new key to a free-form dict: write +{key}={value}")
    if kind != "unknown":
        return "schema", target
    if known_to_verl(key) or free_dict_parent(key) is not None:
        return "verl", key
    if prefix:
        raise ConfigError(f"not supported by grpo_npu: {prefix}{key}={value} (a key verl {VERL_VERSION} does not "
                          f"declare and grpo_npu does not have){suggest(key)}")
    raise ConfigError(f"unknown config key {key!r}{suggest(key)}")


def _quoted_if_text(key: str, value: str) -> str:
    """``value`` quoted when ``key`` is a text key and YAML would read the value as a number (0.5_2 -> 0.52)."""
    kind, spec = schema_node(key.split("."))
    if kind == "leaf" and spec.type in ("str", "Optional[str]") and "_" in value and _YAML_NUMBER.fullmatch(value):
        return f"'{value}'"  # rollout_rs_threshold's "0.5_2" stays text
    return value


def read_overrides(items: list[str]) -> Overrides:
    """Sort ``[+|++]key=value`` and ``~key`` items (Hydra's forms, as verl reads them) against the schema."""
    values: dict[str, str] = {}
    spelled: dict[str, tuple[str, str]] = {}  # grpo_npu key -> (the key as written, its value): verl's second homes
    verl_only: dict[str, str] = {}
    deleted: list[str] = []
    for item in items:
        if item.startswith("~"):
            key = alias(item[1:].split("=", 1)[0])
            if schema_node(key.split("."))[0] == "unknown" and not known_to_verl(key):
                raise ConfigError(f"~{key}: unknown config key{suggest(key)}")
            for store in (values, verl_only):
                for k in [k for k in store if k == key or k.startswith(key + ".")]:
                    del store[k]
            deleted.append(key)
            continue
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        prefix = "++" if key.startswith("++") else "+" if key.startswith("+") else ""
        written = key[len(prefix):]
        where, key = _classify(written, value, prefix)
        if where == "schema":
            other = spelled.get(key)
            if other is not None and other[0] != written and other[1] != value:
                raise ConfigError(f"{other[0]}={other[1]} and {written}={value} are one setting in grpo_npu ({key}); "
                                  "give it once")
            spelled[key] = (written, value)
            values[key] = value
        else:
            verl_only[key] = value
    tree = OmegaConf.create()
    for key, value in values.items():
        try:
            flow = value if "${" in value else hydra_flow_to_yaml(value)  # an interpolation keeps its own colons
            tree.merge_with(OmegaConf.from_dotlist([f"{key}={_quoted_if_text(key, flow)}"]))
        except (OmegaConfBaseException, yaml.YAMLError) as exc:
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            raise ConfigError(f"{key}={value}: cannot read the value ({first}); Hydra's forms: 1, text, "
                              "[a,b], {k:v,k2:[a,b]}; quote text with commas or brackets") from None
    return Overrides(tree, list(verl_only.items()), deleted)


def parse_overrides(items: list[str]) -> DictConfig:
    """Check ``key=value`` overrides against the schema and turn them into one DictConfig."""
    return read_overrides(items).tree


def _check_tree(node: Any, path: list[str], source: str, verl_only: list[tuple[str, str]],
                moved: list[tuple[str, Any]]) -> None:
    """Reject unknown keys in a YAML tree before merging; move the keys only verl knows to ``verl_only`` and
    verl's second homes of grpo_npu keys to ``moved`` (grpo_npu key, value)."""
    if not isinstance(node, (dict, DictConfig)):
        return
    for k in list(node.keys()):
        v = node[k]
        sub = path + [str(k)]
        kind, _ = schema_node(sub)
        key = ".".join(sub)
        target = alias(key)
        if kind == "unknown" and target != key and schema_node(target.split("."))[0] != "unknown":
            moved.append((target, OmegaConf.to_container(v) if isinstance(v, (DictConfig, ListConfig)) else v))
            node.pop(k)
        elif kind == "unknown":
            if is_verl_section(key) and isinstance(v, (dict, DictConfig)):
                _check_tree(v, sub, source, verl_only, moved)
                if not len(v):
                    node.pop(k)
                continue
            if not (known_to_verl(key) or free_dict_parent(key) is not None):
                raise ConfigError(f"unknown config key {key!r} in {source}{suggest(key)}")
            plain = OmegaConf.to_container(v) if isinstance(v, (DictConfig, ListConfig)) else v
            verl_only.append((key, plain if isinstance(plain, str) else json.dumps(plain)))
            node.pop(k)
        elif kind == "section" and v is None:  # "data:" with every setting under it commented out
            node.pop(k)
        elif kind == "section":
            if not isinstance(v, (dict, DictConfig)):
                raise ConfigError(f"{key} in {source} is a section of settings: expected a mapping, got {v!r}")
            _check_tree(v, sub, source, verl_only, moved)


def _listify(node: DictConfig, path: list[str] = ()) -> None:
    """A scalar given for a list key becomes a one-element list (``data.train_files=a.parquet``)."""
    for k in list(node.keys()):
        if OmegaConf.is_interpolation(node, k):  # ${other.key}: resolved against the whole config after the merge
            continue
        value = node[k]
        sub = list(path) + [str(k)]
        if isinstance(value, DictConfig):
            kind, _ = schema_node(sub)
            if kind == "section":
                _listify(value, sub)
            continue
        kind, spec = schema_node(sub)
        if kind == "leaf" and not isinstance(value, ListConfig) and value is not None:
            if "List" in str(spec.type) or "list" in str(spec.type):
                node[k] = [value]


def _format_validation_error(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "?"
    msg = str(exc).splitlines()[0]
    spec = next((s for s in iter_keys() if s.key == key), None)
    expected = f"; the value is not accepted (expected {spec.type})" if spec else ""
    return f"{key}: {msg}{expected}"


def _load_yaml(yaml_path: str, verl_only: list[tuple[str, str]]) -> DictConfig:
    """A YAML file of overrides, checked against the schema (hydra's ``defaults``/``hydra`` keys dropped)."""
    if not os.path.isfile(yaml_path):
        raise ConfigError(f"config file {yaml_path!r} does not exist")
    try:
        yaml_cfg = OmegaConf.load(yaml_path)
    except Exception as exc:
        raise ConfigError(f"config file {yaml_path!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(yaml_cfg, DictConfig):
        raise ConfigError(f"config file {yaml_path!r} must hold a mapping at the top level")
    yaml_cfg.pop("defaults", None)  # hydra's defaults list: our defaults are the dataclasses
    yaml_cfg.pop("hydra", None)
    moved: list[tuple[str, Any]] = []
    _check_tree(yaml_cfg, [], yaml_path, verl_only, moved)
    for key, value in moved:
        OmegaConf.update(yaml_cfg, key, value, force_add=True)
    _listify(yaml_cfg)
    return yaml_cfg


def load_config(overrides: list[str] | None = None, yaml_path: str | None = None) -> Config:
    """defaults <- YAML <- overrides, validated and frozen."""
    schema = _schema()  # OmegaConf.merge copies it: the cached tree is never changed
    verl_only: list[tuple[str, str]] = []
    layers = [_load_yaml(yaml_path, verl_only)] if yaml_path else []
    cli = read_overrides(list(overrides or []))
    for key in cli.deleted:  # ~key: back to the default
        verl_only = [(k, v) for k, v in verl_only if not (k == key or k.startswith(key + "."))]
        for layer in layers:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(layer, parent) if parent else layer
            if isinstance(node, DictConfig) and leaf in node:
                node.pop(leaf)
    _listify(cli.tree)
    layers.append(cli.tree)
    try:
        merged = OmegaConf.merge(schema, *layers)
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_format_validation_error(exc)) from None
    cfg = _freeze(cfg)
    loaded = to_dict(cfg)
    for key, value in verl_only + cli.verl_only:
        check_verl_value(key, value, loaded)
    check_schema_values(loaded, all_keys())
    validate(cfg)
    return cfg


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The defaults as an OmegaConf tree, built once per process (a fifth of a second each time, here)."""
    schema = OmegaConf.structured(Config)
    _writable(schema)  # frozen dataclasses make read-only nodes; we freeze the result instead
    return schema


def _writable(node: Any) -> None:
    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)):
                _writable(child)


class FrozenDict(dict):
    """A dict that refuses mutation (free-form config sections after load); picklable."""

    def _readonly(self, *args, **kwargs):
        raise TypeError("the config is frozen after load")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


def _freeze(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        changes = {f.name: _freeze(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, list):
        return tuple(_freeze(v) for v in obj)
    if isinstance(obj, dict):
        return FrozenDict({k: _freeze(v) for k, v in obj.items()})
    return obj


def to_dict(cfg: Config) -> dict:
    """Plain nested dict (for logging, YAML dumps and checkpoints)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def to_yaml(cfg: Config) -> str:
    """The config as YAML (what ``--cfg`` prints)."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))
