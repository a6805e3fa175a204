"""The docs name only what exists: every file, grpo_npu module, function and class they point at.

Scanned: README.md, docs/*.md and every grpo_npu module docstring. A name is checked by reading the
source (ast), so nothing here imports torch or the modules it checks. What counts as a reference:

- a repository path, ``grpo_npu/workers/fsdp.py``, ``tests/...``, ``scripts/...``, ``bench/...``,
  ``examples/...`` (globs such as ``examples/**/run_*_cpu.sh`` must match something), ``docs/...``,
  ``data_preprocess/...``; a path inside the package may drop its ``grpo_npu/`` (``ops/patch.py``);
  ``path.py::name`` (a pytest node id or a definition) must also define ``name``;
- a dotted name ``grpo_npu.x.y``: a module, or a name defined in one (re-exports followed);
- in markdown, ``module.function()`` or ``module.Class.member`` where ``module`` is the last part of
  exactly one grpo_npu module, and a bare ``::name`` after a ``path.py::name`` of the same line;
- in module docstrings, Sphinx roles (``:func:`...```): a full ``grpo_npu.`` name, or a name of the
  module itself.

And docs/architecture.md's module map names every module of the package.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_npu"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_DIRS = ("grpo_npu", "tests", "scripts", "bench", "examples", "docs", "data_preprocess")
SUBPACKAGES = tuple(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()))

# A repository path, not preceded by a character that makes it part of a longer path or a URL; a path
# inside the package without its grpo_npu/ must name a .py file (``rollout/step.py``: ``rollout/mem_*``
# is a metric).
PATH_RE = re.compile(rf"(?<![\w/.~$-])((?:{'|'.join(TOP_DIRS)})/[\w./*-]*[\w*/]"
                     rf"|(?:{'|'.join(SUBPACKAGES)})/[\w/]*\.py\b)(::[\w.]+)?")
# Written like repository paths, but not ours: what each one is instead.
NOT_OURS = {
    "grpo_npu/arithmetic": "the synthetic task's data_source name",
    "bench/results/quick/": "where quick-size benchmark runs write their JSON (git-ignored, absent in a fresh clone)",
    "docs/source/installation.md": "vllm-ascend's installation page",
    "docs/ascend_tutorial/ascend_quick_start.rst": "verl's Ascend quick start",
}
DOTTED_RE = re.compile(r"(?<![\w./])grpo_npu(?:\.\w+)+")
# `module.function()` or `module.Class[.member]` (a config key such as `rollout.n` is neither).
MODULE_REF_RE = re.compile(r"`(\w+)\.((?:\w+(?=\(\)`)|[A-Z]\w*(?:\.\w+)*))(?:\(\))?`")
# `::name` right after a path.py::name on the same line names another test of that file.
CONTINUATION_RE = re.compile(r"(?<=[\s`(,])::([\w.]+)")
ROLE_RE = re.compile(r":(?:mod|func|class|meth|data|attr):`~?([\w.]+)`")


# -- reading the package's source -----------------------------------------------------------------
def module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def module_names(path: Path) -> dict[str, ast.AST | str | None]:
    """Top-level names of a module: def/class nodes, ``"from:<module>"`` for imported names, None otherwise.

    A module with a ``__getattr__`` also provides the string constants of its top-level assignments
    (the lazy-name tables of grpo_npu.algo, grpo_npu.data, grpo_npu.rollout)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: dict[str, ast.AST | str | None] = {}
    lazy: list[str] = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names[leaf.id] = None
                if node.value is not None:
                    lazy.extend(c.value for c in ast.walk(node.value)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    names[alias.asname or alias.name] = f"from:{node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names[alias.asname or alias.name.split(".")[0]] = None
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    if "__getattr__" in names:
        for name in lazy:
            names.setdefault(name, None)
    return names


def class_members(node: ast.ClassDef) -> set[str]:
    """Methods, class-level names (dataclass fields included) and ``self.x`` attributes of a class."""
    members = set()
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(child.name)
        elif isinstance(child, ast.Assign):
            members.update(t.id for t in child.targets if isinstance(t, ast.Name))
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            members.add(child.target.id)
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name)
                and sub.value.id == "self"):
            members.add(sub.attr)
    return members


