"""Check the pinned Ascend stacks (requirements/npu-*.txt) against what their packages declare.

For each stack it reads, from the package registry (PyPI, through its simple API, the protocol pip
itself uses), the requirements each package states and compares them with the pins:
  - grpo_npu's own dependencies (pyproject.toml);
  - torch_npu's wheel metadata, for every Python of the stack on x86_64 and aarch64 (that a wheel
    exists is checked too); torchvision / torchaudio / transformers wheel metadata;
  - vllm's source release: the requirement file its setup.py installs with VLLM_TARGET_DEVICE=empty
    (requirements-common.txt, later requirements/common.txt), and its build-system pins;
  - vllm-ascend's source release: requirements.txt (what its setup.py installs) and its build-system
    pins; that each of its exact (==) requirements is on PyPI at all.
Then, unless --no-resolve, pip resolves the whole stack once without installing anything
(``pip install --dry-run --only-binary=:all:`` for linux x86_64 and the stack's first Python): the
source-built vllm and vllm-ascend are replaced by their requirements, and torch_npu is left out
(it is never handed to pip here; its metadata is read above).

Wheel metadata comes from the registry's metadata files (PEP 658) where offered, else from the
wheel; source releases are downloaded and read as tar files. Nothing is installed or built: running
vllm-ascend's build backend, which ``pip download`` of a source release does, would install
torch_npu into a build environment. CANN cannot be checked here; the table says so.

Needs the registry; not part of CI. Rerun when bumping a stack and paste the output into
docs/install_npu.md:
    python scripts/check_npu_pins.py [--stack npu-8.1] [--cache DIR] [--no-resolve]
Exit status 1 when any row is FAIL.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
INDEX = "https://pypi.org/simple"
ARCHES = ("x86_64", "aarch64")
# The resolver's target: glibc 2.34, the older of the CANN images' systems (Ubuntu 22.04: 2.35,
# openEuler 22.03: 2.34), so every manylinux tag up to 2_34 (pip takes --platform literally).
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{minor}_x86_64" for minor in range(5, 35)))
# Built from a source checkout, so their own pins are checked through their requirement files.
SOURCE_BUILT = ("vllm", "vllm-ascend")
# Key packages whose resolved version the resolver summary prints.
SUMMARY = ("torch", "torchvision", "transformers", "tokenizers", "huggingface-hub", "numpy", "ray", "datasets")


@dataclass
class Stack:
    name: str
    pins: dict[str, str]  # canonical name -> exact version
    pythons: list[str]
    cann: str

    def pin(self, name: str) -> str | None:
        return self.pins.get(canonicalize_name(name))


@dataclass
class Report:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def add(self, stack: Stack, source: str, requirement: str, status: str, note: str = "") -> None:
        self.rows.append((stack.name, source, requirement, status, note))

    def print(self) -> None:
        widths = [max(len(r[i]) for r in self.rows + [("stack", "source", "requirement", "status", "")]) for i in range(4)]
        head = ("stack", "source", "requirement", "status", "note")
        for row in [head] + self.rows:
            print("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])

    @property
    def failed(self) -> bool:
        return any(r[3] == "FAIL" for r in self.rows)


# ------------------------------------------------------------------------------------------------
# Registry access
# ------------------------------------------------------------------------------------------------
class Registry:
    """PyPI's simple API (PEP 691 JSON), with every answer and download cached in one directory."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.cache.mkdir(parents=True, exist_ok=True)

    def _get(self, url: str, accept: str | None = None) -> bytes:
        request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.read()

    def files(self, project: str) -> list[dict]:
        path = self.cache / f"{canonicalize_name(project)}.index.json"
        if not path.exists():
            body = self._get(f"{INDEX}/{canonicalize_name(project)}/", "application/vnd.pypi.simple.v1+json")
            path.write_bytes(body)
        return json.loads(path.read_bytes())["files"]

    def known(self, project: str) -> bool:
        try:
            return bool(self.files(project))
        except urllib.error.HTTPError:
            return False

    def exists(self, project: str, version: str) -> bool:
        return self.known(project) and any(_file_version(f["filename"]) == Version(version) for f in self.files(project))

    def download(self, entry: dict, suffix: str = "") -> bytes:
        path = self.cache / (entry["filename"] + suffix)
        if not path.exists():
            data = self._get(entry["url"] + suffix)
            if not suffix and hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
                raise SystemExit(f"{entry['filename']}: sha256 does not match the index")
            path.write_bytes(data)
        return path.read_bytes()

    def wheel(self, project: str, version: str, python: str, arch: str | None) -> dict | None:
        """The wheel of project==version for CPython `python` on linux `arch` (None: pure Python)."""
        tag = "cp" + python.replace(".", "")
        for entry in self.files(project):
            if not entry["filename"].endswith(".whl") or entry.get("yanked"):
                continue
            _, wheel_version, _, tags = parse_wheel_filename(entry["filename"])
            if wheel_version != Version(version):
                continue
            for t in tags:
                abi3 = t.abi == "abi3" and t.interpreter.startswith("cp3") and int(t.interpreter[3:]) <= int(tag[3:])
                if (t.interpreter in (tag, "py3") or abi3) and (
                    (arch is None and t.platform == "any") or (arch and "linux" in t.platform and arch in t.platform)
                ):
                    return entry
        return None

    def metadata(self, entry: dict) -> dict:
        """Requires-Dist and Requires-Python lines of a wheel (PEP 658 file, else the wheel itself)."""
        if entry.get("core-metadata") or entry.get("data-dist-info-metadata"):
            text = self.download(entry, ".metadata").decode("utf-8")
        else:
            with zipfile.ZipFile(io.BytesIO(self.download(entry))) as zf:
                name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
                text = zf.read(name).decode("utf-8")
        headers = HeaderParser().parsestr(text)
        return {"requires": headers.get_all("Requires-Dist") or [], "python": headers.get("Requires-Python")}

    def sdist(self, project: str, version: str) -> tarfile.TarFile:
        for entry in self.files(project):
            if entry["filename"].endswith(".tar.gz") and _file_version(entry["filename"]) == Version(version):
                return tarfile.open(fileobj=io.BytesIO(self.download(entry)))
        raise SystemExit(f"no source release of {project}=={version} on {INDEX}")


