"""grpo_npu's torch_npu calls and the CPU emulator, checked against the schemas of the real wheels.

npu_schemas.json is read from the torch_npu 2.5.1, 2.7.1 and 2.10.0.post4 wheels by
scripts/extract_npu_schemas.py (never importing torch_npu). Three checks:
- every ``npu_*`` call in grpo_npu/ops passes only arguments that every supported version declares,
  and relies only on defaults that are the same in all of them (found by reading the source with ast);
- the ``torch.npu`` functions grpo_npu/device.py calls exist in every supported version, and the ones it
  only probes for (getattr/hasattr) are recorded per version;
- the emulator has the parameters and defaults the versions share, and raises on the documented
  constraints that npu_schemas.json transcribes.
"""

from __future__ import annotations

import ast
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from . import fake_torch_npu as npu

ROOT = Path(__file__).resolve().parents[2]
EXTRACT = json.loads(npu.SCHEMA_FILE.read_text())
SUPPORTED = {v: e for v, e in EXTRACT["versions"].items() if e["supported"]}
OP_FILES = sorted((ROOT / "grpo_npu" / "ops").glob("*.py"))
DEVICE_FILE = ROOT / "grpo_npu" / "device.py"
_NO_DEFAULT = object()


def test_the_three_stacks_are_extracted():
    assert sorted(SUPPORTED) == ["2.10.0.post4", "2.5.1", "2.7.1"]
    for version, entry in SUPPORTED.items():
        missing = [op for op in EXTRACT["ops"] if entry["ops"][op] is None]
        assert not missing, f"torch_npu {version} lacks {missing}"


# ------------------------------------------------------------------------------------------------
# (a) the calls in grpo_npu/ops
# ------------------------------------------------------------------------------------------------
@dataclass
class OpCall:
    where: str  # file:line
    op: str
    positional: int
    keywords: tuple[str, ...]
    star: bool  # *args or **kwargs: the arguments cannot be read from the source


def _is_torch_npu_module(node: ast.AST, aliases: set[str]) -> bool:
    """``dispatch.torch_npu()`` / ``torch_npu()``, a name bound to one of them, or the module ``torch_npu``."""
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        func = node.func
        return getattr(func, "attr", getattr(func, "id", None)) == "torch_npu"
    return isinstance(node, ast.Name) and (node.id in aliases or node.id == "torch_npu")


def _op_calls(path: Path) -> tuple[list[OpCall], list[str]]:
    """Every npu_* call on torch_npu in a file, and every npu_* attribute access that is not one."""
    tree = ast.parse(path.read_text())
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_torch_npu_module(node.value, set())
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    calls, called_attrs, strays = [], set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("npu_"):
            if _is_torch_npu_module(node.func.value, aliases):
                star = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                calls.append(OpCall(where, node.func.attr, len(node.args), tuple(k.arg for k in node.keywords if k.arg), star))
                called_attrs.add(id(node.func))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("npu_") and id(node) not in called_attrs:
            strays.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return calls, strays


def _all_op_calls() -> list[OpCall]:
    calls, strays = [], []
    for path in OP_FILES + [DEVICE_FILE]:
        found, loose = _op_calls(path)
        calls += found
        strays += loose
    assert not strays, f"npu_* accessed other than as a direct call on torch_npu (cannot be checked): {strays}"
    return calls


def _params(version: str, op: str) -> list[dict]:
    schema = SUPPORTED[version]["ops"].get(op)
    if schema is None:
        raise AssertionError(f"torch_npu {version} has no {op}")
    return schema["params"]


def _default(param: dict) -> object:
    return param["default"] if "default" in param else _NO_DEFAULT


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def test_finds_the_calls_grpo_npu_makes():
    ops = {call.op for call in _all_op_calls()}
    assert ops == set(EXTRACT["ops"]), (
        f"grpo_npu calls {sorted(ops)}; npu_schemas.json covers {EXTRACT['ops']} "
        "(add new ops to OPS in scripts/extract_npu_schemas.py and rerun it)"
    )


@pytest.mark.parametrize("call", _all_op_calls(), ids=lambda c: f"{c.op}@{c.where}")
def test_call_fits_every_supported_version(call: OpCall):
    assert not call.star, f"{call.where}: {call.op} called with *args/**kwargs; name every argument"
    relied: dict[str, dict[str, object]] = {}  # parameter -> {version: default} for parameters not passed
    for version in SUPPORTED:
        params = _params(version, call.op)
        positional = [p for p in params if not p["kwarg_only"]]
        assert call.positional <= len(positional), (
            f"{call.where}: {call.positional} positional arguments, torch_npu {version} {call.op} takes {len(positional)}"
        )
        names = [p["name"] for p in params]
        unknown = [k for k in call.keywords if k not in names]
        assert not unknown, f"{call.where}: {call.op} has no parameter {unknown} in torch_npu {version}"
        passed = set(names[: call.positional]) | set(call.keywords)
        assert len(passed) == call.positional + len(call.keywords), f"{call.where}: an argument is passed twice"
        for p in params:
            if p["name"] not in passed:
                assert "default" in p, f"{call.where}: required {call.op}({p['name']}) not passed (torch_npu {version})"
                relied.setdefault(p["name"], {})[version] = _default(p)
    for name, defaults in relied.items():
        values = list(defaults.values())
        if len(defaults) == len(SUPPORTED):
            assert all(_same(v, values[0]) for v in values), (
                f"{call.where}: relies on the default of {call.op}({name}), which differs: {defaults}"
            )