def resolve_in(path: Path, attrs: list[str], module: str) -> str | None:
    """None when ``attrs`` names something in the module at ``path``, else why not."""
    names = module_names(path)
    head, rest = attrs[0], attrs[1:]
    if head not in names:
        return f"{module} defines no {head!r}"
    found = names[head]
    if isinstance(found, str):  # imported: follow it when it comes from grpo_npu
        source = found.removeprefix("from:")
        return resolve(".".join([source, head, *rest])) if source.split(".")[0] == "grpo_npu" else None
    if rest and isinstance(found, ast.ClassDef):
        members = class_members(found)
        if rest[0] not in members and not any(isinstance(b, ast.Name) and b.id in names for b in found.bases):
            return f"{module}.{head} has no member {rest[0]!r}"
    return None


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` (grpo_npu.a.b.c) is a module or a name defined in one, else why not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is not None:
            if cut == len(parts):
                return None
            return resolve_in(path, parts[cut:], ".".join(parts[:cut]))
    return f"no module {parts[0]}"


# -- what the docs name ---------------------------------------------------------------------------
def path_problem(path: str, name: str | None) -> str | None:
    """None when the repository path exists (and defines ``name``), else why not."""
    path = path.rstrip(".")
    if path in NOT_OURS:
        return None
    candidates = [path] if path.split("/")[0] in TOP_DIRS else [f"grpo_npu/{path}"]
    for candidate in candidates:
        if "*" in candidate:
            if any(ROOT.glob(candidate)):
                return None
            continue
        target = ROOT / candidate
        if not target.exists():
            continue
        if name is None:
            return None
        if target.suffix != ".py":
            return f"{candidate} is not a Python file, so it defines no {name}"
        dotted = ".".join(target.relative_to(ROOT).with_suffix("").parts)
        return resolve_in(target, name.split("."), dotted)
    return f"no file {candidates[-1]}"


def module_docstrings() -> dict[str, str]:
    docs = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        docs[str(path.relative_to(ROOT))] = text
    return docs


def short_module_names() -> dict[str, str]:
    """Last part of a module name -> the module, for the last parts that name exactly one module."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        seen.setdefault(parts[-1], []).append(".".join(parts))
    return {short: mods[0] for short, mods in seen.items() if len(mods) == 1}


def problems_in(text: str, *, markdown: bool, own_module: str | None = None) -> list[str]:
    problems = []
    for match in PATH_RE.finditer(text):
        why = path_problem(match.group(1), match.group(2)[2:] if match.group(2) else None)
        if why:
            problems.append(f"{match.group(0)}: {why}")
    if markdown:
        for line in text.splitlines():
            files = [m.group(1) for m in PATH_RE.finditer(line) if m.group(1).endswith(".py")]
            for match in CONTINUATION_RE.finditer(line):
                before = [m.group(1) for m in PATH_RE.finditer(line[:match.start()]) if m.group(1).endswith(".py")]
                if not files or not before:
                    problems.append(f"::{match.group(1)}: no path.py before it on its line")
                elif why := path_problem(before[-1], match.group(1)):
                    problems.append(f"::{match.group(1)}: {why}")
    for match in DOTTED_RE.finditer(text):
        why = resolve(match.group(0))
        if why:
            problems.append(f"{match.group(0)}: {why}")
    if markdown:
        short = short_module_names()
        for module, name in MODULE_REF_RE.findall(text):
            if module in short and (why := resolve(f"{short[module]}.{name}")):
                problems.append(f"{module}.{name}: {why}")
    if own_module is not None:
        for name in ROLE_RE.findall(text):
            if name.startswith("grpo_npu."):
                why = resolve(name)
            else:
                why = resolve(f"{own_module}.{name}")
            if why:
                problems.append(f":role:`{name}`: {why}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_name_a_doc_mentions_exists(doc):
    problems = problems_in(doc.read_text(encoding="utf-8"), markdown=True)
    assert problems == [], f"{doc.relative_to(ROOT)} names what does not exist:\n" + "\n".join(problems)


def test_every_file_and_name_a_module_docstring_mentions_exists():
    problems = []
    for rel, text in module_docstrings().items():
        module = ".".join(Path(rel).with_suffix("").parts).removesuffix(".__init__")
        problems += [f"{rel}: {p}" for p in problems_in(text, markdown=False, own_module=module)]
    assert problems == [], "module docstrings name what does not exist:\n" + "\n".join(problems)


def test_nothing_points_outside_the_repository():
    texts = {str(d.relative_to(ROOT)): d.read_text(encoding="utf-8") for d in DOCS} | module_docstrings()
    outside = re.compile(r"shared/docs|shared reference|npu_reference|/work/")
    found = [f"{name}: {m.group(0)}" for name, text in texts.items() for m in outside.finditer(text)]
    assert found == [], "docs point at files a user does not have:\n" + "\n".join(found)


def module_map_entries(doc: str) -> dict[str, str]:
    """docs/architecture.md's module map: entry (``trainer.py``, ``rollout/``, ``models/tiny.py``) -> its text."""
    block = re.search(r"^## Module map\n.*?^```\n(.*?)^```", doc, flags=re.S | re.M)
    assert block, "docs/architecture.md has no module map (a ``` block under '## Module map')"
    entries: dict[str, str] = {}
    name = None
    for line in block.group(1).splitlines():
        if match := re.match(r"  (\S+)\s", line + " "):  # an entry starts two spaces in
            name = match.group(1)
            entries[name] = line
        elif name is not None and line.startswith("   "):
            entries[name] += "\n" + line
        else:
            name = None  # a floor heading
    return entries