def _file_version(filename: str) -> Version | None:
    if filename.endswith(".whl"):
        return parse_wheel_filename(filename)[1]
    match = re.match(r".+?-(\d[^-]*)\.tar\.gz$", filename)
    try:
        return Version(match.group(1)) if match else None
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------------
# Comparing requirements with pins
# ------------------------------------------------------------------------------------------------
def read_stack(path: Path) -> Stack:
    pins, pythons, cann = {}, [], "?"
    for line in path.read_text().splitlines():
        if line.startswith("# python:"):
            pythons = line.split(":", 1)[1].split()
        elif line.startswith("# cann:"):
            cann = line.split(":", 1)[1].strip()
        elif line.strip() and not line.startswith("#"):
            req = Requirement(line.strip())
            (spec,) = req.specifier
            if spec.operator != "==":
                raise SystemExit(f"{path.name}: '{line}' is not an exact pin (name==version)")
            pins[canonicalize_name(req.name)] = spec.version
    if not pythons:
        raise SystemExit(f"{path.name}: missing the '# python: X.Y ...' line")
    return Stack(path.stem, pins, pythons, cann)


def _environment(python: str, arch: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": python + ".0", "platform_machine": arch,
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "extra": ""}


def _contains(spec: SpecifierSet, version: str) -> bool:
    return spec.contains(Version(version), prereleases=True)


def _requirements(lines: list[str], python: str, arch: str) -> list[Requirement]:
    """Requirement lines (comments, options and markers that do not apply to python/arch dropped)."""
    reqs = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(_environment(python, arch)):
            reqs.append(req)
    return reqs


def check_requirements(report: Report, stack: Stack, source: str, lines: list[str], python: str, arch: str) -> None:
    """One row per requirement on a pinned package (markers evaluated for python/arch)."""
    for req in _requirements(lines, python, arch):
        pinned = stack.pin(req.name)
        if pinned is None:
            continue
        spec, note = req.specifier, f"pinned {req.name}=={pinned}"
        if any("+" in s.version for s in spec):  # torch==X+cpu: torch_npu's x86_64 wheels
            spec = SpecifierSet(",".join(f"{s.operator}{s.version.split('+')[0]}" for s in spec))
            note = "x86_64 wants the +cpu build, not on PyPI: torch from https://download.pytorch.org/whl/cpu"
        report.add(stack, source, str(req), "OK" if _contains(spec, pinned) else "FAIL", note)


def check_pyproject(report: Report, stack: Stack) -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    check_requirements(report, stack, "grpo_npu pyproject.toml", deps, stack.pythons[0], "x86_64")