# ------------------------------------------------------------------------------------------------
# (a') the torch.npu functions grpo_npu/device.py uses
# ------------------------------------------------------------------------------------------------
def _device_module_names(node: ast.AST, aliases: set[str]) -> bool:
    """``self.module``, ``torch.npu``, or a local name bound to one of them (or to getattr(torch, "npu"))."""
    if isinstance(node, ast.Attribute):
        return (node.attr == "module" and getattr(node.value, "id", None) == "self") or (
            node.attr == "npu" and getattr(node.value, "id", None) == "torch"
        )
    return isinstance(node, ast.Name) and node.id in aliases


def _probe(node: ast.AST, aliases: set[str]) -> str | None:
    """getattr(<module>, "a", ...) or getattr(getattr(<module>, "a", ...), "b", ...) -> 'a' / 'a.b'."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and len(node.args) >= 2:
        base, name = node.args[0], node.args[1]
        if not isinstance(name, ast.Constant):
            return None
        if _device_module_names(base, aliases):
            return name.value
        inner = _probe(base, aliases)
        return f"{inner}.{name.value}" if inner else None
    return None


def _device_api_uses() -> tuple[set[str], set[str]]:
    """(names device.py calls on torch.npu directly, names it only probes for with getattr/hasattr)."""
    tree = ast.parse(DEVICE_FILE.read_text())
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.IfExp):
                value = value.body
            npu_getattr = _probe(value, set()) is None and isinstance(value, ast.Call) and (
                getattr(value.func, "id", None) == "getattr" and getattr(value.args[0], "id", None) == "torch"
                and getattr(value.args[1], "value", None) == "npu")
            if _device_module_names(value, set()) or npu_getattr:
                aliases.add(node.targets[0].id)
    direct, probed = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _device_module_names(node.value, aliases):
            direct.add(node.attr)
        name = _probe(node, aliases)
        if name:
            probed.add(name)
    return direct - {"memory"}, probed


def test_device_calls_exist_in_every_supported_version():
    direct, probed = _device_api_uses()
    assert {"mem_get_info", "memory_reserved", "set_device"} <= direct, f"device.py scan found only {sorted(direct)}"
    for version, entry in SUPPORTED.items():
        missing = sorted(name for name in direct if name not in entry["npu_api"])
        assert not missing, f"grpo_npu/device.py calls torch.npu.{missing}, absent in torch_npu {version}; probe for it"
    assert "memory._set_allocator_settings" in probed


def test_runtime_allocator_toggle_exists_only_from_2_10():
    """The fact the expandable-segments docs rest on: no runtime toggle in 2.5.1 or 2.7.1."""
    have = {v: "memory._set_allocator_settings" in e["npu_api"] for v, e in SUPPORTED.items()}
    assert have == {"2.5.1": False, "2.7.1": False, "2.10.0.post4": True}


def test_rc1_lacks_the_cross_entropy_op():
    """Why the quickstart stack pins torch_npu 2.5.1 and not 2.5.1rc1."""
    rc1 = EXTRACT["versions"]["2.5.1rc1"]
    assert not rc1["supported"] and rc1["ops"]["npu_cross_entropy_loss"] is None
    assert [p["name"] for p in rc1["ops"]["npu_rotary_mul"]["params"]] == ["self", "r1", "r2"]


# ------------------------------------------------------------------------------------------------
# (b) the emulator
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", EXTRACT["ops"])
@pytest.mark.parametrize("version", sorted(SUPPORTED))
def test_emulator_signature_is_a_prefix_of_each_version(op, version):
    emulated = list(inspect.signature(getattr(npu, op)).parameters.values())
    params = _params(version, op)
    assert len(emulated) <= len(params)
    for have, want in zip(emulated, params):
        assert have.name == want["name"], f"{op}: emulator parameter {have.name}, torch_npu {version} {want['name']}"
        want_default = _default(want)
        have_default = _NO_DEFAULT if have.default is inspect.Parameter.empty else have.default
        assert have_default is want_default or _same(have_default, want_default), (
            f"{op}.{have.name}: emulator default {have.default!r}, torch_npu {version} {want_default!r}"
        )
    later = [p["name"] for p in params[len(emulated):] if "default" not in p]
    assert not later, f"torch_npu {version} {op} has required parameters the emulator lacks: {later}"


def test_emulator_covers_the_shared_parameters():
    """The emulator stops where the versions diverge: a call using a later parameter fails on it."""
    for op in EXTRACT["ops"]:
        shared = min(len(_params(v, op)) for v in SUPPORTED)
        names = [[p["name"] for p in _params(v, op)][:shared] for v in SUPPORTED]
        common = len(inspect.signature(getattr(npu, op)).parameters)
        assert all(n[:common] == names[0][:common] for n in names)
        if common < shared:
            assert any(n[common] != names[0][common] for n in names), f"{op}: the emulator stops early"


def _compressed():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)


def _bnsd(b=1, n=2, s=4, d=8):
    return torch.randn(b, n, s, d), torch.randn(b, n, s, d), torch.randn(b, n, s, d)


def _fa_tnd_row():
    q = torch.randn(4, 2, 8)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[1] = True
    npu.npu_fusion_attention(q, q, q, 2, "TND", atten_mask=mask, actual_seq_qlen=[4], actual_seq_kvlen=[4])


def _fa_bsnd_row():
    q, k, v = _bnsd()
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[0] = True
    npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask)


def _ce_grad():
    x = torch.randn(3, 5, requires_grad=True)
    npu.npu_cross_entropy_loss(x, torch.zeros(3, dtype=torch.long), weight=torch.ones(5))


# constraint id -> a call that breaks it (each must raise); ids from npu_schemas.json "constraints"
VIOLATIONS = {
    "fa_tnd_no_fully_masked_row": _fa_tnd_row,
    "fa_fully_masked_row_precision": _fa_bsnd_row,
    "fa_mask_polarity_and_shape": lambda: npu.npu_fusion_attention(*_bnsd(), 2, "BNSD", atten_mask=torch.zeros(4, 4)),
    "fa_no_mask_is_full_attention": None,  # semantics, not a rejection: test_emulator.py::test_fusion_attention_sparse_modes
    "fa_compressed_causal_mask": lambda: npu.npu_fusion_attention(
        *_bnsd(), 2, "BNSD", atten_mask=_compressed()[:4, :4], sparse_mode=3),
    "fa_actual_seq_cumulative": lambda: npu.npu_fusion_attention(
        *(torch.randn(4, 2, 8) for _ in range(3)), 2, "TND", atten_mask=_compressed(), sparse_mode=3,
        actual_seq_qlen=[0, 4], actual_seq_kvlen=[0, 4]),
    "fa_tnd_max_sequences": lambda: npu.npu_fusion_attention(
        *(torch.randn(1025, 2, 8) for _ in range(3)), 2, "TND", atten_mask=_compressed(), sparse_mode=3,
        actual_seq_qlen=list(range(1, 1026)), actual_seq_kvlen=list(range(1, 1026))),
    "fa_heads_and_head_dim": lambda: npu.npu_fusion_attention(
        torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), 3, "BNSD"),
    "fa_default_scale_is_one": None,  # a default: test_emulator_signature_is_a_prefix_of_each_version
    "rms_norm_dtype_and_rank": lambda: npu.npu_rms_norm(torch.randn(2, 8), torch.randn(8).double()),
    "rotary_half_layouts": lambda: npu.npu_rotary_mul(*(torch.randn(1, 1, 2, 7) for _ in range(3))),
    "swiglu_rank_dtype": lambda: npu.npu_swiglu(torch.randn(4, 6).double()),
    "swiglu_contiguous": lambda: npu.npu_swiglu(torch.randn(6, 4).t()),
    "ce_row_limit": lambda: npu.npu_cross_entropy_loss(
        torch.zeros(200_001, 1), torch.zeros(200_001, dtype=torch.long), reduction="none"),
    "ce_reduction_values": lambda: npu.npu_cross_entropy_loss(torch.randn(3, 5), torch.zeros(3, dtype=torch.long),
                                                              reduction="sum"),
    "ce_target_and_weight": lambda: npu.npu_cross_entropy_loss(torch.randn(3, 5), torch.zeros(3, dtype=torch.int32)),
    "ce_grad_defaults": _ce_grad,
    "ce_zloss_disabled": lambda: npu.npu_cross_entropy_loss(torch.randn(3, 5), torch.zeros(3, dtype=torch.long),
                                                            return_zloss=True),
}


def test_every_emulated_constraint_has_a_violation_here():
    emulated = {c["id"] for c in EXTRACT["constraints"] if c["emulated"]}
    assert emulated == set(VIOLATIONS), f"emulated in npu_schemas.json: {sorted(emulated)}; here: {sorted(VIOLATIONS)}"
    assert all(c["source"] for c in EXTRACT["constraints"])


@pytest.mark.parametrize("constraint", sorted(k for k, v in VIOLATIONS.items() if v is not None))
def test_emulator_raises_on_documented_violation(constraint):
    with pytest.raises(npu.NpuKernelError):
        VIOLATIONS[constraint]()


def test_fully_masked_row_is_allowed_in_precise_mode():
    q, k, v = _bnsd()
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[0] = True
    out = npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask, inner_precise=2)[0]
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
