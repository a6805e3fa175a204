"""Pre-flight checks: the installation and environment settings that commonly break RL runs on Ascend NPUs.

    checks = run_checks(sleep_mode=True)     # one Check per rule: OK / WARN / FAIL, what was seen, a fix
    log_checks(checks, logger)               # the trainer's start-up call: a summary line, then each non-OK

:func:`evaluate` judges :class:`~grpo_npu.installation.Facts` against environment variables and is pure,
so tests feed it any installation. On a plain CPU machine nothing FAILs: the NPU-only checks report
"n/a". Sleep mode: ``sleep_mode=True`` says the vLLM rollout will sleep between steps, ``False`` that it
will not; ``None`` (unknown) turns the sleep-mode conflicts into WARN instead of FAIL.
``python -m grpo_npu.doctor`` prints the same checks as a table (:mod:`grpo_npu.tools.doctor`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from grpo_npu.compat import MINIMUM, STACKS, matching_stack, parse_version, same_release, too_old
from grpo_npu.env import CPU_MALLOC_ENV, PROCESS_ENV_DEFAULTS
from grpo_npu.installation import ATB_ENV, CANN_ROOT_ENV, DEFAULT_CANN_ROOTS, DISTRIBUTIONS, Facts, collect_facts

OK, WARN, FAIL = "OK", "WARN", "FAIL"
STATUSES = (OK, WARN, FAIL)

MIN_PYTHON = (3, 10)
# Core dependencies (pyproject): missing one FAILs; the others are optional extras.
REQUIRED = ("torch", "transformers", "ray")

CANN_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"

# HCCL waits 120 s by default for peers to connect; RL ranks reach their first collective after
# model loading and a rollout, which takes longer on big models. Ascend RL recipes use 1800-5400.
HCCL_MIN_CONNECT_TIMEOUT_S = 1800
# From vllm-ascend 0.11 the NZ weight layout (on by default) makes wake_up() after sleep raise.
VLLM_ASCEND_NZ_BREAKS_SLEEP_FROM = (0, 11)
NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"
NZ_DEFAULT = "1"  # vllm-ascend's envs.py default
RAY_NOSET_ASCEND = "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
ALLOC_CONF_GENERIC = "PYTORCH_ALLOC_CONF"  # read by CUDA's allocator, never by torch_npu
VLLM_ASCEND_POOL_READS_NPU_CONF = (0, 9, 2)  # earlier vllm-ascend sleep pools assert on PYTORCH_CUDA_ALLOC_CONF


@dataclass(frozen=True)
class Check:
    """One check: what was checked, OK/WARN/FAIL, what was seen, and a one-line fix."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Check {self.name!r}: status {self.status!r} is not one of {', '.join(STATUSES)}")