def test_architecture_module_map_names_every_module():
    entries = module_map_entries((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        package = f"{rel.parts[0]}/" if len(rel.parts) > 1 else None
        if rel.name == "__init__.py":  # the package root, or a package: an entry for its folder or a module in it
            if package is None or any(entry.startswith(package) for entry in entries):
                continue
        in_package = package in entries and re.search(rf"\b{re.escape(rel.name)}\b", entries[package])
        listed = str(rel) in entries or bool(in_package)
        if rel.name == "names.py" and package:
            listed = listed or "names.py" in entries  # every subpackage's names.py is described once
        if not listed:
            missing.append(str(rel))
    assert missing == [], f"docs/architecture.md's module map does not list: {', '.join(missing)}"


@pytest.mark.parametrize("text, expected", [
    ("`grpo_npu/trainer.py`", []),
    ("`grpo_npu/no_such_module.py`", ["grpo_npu/no_such_module.py: no file grpo_npu/no_such_module.py"]),
    ("`grpo_npu/cluster.py::Workers.generate`", []),
    ("`grpo_npu/cluster.py::Workers.no_such_call`", ["grpo_npu/cluster.py::Workers.no_such_call: "
                                                      "grpo_npu.cluster.Workers has no member 'no_such_call'"]),
    ("`ops/patch.py::patch_model`", []),
    ("`rollout/mem_*` and `perf/mfu/actor` are metrics; `grpo_npu/arithmetic` is a data_source", []),
    ("`examples/**/run_*_cpu.sh`", []),
    ("see grpo_npu.workers.update_loop.UpdateLoop.run", []),
    ("grpo_npu.ops.linear_logprobs", []),  # re-exported: followed to grpo_npu.ops.logprob
    ("grpo_npu.rollout.run_rollout_step", []),  # lazy name of a package with __getattr__
    ("grpo_npu.trainer.Trainer.no_such_phase", ["grpo_npu.trainer.Trainer.no_such_phase: "
                                                "grpo_npu.trainer.Trainer has no member 'no_such_phase'"]),
    ("`compat.fsdp2()`", []),
    ("`compat.no_such_probe()`", ["compat.no_such_probe: grpo_npu.compat defines no 'no_such_probe'"]),
    ("`cluster.Workers.generate` and `rollout.n`", []),
    ("`cluster.Workers.no_such_call`", ["cluster.Workers.no_such_call: grpo_npu.cluster.Workers has no member "
                                        "'no_such_call'"]),
    ("`tests/test_io.py::test_write_atomic_replaces_content_with_the_usual_mode`, `::no_such_test`",
     ["::no_such_test: tests.test_io defines no 'no_such_test'"]),
    ("https://github.com/volcengine/verl/tree/main/examples/x.sh and ~/data/tests/x", []),
])
def test_the_scanner_finds_what_is_wrong_and_only_that(text, expected):
    assert problems_in(text, markdown=True) == expected
