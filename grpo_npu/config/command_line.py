"""The command line of the entry points: options, ``key=value`` overrides, ``--help`` and ``--cfg``.

Options are ``--config FILE.yaml`` (also ``config=FILE``, or hydra's ``--config-path DIR
--config-name NAME``; a verl built-in name such as ``ppo_trainer`` with no such file means grpo_npu's
defaults, and ``ppo_megatron_trainer`` is refused in one line), ``--cfg`` (print the resolved config) and ``--help`` (every key with its
type, accepted values, default and docstring); everything else is a ``key=value`` override.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from grpo_npu.config.keys import iter_keys
from grpo_npu.config.loading import load_config, to_yaml
from grpo_npu.config.schema import Config
from grpo_npu.config.support import builtin_config, is_builtin_config, limit_note
from grpo_npu.errors import ConfigError

# Options naming the YAML file: ours, and hydra's folder + name (either spelling)
FILE_OPTIONS = ("--config", "--config-path", "--config-name", "--config_path", "--config_name")


@dataclass(frozen=True)
class CommandLine:
    """What a command line asks for: overrides, a YAML file, --help, --cfg."""

    overrides: list[str]
    yaml_path: str | None
    show_help: bool
    print_cfg: bool


def split_argv(argv: list[str]) -> CommandLine:
    """Separate --config/--help/--cfg and hydra's --config-path/--config-name from key=value items."""
    overrides: list[str] = []
    yaml_path = config_dir = config_name = None
    show_help = print_cfg = False
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            show_help = True
        elif arg in ("--cfg", "--cfg=job"):
            print_cfg = True
        elif arg.partition("=")[0] in FILE_OPTIONS:
            option, inline, value = arg.partition("=")
            value = value if inline else next(it, None)  # --option=value or --option value
            if value is None:
                raise ConfigError(f"{arg} needs a value")
            option = option.replace("_", "-")
            if option == "--config":
                yaml_path = value
            elif option == "--config-path":
                config_dir = value
            else:
                config_name = value
        elif arg.startswith("config="):
            yaml_path = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; options are --config FILE, --cfg, --help, then key=value overrides")
        else:
            overrides.append(arg)
    if config_name:
        name = config_name if config_name.endswith((".yaml", ".yml")) else config_name + ".yaml"
        yaml_path = os.path.join(config_dir or ".", name)
        if not os.path.isfile(yaml_path) and is_builtin_config(config_name):  # verl's own config, by name
            overrides = builtin_config(config_name) + overrides
            yaml_path = None
    return CommandLine(overrides, yaml_path, show_help, print_cfg)


def help_text() -> str:
    """Every key with its type, accepted values, default and docstring, grouped by section; a key grpo_npu
    keeps for verl's command lines at some values only says which."""
    lines = [
        "usage: python -m grpo_npu.main_ppo [--config FILE.yaml] [--cfg] [key=value ...] [+key=value ...]",
        "",
        "Keys (verl main_ppo names), with type, default and meaning:",
    ]
    section = None
    for spec in iter_keys():
        top = spec.key.rsplit(".", 1)[0]
        if top != section:
            lines.append(f"\n[{top}]")
            section = top
        default = spec.default
        choices = f" {{{'|'.join(map(str, spec.choices))}}}" if spec.choices else ""
        lines.append(f"  {spec.key} ({spec.type}{choices}) = {default!r}")
        lines += [f"      {text}" for text in (spec.doc, limit_note(spec.key)) if text]
    return "\n".join(lines)


def config_from_argv(argv: list[str]) -> tuple[Config | None, CommandLine]:
    """Parse a command line; prints help / the resolved config when asked (then Config is None)."""
    cmd = split_argv(argv)
    if cmd.show_help:
        print(help_text())
        return None, cmd
    cfg = load_config(cmd.overrides, cmd.yaml_path)
    if cmd.print_cfg:
        sys.stdout.write(to_yaml(cfg))
        return None, cmd
    return cfg, cmd
