"""Write verl's full trainer key list (key, default, source) from a verl wheel: the reference grpo_npu maps.

Usage (the wheel is downloaded, never installed; the git dirs are bare snapshots of the two repositories)::

    pip download --no-deps verl==0.9.1 -d /tmp/verl
    python scripts/extract_verl_keys.py /tmp/verl/verl-0.9.1-py3-none-any.whl \
        --verl-git-dir VERL.git --recipe-git-dir VERL_RECIPE.git \
        -o grpo_npu/config/verl_0.9.1_keys.tsv

What goes in, as rows of ``key <TAB> default <TAB> source <TAB> config``:

- ``ppo_trainer``: every leaf of the wheel's ``verl/trainer/config/_generated_ppo_trainer.yaml`` (the file verl
  generates by flattening ``ppo_trainer.yaml`` with all its defaults), plus the ``model_engine`` config group.
- ``ppo_megatron_trainer`` / ``ppo_torchtitan_trainer`` / ``ppo_veomni_trainer``: the leaves of the other
  generated trainer configs the wheel ships that ``ppo_trainer`` lacks (their engine-specific keys).
- ``dapo_recipe``: the keys the DAPO recipe's ``dapo/config/dapo_trainer.yaml`` declares on top of
  ``ppo_trainer``, with the recipe's defaults. The recipe is not in the wheel: it lives in verl-recipe, pinned
  by verl's ``recipe`` submodule; it is read at the commit that verl's ``--verl-ref`` pins.
- ``dapo_recipe_legacy``: the same file as it was when the recipe still lived in verl's own tree (the last
  version before it moved out), whose ``reward_model.overlong_buffer.*`` keys older DAPO scripts still use.

A key appears at most once per config; ``_target_`` entries (Hydra's class markers, not settings) are left
out. Defaults are JSON (strings quoted, ``null``, lists and ``{}`` as JSON); interpolations stay as text.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = "verl/trainer/config"
MAIN_CONFIG = "ppo_trainer"
ENGINE_CONFIGS = ("ppo_megatron_trainer", "ppo_torchtitan_trainer", "ppo_veomni_trainer")
DAPO_CONFIG = "dapo/config/dapo_trainer.yaml"  # inside verl-recipe
LEGACY_DAPO_CONFIG = "recipe/dapo/config/dapo_trainer.yaml"  # inside verl, before the recipe moved out
SKIPPED_LEAVES = ("_target_",)
HYDRA_ONLY_KEYS = ("defaults", "hydra")  # a recipe yaml's composition instructions, not settings


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested mapping as ``{"a.b.c": value}``; empty mappings and lists are leaves."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in SKIPPED_LEAVES:
                continue
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def load_yaml_text(text: str, where: str) -> dict:
    """YAML text as plain containers, interpolations left unresolved (OmegaConf's YAML 1.2 booleans)."""
    cfg = OmegaConf.create(text)
    if not isinstance(cfg, DictConfig):
        sys.exit(f"{where}: expected a mapping at the top level")
    return OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)  # type: ignore[return-value]


def as_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True,
                          text=True).stdout


def recipe_pin(verl_git_dir: str, ref: str) -> str:
    """The verl-recipe commit that verl's ``recipe`` submodule points at in ``ref``."""
    line = git(verl_git_dir, "ls-tree", ref, "recipe").split()
    if len(line) < 3 or line[1] != "commit":
        sys.exit(f"{verl_git_dir}: 'recipe' at {ref} is not a submodule")
    return line[2]