def check_torch_npu(report: Report, stack: Stack, registry: Registry) -> None:
    version = stack.pin("torch_npu")
    for python in stack.pythons:
        for arch in ARCHES:
            entry = registry.wheel("torch_npu", version, python, arch)
            source = f"torch_npu {version} cp{python.replace('.', '')} {arch} wheel METADATA"
            if entry is None:
                report.add(stack, source, "(wheel)", "FAIL", "no wheel on PyPI for this Python/arch")
                continue
            check_requirements(report, stack, source, registry.metadata(entry)["requires"], python, arch)


def check_wheels(report: Report, stack: Stack, registry: Registry) -> None:
    """torchvision / torchaudio / transformers / tokenizers: requirements and Requires-Python."""
    for name in ("torchvision", "torchaudio", "transformers", "tokenizers", "triton-ascend"):
        version = stack.pin(name)
        if version is None:
            continue
        for python in stack.pythons:
            entry = registry.wheel(name, version, python, "x86_64") or registry.wheel(name, version, python, None)
            if entry is None:
                report.add(stack, f"{name} {version} cp{python.replace('.', '')}", "(wheel)", "FAIL", "no linux x86_64 wheel")
                continue
            meta = registry.metadata(entry)
            if python != stack.pythons[0]:
                continue
            source = f"{name} {version} wheel METADATA"
            check_requirements(report, stack, source, meta["requires"], python, "x86_64")
            if meta["python"]:
                ok = all(_contains(SpecifierSet(meta["python"]), p) for p in stack.pythons)
                report.add(stack, source, f"Requires-Python {meta['python']}", "OK" if ok else "FAIL",
                           f"stack Pythons {' '.join(stack.pythons)}")


def _member(tar: tarfile.TarFile, suffix: str) -> str | None:
    for name in tar.getnames():
        if name.count("/") == 1 + suffix.count("/") and name.endswith("/" + suffix):
            return tar.extractfile(name).read().decode("utf-8")
    return None


def _requirement_file(tar: tarfile.TarFile, path: str) -> list[str]:
    """A requirements file with its '-r other.txt' includes, relative to the file's folder."""
    text = _member(tar, path)
    if text is None:
        return []
    folder = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
    lines = []
    for line in text.splitlines():
        if line.startswith("-r "):
            lines += _requirement_file(tar, folder + line.split()[1])
        else:
            lines.append(line)
    return lines


def _build_requires(tar: tarfile.TarFile) -> list[str]:
    text = _member(tar, "pyproject.toml")
    return tomllib.loads(text).get("build-system", {}).get("requires", []) if text else []


def check_vllm(report: Report, stack: Stack, registry: Registry) -> list[str]:
    version = stack.pin("vllm")
    tar = registry.sdist("vllm", version)
    path = "requirements-common.txt" if _member(tar, "requirements-common.txt") else "requirements/common.txt"
    lines = _requirement_file(tar, path)
    check_requirements(report, stack, f"vllm {version} sdist {path}", lines, stack.pythons[0], "x86_64")
    for req in map(Requirement, _build_requires(tar)):
        if canonicalize_name(req.name) == "torch":
            same = stack.pin("torch") is not None and _contains(req.specifier, stack.pin("torch"))
            report.add(stack, f"vllm {version} sdist pyproject.toml [build-system]", str(req), "OK" if same else "NOTE",
                       "" if same else "the isolated build environment only; no effect on the installed torch")
    built = f"{version}+empty"  # what VLLM_TARGET_DEVICE=empty makes setup.py call the version
    ok = _contains(SpecifierSet(f"=={version}"), built)
    report.add(stack, "vllm source build", f"vllm=={version} vs {built}", "OK" if ok else "FAIL",
               "a constraint without a local label accepts the +empty build")
    return [str(r) for r in _requirements(lines, stack.pythons[0], "x86_64")]


