"""What the installed torch, torch_npu, vllm, vllm-ascend and transformers provide, decided once per process.

Code that depends on a version asks :func:`current` (a frozen :class:`Compat`, probed on first use)
instead of catching AttributeError where the call happens:

    stack = compat.current()
    stack.require_supported(vllm=True)        # older than the oldest supported stack: one-line UserError
    for line in stack.off("npu", sleep_mode=True): log.info(line)   # what an older stack cannot do
    fully_shard = compat.fsdp2().fully_shard   # torch.distributed.fsdp, or _composable.fsdp on torch 2.5

The three supported Ascend stacks are :data:`STACKS` (the constraint files ``requirements/npu-*.txt``;
``tests/test_compat.py`` keeps the two equal). What an older supported stack lacks degrades to the
nearest correct behaviour, named by :meth:`Compat.off` once at start. Where each fact comes from
(package, version, file): docs/npu.md sections 1, 4 and 5. Torch-free at import: the doctor uses it
where ``import torch`` fails.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping, Optional, Sequence

from packaging.version import InvalidVersion, Version

from grpo_npu.errors import UserError
from grpo_npu.installation import DISTRIBUTIONS, installed_version


@dataclass(frozen=True)
class Stack:
    """One supported Ascend stack: ``requirements/<name>.txt`` (install steps: docs/install_npu.md)."""

    name: str
    label: str
    cann: str
    torch: str
    torch_npu: str
    vllm: str
    vllm_ascend: str
    transformers: str

    def pins(self) -> dict[str, str]:
        """Package (a DISTRIBUTIONS key) -> pinned version."""
        return {"torch": self.torch, "torch_npu": self.torch_npu, "vllm": self.vllm,
                "vllm_ascend": self.vllm_ascend, "transformers": self.transformers}


STACKS = (
    Stack("npu-8.1", "quickstart", "8.1.RC1", "2.5.1", "2.5.1", "0.7.3", "0.7.3.post1", "4.57.6"),
    Stack("npu-8.3", "seed-era", "8.3.RC1", "2.7.1", "2.7.1", "0.11.0", "0.11.0rc1", "4.57.1"),
    Stack("npu-9.1", "current", "9.1.0", "2.10.0", "2.10.0.post4", "0.23.0", "0.23.0", "5.5.4"),
)
# The oldest supported versions (the quickstart stack; transformers: the code's own floor, pyproject.toml).
MINIMUM = {"torch": "2.5.1", "torch_npu": "2.5.1", "transformers": "4.56.0", "vllm": "0.7.3", "vllm_ascend": "0.7.3"}

# First vllm releases with each feature, read in the released sources (docs/npu.md section 4).
VLLM_TAGGED_WAKE_UP = (0, 8, 3)  # LLM.wake_up(tags=...): weights and KV cache wake separately
VLLM_SLEEP_MODE_QUERY = (0, 8, 5)  # Platform.is_sleep_mode_available
VLLM_LEVEL2_KEEPS_BUFFERS = (0, 8, 5)  # a level-2 sleep saves the model's buffers and restores them on wake
VLLM_LOGPROBS_MODE = (0, 10, 0)  # ModelConfig.logprobs_mode
VLLM_ASCEND_LEVEL2_KEEPS_BUFFERS = (0, 11)  # the same in vllm-ascend's NPUWorker
FSDP2_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")  # torch >= 2.6, torch 2.5


class UnsupportedStack(UserError):
    """An installed package is older than the oldest supported stack (one line, exit 2)."""


def parse_version(text: Optional[str]) -> Optional[Version]:
    """``Version`` of "2.5.1+cpu", "0.11.0rc1", "0.7.3+empty"; None when absent or unparsable."""
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def _release_at_least(text: Optional[str], first: tuple[int, ...]) -> bool:
    version = parse_version(text)
    return version is not None and version.release[: len(first)] >= first


@dataclass(frozen=True)
class Compat:
    """The installed versions and what they provide. Build with :func:`probe` (or :func:`current`)."""

    versions: Mapping[str, Optional[str]]  # DISTRIBUTIONS key -> installed version, None when absent
    fsdp2_module: Optional[str]  # where fully_shard lives (one of FSDP2_MODULES), None without FSDP2
    fsdp_reshard_toggle: bool  # FSDPModule.set_reshard_after_forward (absent in torch 2.5.1 and 2.7.1)
    grad_total_norm: bool  # torch.nn.utils.get_total_norm (absent in torch 2.5.1)
    npu_allocator_toggle: bool  # torch_npu's memory._set_allocator_settings (2.10.x of the three)

    # -- vLLM, by version: checked in the released sources, no import needed -----------------------
    @property
    def vllm_tagged_wake_up(self) -> bool:
        return _release_at_least(self.versions.get("vllm"), VLLM_TAGGED_WAKE_UP)

    @property
    def vllm_sleep_mode_query(self) -> bool:
        return _release_at_least(self.versions.get("vllm"), VLLM_SLEEP_MODE_QUERY)

    @property
    def vllm_logprobs_mode(self) -> bool:
        return _release_at_least(self.versions.get("vllm"), VLLM_LOGPROBS_MODE)

    @property
    def sleep_level2_keeps_buffers(self) -> bool:
        """A level-2 sleep restores rotary caches and other buffers on wake (else only level 1 is safe)."""
        ascend = self.versions.get("vllm_ascend")
        if ascend is not None and not _release_at_least(ascend, VLLM_ASCEND_LEVEL2_KEEPS_BUFFERS):
            return False
        return _release_at_least(self.versions.get("vllm"), VLLM_LEVEL2_KEEPS_BUFFERS)

    # -- judging -----------------------------------------------------------------------------------
    def too_old(self, packages: Sequence[str] = tuple(MINIMUM)) -> list[str]:
        return too_old(self.versions, packages)

    def require_supported(self, *, vllm: bool) -> None:
        """Refuse, in one line, a stack older than the oldest supported one (vllm/vllm-ascend only if used)."""
        packages = [p for p in MINIMUM if vllm or p not in ("vllm", "vllm_ascend")]
        old = self.too_old(packages)
        if self.fsdp2_module is None and not any(o.startswith("torch ") for o in old):
            old.append(f"torch {self.versions.get('torch')} has no FSDP2 fully_shard")
        if old:
            minimum = ", ".join(f"{p} >= {MINIMUM[p]}" for p in packages)
            raise UnsupportedStack(f"unsupported installation ({'; '.join(old)}): grpo_npu needs {minimum} "
                                   "(the supported Ascend stacks: docs/install_npu.md)")

    def matching_stack(self) -> Optional[Stack]:
        return matching_stack(self.versions)

    def off(self, device_kind: str, *, rollout: Optional[str], sleep_mode: bool, sleep_level: int) -> list[str]:
        """One line per feature this stack lacks for a run on ``device_kind`` with the ``rollout`` engine
        ("vllm", "hf" or None), naming what happens instead."""
        lines = []
        vllm = rollout == "vllm"
        if rollout == "hf" and not self.fsdp_reshard_toggle:
            lines.append(f"torch {self.versions.get('torch')} has no FSDPModule.set_reshard_after_forward: the "
                         "transformers rollout all-gathers each layer per generated token instead of once")
        if device_kind == "npu" and not self.npu_allocator_toggle:
            static = ("off for the whole run (the sleep-mode pool refuses them in PYTORCH_NPU_ALLOC_CONF)"
                      if vllm and sleep_mode else "as PYTORCH_NPU_ALLOC_CONF sets them for the whole run")
            lines.append(f"torch_npu {self.versions.get('torch_npu')} has no run-time allocator toggle "
                         f"(memory._set_allocator_settings): expandable segments stay {static}")
        if vllm and sleep_mode and not self.vllm_tagged_wake_up:
            lines.append(f"vllm {self.versions.get('vllm')} wakes without tags: weights and KV cache come back "
                         "together, so the weight sync peaks with the KV cache allocated")
        if vllm and sleep_mode and sleep_level == 2 and not self.sleep_level2_keeps_buffers:
            lines.append(f"vllm {self.versions.get('vllm')} / vllm-ascend {self.versions.get('vllm_ascend')} lose "
                         "the model's buffers in a level-2 sleep: the rollout sleeps at level 1")
        return lines


def too_old(versions: Mapping[str, Optional[str]], packages: Sequence[str] = tuple(MINIMUM)) -> list[str]:
    """"package version < minimum" for each installed package of ``packages`` older than MINIMUM."""
    old = []
    for package in packages:
        have, need = versions.get(package), MINIMUM[package]
        parsed = parse_version(have)
        if have is not None and (parsed is None or parsed < Version(need)):
            old.append(f"{package} {have} < {need}")
    return old


def matching_stack(versions: Mapping[str, Optional[str]]) -> Optional[Stack]:
    """The supported stack whose every pin the installed versions match (local labels such as +cpu ignored)."""
    for stack in STACKS:
        if all(same_release(versions.get(p), v) for p, v in stack.pins().items()):
            return stack
    return None


def same_release(have: Optional[str], pin: str) -> bool:
    """``have`` is the pinned release (a local label such as +cpu or +empty aside)."""
    version = parse_version(have)
    return version is not None and version.public == Version(pin).public


def _import(name: str) -> Optional[ModuleType]:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _npu_allocator_toggle() -> bool:
    from grpo_npu import device  # imports torch: only when asked, this module stays torch-free at import

    return device.torch_npu_installed() and device.Device("npu").has_allocator_toggle()


def probe(
    versions: Optional[Mapping[str, Optional[str]]] = None,
    *,
    import_module: Callable[[str], Optional[ModuleType]] = _import,
    npu_allocator_toggle: Optional[Callable[[], bool]] = None,
) -> Compat:
    """Observe the installation: versions from package metadata, torch features by looking at torch itself."""
    if versions is None:
        versions = {package: installed_version(names)[0] for package, names in DISTRIBUTIONS.items()}
    fsdp2_module = next((name for name in FSDP2_MODULES
                         if getattr(import_module(name), "fully_shard", None) is not None), None)
    fsdp_module = getattr(import_module(fsdp2_module), "FSDPModule", None) if fsdp2_module else None
    nn_utils = import_module("torch.nn.utils")
    return Compat(
        versions=dict(versions),
        fsdp2_module=fsdp2_module,
        fsdp_reshard_toggle=hasattr(fsdp_module, "set_reshard_after_forward"),
        grad_total_norm=hasattr(nn_utils, "get_total_norm"),
        npu_allocator_toggle=(npu_allocator_toggle or _npu_allocator_toggle)(),
    )


@functools.lru_cache(maxsize=None)
def current() -> Compat:
    """This process's :class:`Compat`, probed once."""
    return probe()


# ------------------------------------------------------------------------------------------------
# The few calls whose home moved between the supported versions
# ------------------------------------------------------------------------------------------------
def fsdp2() -> ModuleType:
    """The module holding fully_shard, FSDPModule, MixedPrecisionPolicy, (CPU)OffloadPolicy and
    register_fsdp_forward_method: ``torch.distributed.fsdp`` (torch >= 2.6), ``._composable.fsdp`` (2.5)."""
    name = current().fsdp2_module
    if name is None:
        raise UnsupportedStack(f"torch {current().versions.get('torch')} has no FSDP2 fully_shard; grpo_npu needs "
                               f"torch >= {MINIMUM['torch']}")
    return importlib.import_module(name)


def total_norm(grads: list, norm_type: float = 2.0):
    """The norm of all ``grads`` together (0-d tensor): torch's get_total_norm, or its torch 2.5 equivalent
    (the norm of the per-tensor norms, as torch 2.5's clip_grad_norm_ computes it)."""
    import torch  # torch-free at import (see the module docstring)

    if current().grad_total_norm:
        return torch.nn.utils.get_total_norm(grads, norm_type=norm_type, error_if_nonfinite=False)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)
