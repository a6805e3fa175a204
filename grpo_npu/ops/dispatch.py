"""How every op picks its implementation: once, by name, overridable for tests.

Each op module owns one :class:`OpBackend`. The first call resolves it (``npu`` when an Ascend NPU is
usable, ``cuda`` for the ops that have a CUDA kernel and a library providing it, else ``reference``)
and the answer is cached for the life of the process. ``set("npu" | "reference" | None)`` forces a
backend or goes back to automatic resolution; tests use it to drive the NPU branch against an
emulator of torch_npu placed in ``sys.modules``.

The NPU branch never imports torch_npu at module import time: :func:`torch_npu` looks the module up
on every call through ``importlib`` (a ``sys.modules`` hit after the first), so the package imports
on machines without torch_npu and a test can substitute the module.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

from grpo_npu import device

log = logging.getLogger(__name__)

BACKENDS = ("npu", "cuda", "onednn", "reference")
# The device whose tensors an accelerator backend serves in automatic mode.
BACKEND_DEVICE = {"npu": "npu", "cuda": "cuda", "onednn": "cpu"}


def torch_npu() -> ModuleType:
    """The torch_npu module (or whatever stands in for it in ``sys.modules``)."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise RuntimeError(
            "an op is set to backend 'npu' but torch_npu cannot be imported; install torch_npu "
            "matching your torch and CANN, or set the op backend to 'reference'"
        ) from exc


def _auto_npu_or_reference() -> str:
    return "npu" if device.is_npu_available() else "reference"


def auto_npu_cuda_or_reference(cuda_ready: Callable[[], bool] = lambda: True) -> Callable[[], str]:
    """The automatic choice of an op with a CUDA branch: ``npu`` when an Ascend NPU is usable, ``cuda`` when a CUDA GPU
    is and ``cuda_ready()`` (what the branch needs from the installed libraries), else ``reference``."""

    def auto() -> str:
        if device.is_npu_available():
            return "npu"
        return "cuda" if device.is_cuda_available() and cuda_ready() else "reference"

    return auto


class OpBackend:
    """The backend of one op, resolved on first use and cached; ``set`` overrides it."""

    def __init__(
        self,
        op: str,
        supported: tuple[str, ...] = ("npu", "reference"),
        auto: Callable[[], str] = _auto_npu_or_reference,
    ) -> None:
        unknown = set(supported) - set(BACKENDS)
        if unknown:
            raise ValueError(f"op {op!r}: unknown backends {sorted(unknown)}; known: {', '.join(BACKENDS)}")
        self.op = op
        self.supported = supported
        self._auto = auto
        self._forced: str | None = None
        self._resolved: str | None = None

    def get(self) -> str:
        """The backend in use: the forced one, else the automatic choice (made once)."""
        if self._forced is not None:
            return self._forced
        if self._resolved is None:
            self._resolved = self._auto()
            log.info("op %s: backend %s", self.op, self._resolved)
        return self._resolved

    def set(self, name: str | None) -> None:
        """Force a backend for this op (None: automatic)."""
        if name is not None and name not in self.supported:
            raise ValueError(
                f"op {self.op!r} has no backend {name!r}; supported: {', '.join(self.supported)}"
            )
        self._forced = name

    def pick(self, x: torch.Tensor) -> str:
        """The backend for one call on tensor x.

        A forced backend always wins (tests drive the NPU branch on CPU tensors through an
        emulator). In automatic mode an accelerator backend only serves tensors that live on that
        accelerator, so CPU tensors on an NPU or CUDA machine still take the reference path.
        """
        if self._forced is not None:
            return self._forced
        chosen = self.get()
        return chosen if chosen == "reference" or x.device.type == BACKEND_DEVICE[chosen] else "reference"

    @property
    def forced(self) -> str | None:
        return self._forced


_REGISTRY: dict[str, OpBackend] = {}


def register(backend: OpBackend) -> OpBackend:
    """Add an op's backend to the registry that :func:`set_backend` and :func:`backends` use."""
    if backend.op in _REGISTRY:
        raise ValueError(f"op {backend.op!r} is already registered")
    _REGISTRY[backend.op] = backend
    return backend


def get(op: str) -> OpBackend:
    """The OpBackend of one op by name."""
    try:
        return _REGISTRY[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(sorted(_REGISTRY))}") from None


def backends() -> dict[str, str]:
    """op name -> backend in use, for every registered op."""
    return {name: b.get() for name, b in sorted(_REGISTRY.items())}


def set_backend(name: str | None, ops: tuple[str, ...] | None = None) -> None:
    """Force ``name`` on the given ops (all that support it when ops is None); None: automatic."""
    targets = [get(op) for op in ops] if ops is not None else list(_REGISTRY.values())
    for b in targets:
        if ops is None and name is not None and name not in b.supported:
            continue  # e.g. "cuda" forced globally only applies where a CUDA kernel exists
        b.set(name)


@contextlib.contextmanager
def use_backend(name: str | None, ops: tuple[str, ...] | None = None) -> Iterator[None]:
    """Force a backend inside a ``with`` block and restore the previous forced state after."""
    targets = [get(op) for op in ops] if ops is not None else list(_REGISTRY.values())
    previous = {b.op: b.forced for b in targets}
    try:
        set_backend(name, ops)
        yield
    finally:
        for b in targets:
            b.set(previous[b.op])