def check_vllm_ascend(report: Report, stack: Stack, registry: Registry) -> list[str]:
    version = stack.pin("vllm-ascend")
    tar = registry.sdist("vllm-ascend", version)
    lines = _requirement_file(tar, "requirements.txt")
    check_requirements(report, stack, f"vllm-ascend {version} sdist requirements.txt", lines, stack.pythons[0], "x86_64")
    check_requirements(report, stack, f"vllm-ascend {version} sdist pyproject.toml [build-system]",
                       _build_requires(tar), stack.pythons[0], "x86_64")
    setup = _member(tar, "setup.py") or ""
    match = re.search(r"python_requires\s*=\s*[\"']([^\"']+)", setup)
    docs = _member(tar, "docs/source/installation.md") or ""
    upper = re.search(r"Python:\s*>=\s*3\.\d+,\s*<\s*(3\.\d+)", docs)
    if match:
        spec = SpecifierSet(match.group(1) + (f",<{upper.group(1)}" if upper else ""))
        ok = all(_contains(spec, p) for p in stack.pythons)
        report.add(stack, f"vllm-ascend {version} setup.py + docs/source/installation.md", f"Python {spec}",
                   "OK" if ok else "FAIL", f"stack Pythons {' '.join(stack.pythons)}")
    missing = set()
    for req in _requirements(lines, stack.pythons[0], "x86_64"):
        exact = [spec.version for spec in req.specifier if spec.operator == "=="]
        name = canonicalize_name(req.name)
        if name in stack.pins:
            continue
        source = f"vllm-ascend {version} sdist requirements.txt"
        if not (registry.exists(req.name, exact[0]) if exact else registry.known(req.name)):
            missing.add(name)
            what = "this release is" if registry.known(req.name) else "the project is"
            report.add(stack, source, str(req), "UNVERIFIED",
                       f"{what} not on PyPI: Huawei's index https://mirrors.huaweicloud.com/ascend/repos/pypi")
        elif exact and not any(registry.wheel(req.name, exact[0], p, a) for p in stack.pythons[:1]
                               for a in ("x86_64", None)):
            missing.add(name)
            report.add(stack, source, str(req), "UNVERIFIED",
                       "a source release only on PyPI: pip builds it when installing; left out of the resolve")
    return [str(r) for r in _requirements(lines, stack.pythons[0], "x86_64") if canonicalize_name(r.name) not in missing]


def check_pins_exist(report: Report, stack: Stack, registry: Registry) -> None:
    for name, version in stack.pins.items():
        found = registry.exists(name, version)
        report.add(stack, "PyPI index", f"{name}=={version}", "OK" if found else "FAIL",
                   "released" if found else "no such release on PyPI")


def resolve(report: Report, stack: Stack, requirements: list[str], work: Path) -> None:
    """pip resolves the stack for linux x86_64 without installing; torch_npu is never passed to pip."""
    reqs = [r for r in requirements if canonicalize_name(Requirement(r).name) != "torch-npu"]
    reqs += tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [f"{n}=={v}" for n, v in stack.pins.items() if n not in ("torch-npu", *SOURCE_BUILT)]
    (work / f"{stack.name}.req.txt").write_text("\n".join(reqs) + "\n")
    (work / f"{stack.name}.pins.txt").write_text("\n".join(pins) + "\n")
    out = work / f"{stack.name}.report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(out),
           "--only-binary=:all:", *(arg for p in PLATFORMS for arg in ("--platform", p)),
           "--python-version", stack.pythons[0], "--target", str(work / "never-created"),
           "-r", str(work / f"{stack.name}.req.txt"), "-c", str(work / f"{stack.name}.pins.txt")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    source = f"pip resolve (py{stack.pythons[0]}, linux x86_64)"
    if done.returncode != 0:
        error = [line for line in done.stderr.splitlines()
                 if ("ERROR" in line or "conflict" in line.lower()) and "Ignored the following" not in line]
        report.add(stack, source, f"{len(reqs)} requirements + pins", "FAIL", " | ".join(error[-3:])[:300])
        return
    resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
                for i in json.loads(out.read_text())["install"]}
    shown = ", ".join(f"{n} {resolved[n]}" for n in SUMMARY if n in resolved)
    report.add(stack, source, f"{len(resolved)} distributions", "OK", shown)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="append", help="e.g. npu-8.1 (default: every requirements/npu-*.txt)")
    parser.add_argument("--cache", type=Path, help="keep downloads here between runs (default: a temp dir)")
    parser.add_argument("--no-resolve", action="store_true", help="skip the pip dry-run resolution")
    args = parser.parse_args(argv)
    paths = sorted((ROOT / "requirements").glob("npu-*.txt"))
    if args.stack:
        paths = [p for p in paths if p.stem in args.stack]
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        registry = Registry(args.cache or Path(tmp) / "cache")
        for path in paths:
            stack = read_stack(path)
            report.add(stack, "CANN", stack.cann, "UNVERIFIED", "installed from Huawei's site; no registry to check")
            check_pins_exist(report, stack, registry)
            check_pyproject(report, stack)
            check_torch_npu(report, stack, registry)
            check_wheels(report, stack, registry)
            requirements = check_vllm(report, stack, registry) + check_vllm_ascend(report, stack, registry)
            if not args.no_resolve:
                resolve(report, stack, requirements, Path(tmp))
    report.print()
    sys.exit(1 if report.failed else 0)


if __name__ == "__main__":
    main()