def last_in_tree_version(verl_git_dir: str, ref: str, path: str) -> str:
    """The commit holding the last version of ``path`` before a later commit deleted it."""
    deleting = git(verl_git_dir, "log", "-1", "--format=%H", "--diff-filter=D", ref, "--", path).strip()
    if not deleting:
        sys.exit(f"{verl_git_dir}: {path} was never deleted before {ref}")
    return git(verl_git_dir, "rev-parse", f"{deleting}^").strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", help="verl wheel (.whl), e.g. verl-0.9.1-py3-none-any.whl")
    ap.add_argument("--verl-git-dir", required=True, help="bare git dir of verl-project/verl")
    ap.add_argument("--verl-ref", default="v0.9.0",
                    help="verl ref whose recipe submodule pin is read (0.9.1 is a patch release of 0.9.0)")
    ap.add_argument("--recipe-git-dir", required=True, help="bare git dir of verl-project/verl-recipe")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()

    wheel_name = Path(args.wheel).name
    with zipfile.ZipFile(args.wheel) as wheel:
        version = wheel.read("verl/version/version").decode().strip()

        def generated(name: str) -> tuple[str, dict[str, Any]]:
            path = f"{CONFIG_DIR}/_generated_{name}.yaml"
            return path, flatten(load_yaml_text(wheel.read(path).decode(), path))

        main_path, main_keys = generated(MAIN_CONFIG)
        engine_tables = [(name, *generated(name)) for name in ENGINE_CONFIGS
                         if f"{CONFIG_DIR}/_generated_{name}.yaml" in wheel.namelist()]
        engine_group = load_yaml_text(wheel.read(f"{CONFIG_DIR}/model_engine/dp.yaml").decode(), "model_engine")

    rows: list[tuple[str, str, str, str]] = []
    for key, value in main_keys.items():
        rows.append((key, as_json(value), f"{wheel_name}:{main_path}", MAIN_CONFIG))
    group_source = f"{wheel_name}:{CONFIG_DIR}/ppo_trainer.yaml (defaults list, config group)"
    rows.append(("model_engine", as_json(engine_group["model_engine"]), group_source, MAIN_CONFIG))
    for name, path, keys in engine_tables:
        for key, value in keys.items():
            if key not in main_keys:
                rows.append((key, as_json(value), f"{wheel_name}:{path}", name))

    pin = recipe_pin(args.verl_git_dir, args.verl_ref)
    dapo = load_yaml_text(git(args.recipe_git_dir, "show", f"{pin}:{DAPO_CONFIG}"), DAPO_CONFIG)
    for key, value in flatten({k: v for k, v in dapo.items() if k not in HYDRA_ONLY_KEYS}).items():
        rows.append((key, as_json(value), f"verl-project/verl-recipe@{pin}:{DAPO_CONFIG}", "dapo_recipe"))
    legacy_commit = last_in_tree_version(args.verl_git_dir, args.verl_ref, LEGACY_DAPO_CONFIG)
    legacy = load_yaml_text(git(args.verl_git_dir, "show", f"{legacy_commit}:{LEGACY_DAPO_CONFIG}"),
                            LEGACY_DAPO_CONFIG)
    for key, value in flatten({k: v for k, v in legacy.items() if k not in HYDRA_ONLY_KEYS}).items():
        rows.append((key, as_json(value), f"verl-project/verl@{legacy_commit}:{LEGACY_DAPO_CONFIG}",
                     "dapo_recipe_legacy"))

    seen: set[tuple[str, str]] = set()
    for key, _, _, config in rows:
        if (key, config) in seen:
            sys.exit(f"duplicate key {key!r} in config {config}")
        seen.add((key, config))

    header = [
        f"# verl {version} trainer keys with their defaults, extracted by scripts/extract_verl_keys.py from",
        f"# {wheel_name} (PyPI) and, for the DAPO recipe (not in the wheel), verl-project/verl-recipe@{pin}",
        f"# (the commit verl {args.verl_ref} pins as its 'recipe' submodule) and verl-project/verl@{legacy_commit}",
        "# (the last in-tree recipe/dapo). config: ppo_trainer = every leaf of the generated ppo_trainer;",
        "# ppo_megatron_trainer / ppo_torchtitan_trainer / ppo_veomni_trainer = their keys ppo_trainer lacks;",
        "# dapo_recipe(_legacy) = keys the DAPO recipe config declares, with its defaults. _target_ left out.",
        "# default is JSON; (key, config) is unique.",
        "key\tdefault\tsource\tconfig",
    ]
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header + ["\t".join(r) for r in rows]) + "\n")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row[3]] = counts.get(row[3], 0) + 1
    print(f"wrote {len(rows)} rows to {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
