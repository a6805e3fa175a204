"""Loading: the schema's defaults <- an optional YAML <- ``key=value`` overrides, through OmegaConf.

Every key is checked against the schema before merging, so an unknown one is refused with
suggestions; ``+key=value`` (or ``++key=value``) adds a key to a free-form dict such as
``actor_rollout_ref.model.override_config``; a scalar given for a list key becomes a one-element
list. The merged result is converted to the frozen dataclasses, frozen all the way down, and
validated (:func:`grpo_npu.config.validation.validate`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_npu.config.keys import iter_keys, schema_node, suggest
from grpo_npu.config.schema import Config
from grpo_npu.config.validation import validate
from grpo_npu.errors import ConfigError

# A number with digit-separating underscores, which YAML 1.1 (and so OmegaConf) reads as that number.
_YAML_NUMBER = re.compile(r"[-+]?[0-9][0-9_]*(\.[0-9_]*)?([eE][-+]?[0-9]+)?")


def parse_overrides(items: list[str]) -> DictConfig:
    """Check ``key=value`` overrides against the schema and turn them into one DictConfig."""
    dotlist = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        adding = key.startswith("+")
        key = key.lstrip("+")
        kind, spec = schema_node(key.split("."))
        if kind == "unknown":
            raise ConfigError(f"unknown config key {key!r}{suggest(key)}")
        if kind == "section":
            raise ConfigError(f"{key!r} is a config section, not a value; set one of its keys (see --help)")
        if kind == "free" and not adding:
            raise ConfigError(f"{key!r} adds a new key to a free-form dict: write +{key}={value}")
        if kind == "leaf" and spec.type in ("str", "Optional[str]") and "_" in value and _YAML_NUMBER.fullmatch(value):
            value = f"'{value}'"  # YAML reads 0.5_2 as the number 0.52: a text key keeps the text (rollout_rs_threshold)
        dotlist.append(f"{key}={value}")
    try:
        return OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides: {exc}") from None


def _check_tree(node: Any, path: list[str], source: str) -> None:
    """Reject unknown keys in a YAML tree before merging (OmegaConf's message lacks suggestions)."""
    if not isinstance(node, (dict, DictConfig)):
        return
    for k, v in node.items():
        sub = path + [str(k)]
        kind, _ = schema_node(sub)
        key = ".".join(sub)
        if kind == "unknown":
            raise ConfigError(f"unknown config key {key!r} in {source}{suggest(key)}")
        if kind == "section":
            _check_tree(v, sub, source)


def _listify(node: DictConfig, path: list[str] = ()) -> None:
    """A scalar given for a list key becomes a one-element list (``data.train_files=a.parquet``)."""
    for k in list(node.keys()):
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
    expected = f" (expected {spec.type})" if spec else ""
    return f"{key}: {msg}{expected}"


def _load_yaml(yaml_path: str) -> DictConfig:
    """A YAML file of overrides, checked against the schema (hydra's ``defaults``/``hydra`` keys dropped)."""
    if not os.path.isfile(yaml_path):
        raise ConfigError(f"config file {yaml_path!r} does not exist")
    try:
        yaml_cfg = OmegaConf.load(yaml_path)
    except Exception as exc:
        raise ConfigError(f"config file {yaml_path!r} is not valid YAML: {exc}") from None
    if not isinstance(yaml_cfg, DictConfig):
        raise ConfigError(f"config file {yaml_path!r} must hold a mapping at the top level")
    yaml_cfg.pop("defaults", None)  # hydra's defaults list: our defaults are the dataclasses
    yaml_cfg.pop("hydra", None)
    _check_tree(yaml_cfg, [], yaml_path)
    _listify(yaml_cfg)
    return yaml_cfg


def load_config(overrides: list[str] | None = None, yaml_path: str | None = None) -> Config:
    """defaults <- YAML <- overrides, validated and frozen."""
    schema = OmegaConf.structured(Config)
    _writable(schema)  # frozen dataclasses make read-only nodes; we freeze the result instead
    layers = [_load_yaml(yaml_path)] if yaml_path else []
    cli = parse_overrides(list(overrides or []))
    _listify(cli)
    layers.append(cli)
    try:
        merged = OmegaConf.merge(schema, *layers)
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_format_validation_error(exc)) from None
    cfg = _freeze(cfg)
    validate(cfg)
    return cfg


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
