"""The package's import graph: no circle, and no module importing from a higher floor.

The graph is read from the source (ast), every ``import`` and ``from ... import`` of a grpo_npu
module counted wherever it stands, function bodies included, and ``importlib.import_module`` of a
literal name. A package ``__init__`` is its own node; importing ``a.b`` is an edge to ``a.b`` (the
package ``a`` that Python also runs is not counted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import grpo_npu

PACKAGE_DIR = Path(grpo_npu.__file__).parent

# Lowest first. A module may import from its own floor and the floors below, never from above. The
# name is the first part after "grpo_npu." (a module or a subpackage with everything in it); the
# ``names`` modules (grpo_npu.names, grpo_npu.<package>.names: torch-free lists of accepted values that
# the config validates against) are on the lowest floor wherever they live.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "io", "env", "names", "logs"),  # standard library only
    ("device", "batch", "config", "determinism", "rank_groups"),
    ("algo", "ops", "data", "reward", "models", "metrics", "perf", "checkpoint", "rundir", "input_checks",
     "installation", "compat", "preflight", "tracking", "run_control", "samples", "replay"),
    ("rollout", "workers"),
    ("trainer", "cluster", "sft", "step_limits"),
    ("main_ppo", "main_sft", "cli", "default_job", "doctor", "tools"),
)
FLOOR_OF = {name: level for level, names in enumerate(FLOORS) for name in names}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under grpo_npu/ (``__init__`` named by its package)."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ["grpo_npu", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The grpo_npu modules that module ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1 packages
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # "from pkg import mod" imports a module, else a name of pkg
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in known else source)
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets.add(node.args[0].value)
    return {t for t in targets if t in known and t != name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def floor(module: str) -> int | None:
    """The floor of a module (None for the package root, which imports nothing)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return FLOOR_OF["names"] if parts[-1] == "names" else FLOOR_OF.get(parts[1], -1)


def test_every_module_has_a_floor():
    unplaced = sorted(m for m in import_graph() if floor(m) == -1)
    assert not unplaced, f"modules without a floor: {', '.join(unplaced)}; add them to FLOORS in {__file__}"


def test_no_module_imports_from_a_higher_floor():
    upward = [f"{m} (floor {floor(m)}) imports {t} (floor {floor(t)})"
              for m, targets in sorted(import_graph().items()) for t in sorted(targets)
              if floor(m) is not None and floor(t) is not None and floor(t) > floor(m)]
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": set(), "c": {"c"}}, ["c", "c"]),
])
def test_find_cycle_finds_what_is_there(graph, expected):
    assert find_cycle(graph) == expected


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("import importlib\n\ndef f():\n    from grpo_npu import device\n    from .sibling import x\n"
                      "    return importlib.import_module('grpo_npu.batch')\n")
    known = {"grpo_npu.device", "grpo_npu.pkg.sibling", "grpo_npu.pkg.mod", "grpo_npu.batch"}
    assert imported_modules("grpo_npu.pkg.mod", source, known) == {"grpo_npu.device", "grpo_npu.pkg.sibling",
                                                                   "grpo_npu.batch"}
