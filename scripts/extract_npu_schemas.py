"""Extract the torch_npu op schemas grpo_npu calls, from the released wheels, into tests/ops/npu_schemas.json.

The CPU emulator of torch_npu (tests/ops/fake_torch_npu.py) and every ``torch_npu.npu_*`` call in
grpo_npu are checked against this file (tests/ops/test_npu_schemas.py), so the tests follow the real
signatures and defaults of each supported torch_npu rather than a copy written by hand.

What it does, for each torch_npu version in VERSIONS:
  1. ``pip download --no-deps --only-binary=:all:`` the linux x86_64 / CPython 3.11 wheel into a
     work directory (kept between runs with --wheels DIR);
  2. reads it as a zip file -- torch_npu is never installed and never imported;
  3. for each op in OPS takes the schema line from the wheel's
     ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (the one torch_npu generates its
     Python bindings from) and the op's docstring from ``torch_npu/_op_plugin_docs.py``;
  4. records the ``torch.npu`` functions the wheel defines (``torch_npu/npu/__init__.py``'s
     ``__all__`` plus every top-level function of ``torch_npu/npu/memory.py``) with their Python
     signatures, so presence checks such as ``memory._set_allocator_settings`` are answered per version.
The ``constraints`` list of an existing output file is kept as is: it holds rules transcribed by hand,
each with its source, that a schema line cannot express.

Needs the package registry (PyPI); not part of CI. Rerun when a torch_npu version is added or bumped:
    python scripts/extract_npu_schemas.py [--wheels /tmp/torch_npu_wheels] [--out tests/ops/npu_schemas.json]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

# Supported torch_npu versions (the three stacks in docs/install_npu.md), plus 2.5.1rc1, which some
# quickstarts install, recorded so that the file shows why it is not supported.
VERSIONS = {"2.5.1": True, "2.7.1": True, "2.10.0.post4": True, "2.5.1rc1": False}
OPS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention", "npu_cross_entropy_loss")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
PYTHON = "3.11"
SCHEMA_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
DOCS_PY = "torch_npu/_op_plugin_docs.py"
NPU_INIT = "torch_npu/npu/__init__.py"
NPU_DIR = "torch_npu/npu/"
NPU_MEMORY = "torch_npu/npu/memory.py"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "ops" / "npu_schemas.json"


# ------------------------------------------------------------------------------------------------
# Schema strings
# ------------------------------------------------------------------------------------------------
def _literal(text: str):
    """A schema default ('None', 'True', '1.', '-100', "'half'", '"mean"') as a Python value."""
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    if text[:1] in "'\"":
        return text[1:-1]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return float(text)


def _split_params(params: str) -> list[str]:
    """Split on the commas between parameters (none of our schemas nests brackets with commas)."""
    return [p.strip() for p in params.split(",") if p.strip()]


def parse_schema(schema: str) -> dict:
    """'name(Type a, *, Type b=default) -> ret' -> {name, params: [{name, type, default?, kwarg_only}], returns}."""
    match = re.fullmatch(r"(\w+)\((.*)\)\s*->\s*(.+)", schema.strip())
    if match is None:
        raise ValueError(f"unparsable schema: {schema!r}")
    name, params_text, returns = match.groups()
    params, kwarg_only = [], False
    for item in _split_params(params_text):
        if item == "*":
            kwarg_only = True
            continue
        decl, eq, default = item.partition("=")
        ptype, pname = decl.rsplit(None, 1)
        param = {"name": pname, "type": ptype, "kwarg_only": kwarg_only}
        if eq:
            param["default"] = _literal(default.strip())
            param["default_text"] = default.strip()
        params.append(param)
    return {"name": name, "params": params, "returns": returns.strip()}


# ------------------------------------------------------------------------------------------------
# Reading one wheel
# ------------------------------------------------------------------------------------------------
def _op_entries(zf: zipfile.ZipFile) -> dict[str, dict]:
    entries = yaml.safe_load(zf.read(SCHEMA_YAML).decode("utf-8"))
    found = {}
    for section in entries.values() if isinstance(entries, dict) else [entries]:
        for entry in section if isinstance(section, list) else []:
            func = entry.get("func", "") if isinstance(entry, dict) else ""
            name = func.split("(", 1)[0]
            if name in OPS and name not in found:
                found[name] = {"schema": func, "exposed": bool(entry.get("exposed", False))}
    return found


def _op_docs(zf: zipfile.ZipFile) -> dict[str, str]:
    tree = ast.parse(zf.read(DOCS_PY).decode("utf-8"))
    docs = {}
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "_add_torch_npu_docstr":
            name, text = (a.value for a in call.args[:2])
            if name in OPS:
                docs[name] = text.strip("\n")
    return docs


def _functions(source: str) -> dict[str, str]:
    """Top-level function name -> '(args)' of one module's source."""
    return {
        node.name: f"({ast.unparse(node.args)})"
        for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _npu_api(zf: zipfile.ZipFile) -> dict[str, dict]:
    """torch.npu.<name> for names in __all__ (signature where a module of torch_npu/npu defines it),
    and torch.npu.memory.<name> for every top-level function of memory.py."""
    init_tree = ast.parse(zf.read(NPU_INIT).decode("utf-8"))
    exported: list[str] = []
    for node in init_tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            exported = [elt.value for elt in node.value.elts]
    defs: dict[str, tuple[str, str]] = {}
    modules = sorted(n for n in zf.namelist() if n.startswith(NPU_DIR) and n.endswith(".py") and n.count("/") == 2)
    for module in [NPU_INIT] + [m for m in modules if m != NPU_INIT]:
        for name, signature in _functions(zf.read(module).decode("utf-8")).items():
            defs.setdefault(name, (module, signature))
    api = {}
    for name in exported:
        module, signature = defs.get(name, (NPU_INIT, None))
        api[name] = {"source": module, "signature": signature}
    for name, signature in _functions(zf.read(NPU_MEMORY).decode("utf-8")).items():
        api[f"memory.{name}"] = {"source": NPU_MEMORY, "signature": signature}
    return dict(sorted(api.items()))


def read_wheel(path: Path, supported: bool) -> dict:
    with zipfile.ZipFile(path) as zf:
        entries, docs = _op_entries(zf), _op_docs(zf)
        ops = {}
        for op in OPS:
            if op not in entries:
                ops[op] = None  # the op does not exist in this version
                continue
            ops[op] = {
                **parse_schema(entries[op]["schema"]),
                "schema": entries[op]["schema"],
                "exposed": entries[op]["exposed"],
                "source": SCHEMA_YAML,
                "doc": docs.get(op),
                "doc_source": DOCS_PY if op in docs else None,
            }
        return {
            "supported": supported,
            "wheel": path.name,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "ops": ops,
            "npu_api": _npu_api(zf),
        }


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------
def download(version: str, wheels: Path) -> Path:
    found = sorted(wheels.glob(f"torch_npu-{version}-*.whl"))
    if found:
        return found[0]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *platforms,
           "--python-version", PYTHON, "-d", str(wheels), f"torch_npu=={version}"]
    subprocess.run(cmd, check=True)
    found = sorted(wheels.glob(f"torch_npu-{version}-*.whl"))
    if not found:
        raise SystemExit(f"pip downloaded no torch_npu-{version} wheel into {wheels}")
    return found[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="directory for the downloaded wheels (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheels or Path(tmp)
        wheels.mkdir(parents=True, exist_ok=True)
        versions = {v: read_wheel(download(v, wheels), supported) for v, supported in VERSIONS.items()}
    out = {
        "about": "torch_npu op schemas and docs read from the wheels by scripts/extract_npu_schemas.py "
                 "(do not edit 'versions' by hand; 'constraints' is transcribed by hand and kept on rerun)",
        "wheel_tags": f"cp{PYTHON.replace('.', '')}, linux x86_64",
        "ops": list(OPS),
        "versions": versions,
        "constraints": previous.get("constraints", []),
    }
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({len(versions)} versions, {len(OPS)} ops)")


if __name__ == "__main__":
    main()