def major_minor(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of "2.5.1.post1", "0.11.0rc1", "2.13.0+cpu"; None if unparsable."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def _sleep_conflict(name: str, what: str, sleep_mode: bool | None, fix: str) -> Check:
    """A setting that breaks vLLM sleep mode: FAIL if it is on, WARN if unknown, OK if off."""
    if sleep_mode is None:
        return Check(name, WARN, f"{what}; this FAILs if the rollout uses sleep mode (unknown here)", fix)
    if sleep_mode:
        return Check(name, FAIL, f"{what} while sleep mode is on", fix)
    return Check(name, OK, f"{what}; fine because sleep mode is off")


def _version_checks(facts: Facts) -> list[Check]:
    checks = []
    py = tuple(int(x) for x in facts.python.split(".")[:2])
    if py < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        checks.append(Check("python", FAIL, f"{facts.python} < {need}", f"use Python >= {need}"))
    else:
        checks.append(Check("python", OK, facts.python))
    for package in DISTRIBUTIONS:
        version = facts.versions.get(package)
        dist = facts.dists.get(package, package)
        shown = f"{version} ({dist})" if version and dist != package else version
        if version is None:
            if package in REQUIRED:
                checks.append(Check(package, FAIL, "not installed", f"pip install {package}"))
            else:
                checks.append(Check(package, OK, "not installed"))
        elif package == "torch" and facts.torch_error:
            checks.append(Check("torch", FAIL, f"{shown}, but import torch fails: {facts.torch_error}",
                                _torch_import_fix(facts.torch_error)))
        else:
            checks.append(Check(package, OK, shown))
        if package == "torch_npu":
            checks.append(_cann_check(facts))
    return checks


def _torch_import_fix(error: str) -> str:
    if "backend extension" in error or "torch_npu" in error:
        return (f"source {CANN_SET_ENV} so the autoloaded torch_npu imports, "
                "or export TORCH_DEVICE_BACKEND_AUTOLOAD=0 to import torch without it")
    return "reinstall the torch build meant for this machine (CPU, CUDA, or the one torch_npu needs)"


def _cann_check(facts: Facts) -> Check:
    if facts.cann_version:
        return Check("cann", OK, f"{facts.cann_version} ({facts.cann_source})")
    where = ", ".join([f"${n}" for n in CANN_ROOT_ENV] + list(DEFAULT_CANN_ROOTS))
    if facts.npu_stack:
        return Check("cann", WARN, f"no CANN toolkit version file found under {where}",
                     f"install the CANN toolkit matching torch_npu {facts.versions['torch_npu']} "
                     "and source its set_env.sh")
    return Check("cann", OK, "not found (n/a without torch_npu)")


def _torch_npu_checks(facts: Facts, environ: Mapping[str, str]) -> list[Check]:
    torch_v, npu_v = facts.versions.get("torch"), facts.versions.get("torch_npu")
    if npu_v is None and facts.torch_npu_error is None:
        return [Check("torch_npu_import", OK, "n/a (torch_npu not installed)"),
                Check("torch_npu_vs_torch", OK, "n/a (torch_npu not installed)")]
    checks = []
    if facts.torch_npu_error:
        seen = ", ".join(f"{n}={environ.get(n) or 'unset'}" for n in CANN_ROOT_ENV)
        ld = "has" if "ascend" in environ.get("LD_LIBRARY_PATH", "").lower() else "has no"
        checks.append(Check(
            "torch_npu_import", FAIL,
            f"import torch_npu fails: {facts.torch_npu_error} ({seen}; LD_LIBRARY_PATH {ld} Ascend entry)",
            f"source {CANN_SET_ENV} (your CANN install's set_env.sh) before starting Python",
        ))
    else:
        checks.append(Check("torch_npu_import", OK, "imports"))
    want, have = major_minor(torch_v), major_minor(npu_v)
    if want is None or have is None:
        checks.append(Check("torch_npu_vs_torch", WARN, f"cannot compare torch {torch_v} with torch_npu {npu_v}",
                            "install torch and torch_npu of the same major.minor"))
    elif want != have:
        checks.append(Check("torch_npu_vs_torch", FAIL, f"torch {torch_v} vs torch_npu {npu_v}: major.minor differ",
                            f"pip install 'torch_npu=={want[0]}.{want[1]}.*' (or torch {have[0]}.{have[1]}), "
                            "matching your CANN"))
    else:
        checks.append(Check("torch_npu_vs_torch", OK, f"torch {torch_v}, torch_npu {npu_v}"))
    return checks


def _vllm_ascend_check(facts: Facts) -> Check:
    vllm_v, plugin_v = facts.versions.get("vllm"), facts.versions.get("vllm_ascend")
    if plugin_v is None:
        return Check("vllm_ascend_vs_vllm", OK, "n/a (vllm-ascend not installed)")
    if vllm_v is None:
        return Check("vllm_ascend_vs_vllm", WARN, f"vllm-ascend {plugin_v} is installed without vllm",
                     f"pip install the vllm release that vllm-ascend {plugin_v} was built for")
    if major_minor(vllm_v) is None or major_minor(vllm_v) != major_minor(plugin_v):
        return Check("vllm_ascend_vs_vllm", WARN, f"vllm {vllm_v} vs vllm-ascend {plugin_v}: major.minor differ",
                     "install the vllm-ascend release line that matches your vllm (same major.minor)")
    return Check("vllm_ascend_vs_vllm", OK, f"vllm {vllm_v}, vllm-ascend {plugin_v}")


def _stack_check(facts: Facts) -> Check:
    """The installation against the three supported Ascend stacks (requirements/npu-*.txt) and the minimum."""
    old = too_old(facts.versions)
    if old:
        need = ", ".join(f"{p} >= {v}" for p, v in MINIMUM.items())
        return Check("stack", FAIL, f"older than the oldest supported stack: {'; '.join(old)}",
                     f"install one of the stacks of docs/install_npu.md ({need})")
    if not facts.npu_stack:
        return Check("stack", OK, "n/a (no torch_npu: not an Ascend stack)")
    stack = matching_stack(facts.versions)
    if stack is not None:
        return Check("stack", OK, f"{stack.name} ({stack.label}): CANN {stack.cann} expected"
                     + ("" if facts.cann_version in (None, stack.cann) else f", found {facts.cann_version}"))
    nearest = max(STACKS, key=lambda st: sum(same_release(facts.versions.get(p), v) for p, v in st.pins().items()))
    off = [f"{p} {facts.versions.get(p) or 'absent'} (pin {v})" for p, v in nearest.pins().items()
           if not same_release(facts.versions.get(p), v)]
    return Check("stack", WARN, f"matches none of {', '.join(s.name for s in STACKS)}; nearest {nearest.name}: "
                 + ", ".join(off), f"pip install -c requirements/{nearest.name}.txt ... (docs/install_npu.md)")


def _atb_check(facts: Facts) -> Check:
    if not facts.npu_stack:
        return Check("nnal_atb", OK, "n/a (no torch_npu)")
    if facts.atb is None:
        status = WARN if facts.versions.get("vllm_ascend") else OK
        return Check("nnal_atb", status, "CANN NNAL (ATB) not found" + (
            ": vllm-ascend's attention and sampling ops load it" if status == WARN else " (vllm-ascend not installed)"),
            "install Ascend-cann-nnal for your CANN and source <Ascend root>/nnal/atb/set_env.sh")
    path, version = facts.atb
    seen = f"{path}{f' ({version})' if version else ''}"
    if not facts.atb_sourced:
        return Check("nnal_atb", WARN, f"{seen} is installed but ${ATB_ENV} is unset (its set_env.sh not sourced)",
                     f"source {path}/set_env.sh")
    return Check("nnal_atb", OK, seen)


def _npu_process_check(facts: Facts, own_pid: int) -> Check:
    if facts.npu_smi_error:
        return Check("npu_processes", WARN, facts.npu_smi_error, "check the NPU driver (npu-smi info)")
    if facts.npu_processes is None:
        return Check("npu_processes", OK, "n/a (npu-smi not on PATH)")
    others = [p for p in facts.npu_processes if p.pid != own_pid]
    if not others:
        return Check("npu_processes", OK, "no process holds an NPU")
    held = "; ".join(f"NPU {p.npu} chip {p.chip}: pid {p.pid}{f' ({p.name})' if p.name else ''} {p.memory_mb} MB"
                     for p in others)
    return Check("npu_processes", WARN, f"already in use: {held} (a previous run still alive? the rollout engine "
                 "sizes its KV cache from what is free)",
                 f"stop them (kill {' '.join(sorted({str(p.pid) for p in others}))}) or pick free NPUs with "
                 "ASCEND_RT_VISIBLE_DEVICES")


def _allocator_toggle_check(facts: Facts, sleep_mode: bool | None) -> Check:
    name = "expandable_segments_toggle"
    if facts.npu_allocator_toggle is None:
        return Check(name, OK, "n/a (no torch_npu, or not probed)")
    if facts.npu_allocator_toggle:
        return Check(name, OK, f"torch_npu {facts.versions.get('torch_npu')} has the run-time toggle: expandable "
                     "segments on for training, off around the rollout engine")
    static = ("stay off for the whole run (sleep mode requires it)" if sleep_mode
              else "stay as PYTORCH_NPU_ALLOC_CONF sets them for the whole run (off if sleep mode is used)")
    return Check(name, OK, f"torch_npu {facts.versions.get('torch_npu')} has no run-time toggle "
                 f"(from 2.10.x among the supported stacks): expandable segments {static}")


def _device_check(facts: Facts) -> Check:
    if facts.torch_error:
        return Check("devices", FAIL, f"not probed: import torch fails ({facts.torch_error})",
                     _torch_import_fix(facts.torch_error))
    if facts.device_error:
        return Check("devices", WARN, f"probe failed: {facts.device_error}",
                     "check the accelerator driver and toolkit install")
    seen = ", ".join(f"{kind} x{n}" for kind, n in facts.devices.items())
    return Check("devices", OK, f"{seen} + cpu" if seen else "cpu only")


def _alloc_conf_check(facts: Facts, environ: Mapping[str, str], sleep_mode: bool | None) -> Check:
    # torch_npu reads only PYTORCH_NPU_ALLOC_CONF; vllm-ascend's sleep pool asserts on CUDA's variable up to 0.9.1
    # (camem.py); CUDA's allocator also reads the generic PYTORCH_ALLOC_CONF.
    plugin = parse_version(facts.versions.get("vllm_ascend"))
    old_pool = facts.npu_stack and plugin is not None and plugin.release[:3] < VLLM_ASCEND_POOL_READS_NPU_CONF
    names = (["PYTORCH_NPU_ALLOC_CONF"] if facts.npu_stack else []) + (
        ["PYTORCH_CUDA_ALLOC_CONF"] if "cuda" in facts.devices or old_pool else [])
    if not names:
        return Check("expandable_segments", OK, "n/a (no accelerator allocator on cpu)")
    shown = list(names)
    if "cuda" in facts.devices:
        names.append(ALLOC_CONF_GENERIC)
    on = [n for n in names if "expandable_segments:true" in environ.get(n, "").replace(" ", "").lower()]
    if not on:
        return Check("expandable_segments", OK, f"not enabled through {'/'.join(shown)}")
    return _sleep_conflict(
        "expandable_segments", f"{'/'.join(on)} turns expandable_segments on (vLLM's sleep allocator "
        "asserts it is off)", sleep_mode,
        f"remove expandable_segments:True from {on[0]}; where torch_npu has the run-time toggle the trainer turns "
        "them on for training itself",
    )


def _nz_check(facts: Facts, environ: Mapping[str, str], sleep_mode: bool | None) -> Check:
    plugin_v = facts.versions.get("vllm_ascend")
    if plugin_v is None:
        return Check("vllm_ascend_nz", OK, "n/a (vllm-ascend not installed)")
    line = major_minor(plugin_v)
    if line is None:
        return Check("vllm_ascend_nz", WARN, f"cannot parse vllm-ascend version {plugin_v!r}",
                     f"export {NZ_ENV}=0 if you use sleep mode")
    value = environ.get(NZ_ENV, NZ_DEFAULT).strip()
    if line < VLLM_ASCEND_NZ_BREAKS_SLEEP_FROM or value == "0":
        return Check("vllm_ascend_nz", OK, f"{NZ_ENV}={value} with vllm-ascend {plugin_v}")
    shown = f"{NZ_ENV}={value}" if NZ_ENV in environ else f"{NZ_ENV} unset (default {NZ_DEFAULT})"
    return _sleep_conflict("vllm_ascend_nz", f"{shown} with vllm-ascend {plugin_v} (wake_up raises)",
                           sleep_mode, f"export {NZ_ENV}=0")


def _ray_visible_check(environ: Mapping[str, str]) -> Check:
    visible = environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible is None:
        return Check("ray_ascend_visible_devices", OK, "ASCEND_RT_VISIBLE_DEVICES unset")
    if environ.get(RAY_NOSET_ASCEND):
        return Check("ray_ascend_visible_devices", OK,
                     f"ASCEND_RT_VISIBLE_DEVICES={visible}, {RAY_NOSET_ASCEND}={environ[RAY_NOSET_ASCEND]}")
    return Check(
        "ray_ascend_visible_devices", WARN,
        f"ASCEND_RT_VISIBLE_DEVICES={visible} but {RAY_NOSET_ASCEND} is unset: Ray resets it in each actor "
        "to the NPUs it assigned, so device indices inside workers change",
        f"export {RAY_NOSET_ASCEND}=1",
    )


def _hccl_check(facts: Facts, environ: Mapping[str, str]) -> Check:
    if not facts.npu_stack:
        return Check("hccl_connect_timeout", OK, "n/a (no Ascend stack)")
    fix = f"export HCCL_CONNECT_TIMEOUT={HCCL_MIN_CONNECT_TIMEOUT_S}"
    raw = environ.get("HCCL_CONNECT_TIMEOUT")
    if raw is None:
        return Check("hccl_connect_timeout", WARN, "HCCL_CONNECT_TIMEOUT unset (HCCL waits 120 s)", fix)
    try:
        seconds = int(raw)
    except ValueError:
        return Check("hccl_connect_timeout", WARN, f"HCCL_CONNECT_TIMEOUT={raw!r} is not an integer", fix)
    if seconds < HCCL_MIN_CONNECT_TIMEOUT_S:
        return Check("hccl_connect_timeout", WARN,
                     f"HCCL_CONNECT_TIMEOUT={seconds} < {HCCL_MIN_CONNECT_TIMEOUT_S} s", fix)
    return Check("hccl_connect_timeout", OK, f"HCCL_CONNECT_TIMEOUT={seconds}")


def _thp_alloc_check(environ: Mapping[str, str]) -> Check:
    name, want = "THP_MEM_ALLOC_ENABLE", PROCESS_ENV_DEFAULTS["THP_MEM_ALLOC_ENABLE"]
    raw = environ.get(name)
    if raw is None:
        return Check("cpu_thp_alloc", OK, f"{name} unset: grpo_npu's entry points set {name}={want}")
    if raw.strip() == want:
        return Check("cpu_thp_alloc", OK, f"{name}={raw}: host buffers >= 2 MB use huge pages")
    return Check("cpu_thp_alloc", WARN,
                 f"{name}={raw}: torch faults large host buffers in 4 KB pages (slower steps on CPU, and wherever "
                 "parameters or optimizer state live on the host)", f"unset {name} (grpo_npu then sets {want})")


def _cpu_malloc_check(facts: Facts, environ: Mapping[str, str]) -> Check:
    name = "cpu_malloc_retain"
    if facts.devices:
        return Check(name, OK, "n/a: accelerator runs keep glibc's defaults (host memory peaks go back)")
    given = {k: environ[k] for k in CPU_MALLOC_ENV if k in environ}
    if not given:
        return Check(name, OK, "unset: on CPU runs grpo_npu's entry points set "
                     + ", ".join(f"{k}={v}" for k, v in CPU_MALLOC_ENV.items()))
    if given == CPU_MALLOC_ENV:
        return Check(name, OK, "freed host memory stays in the process for reuse")
    shown = ", ".join(f"{k}={v}" for k, v in given.items())
    return Check(name, WARN, f"{shown}: glibc hands freed buffers back and each CPU step faults them in again "
                 "(measured: the 0.5B-shape update 2x slower)",
                 f"unset {' and '.join(CPU_MALLOC_ENV)} (grpo_npu then sets them on CPU runs)")


def evaluate(facts: Facts, environ: Mapping[str, str], sleep_mode: bool | None = None,
             own_pid: int | None = None) -> list[Check]:
    """Judge observed facts and environment variables; pure, so tests can feed any installation.
    ``own_pid``: this process, whose own NPU use is not a stale process (default: os.getpid())."""
    return [
        *_version_checks(facts),
        _stack_check(facts),
        _atb_check(facts),
        _device_check(facts),
        _npu_process_check(facts, os.getpid() if own_pid is None else own_pid),
        *_torch_npu_checks(facts, environ),
        _vllm_ascend_check(facts),
        _alloc_conf_check(facts, environ, sleep_mode),
        _allocator_toggle_check(facts, sleep_mode),
        _nz_check(facts, environ, sleep_mode),
        _ray_visible_check(environ),
        _hccl_check(facts, environ),
        _thp_alloc_check(environ),
        _cpu_malloc_check(facts, environ),
    ]


def run_checks(environ: Mapping[str, str] | None = None, *, sleep_mode: bool | None = None) -> list[Check]:
    """Observe this process's installation and judge it against ``environ`` (default os.environ)."""
    environ = os.environ if environ is None else environ
    return evaluate(collect_facts(environ), environ, sleep_mode)


def has_failures(checks: Sequence[Check]) -> bool:
    return any(c.status == FAIL for c in checks)


def summary_line(checks: Sequence[Check]) -> str:
    """One line for the trainer log: counts per status and the names of the non-OK checks."""
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    parts = [f"doctor: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL"]
    for status in (FAIL, WARN):
        names = [c.name for c in checks if c.status == status]
        if names:
            parts.append(f"{status}: {', '.join(names)}")
    return "; ".join(parts)


def log_checks(checks: Sequence[Check], logger: logging.Logger) -> None:
    """Log the summary line, then each WARN/FAIL with its fix (the trainer's start-up call)."""
    logger.info(summary_line(checks))
    for c in checks:
        if c.status != OK:
            logger.warning("doctor %s %s: %s%s", c.status, c.name, c.detail, f" -> fix: {c.fix}" if c.fix else "")
