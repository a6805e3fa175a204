"""A user's reward function loaded from a Python file (``custom_reward_function.path`` / ``.name``).

The function is called like verl's, by keyword: ``fn(data_source=..., solution_str=...,
ground_truth=..., extra_info=..., **kwargs)``, and returns a float or a dict with at least
``"score"``. :class:`FileFunction` keeps the (path, name) it came from, so a scoring process pool
can pickle it and load it again in each worker.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

DEFAULT_NAME = "compute_score"


def load_function(path: str | os.PathLike, name: str = DEFAULT_NAME) -> Callable:
    """Import ``path`` as a module and return its callable ``name``; errors name the path and function."""
    path = Path(path).expanduser().resolve()
    if path.is_dir():
        raise FileNotFoundError(f"custom_reward_function.path={path} is a directory: expected a Python file")
    if not path.is_file():
        raise FileNotFoundError(f"custom_reward_function.path={path} does not exist")
    # A unique module name per file: two custom files with the same stem must not shadow each other.
    module_name = f"grpo_npu_custom_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path={path} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ImportError(f"custom_reward_function.path={path} failed to import: {type(err).__name__}: {err}") from err
    sys.modules[module_name] = module
    fn = getattr(module, name, None)
    if not callable(fn):
        known = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom_reward_function.name={name!r}: {path} has no function of that name; it defines {known}"
        )
    return fn


class FileFunction:
    """``load_function(path, name)`` with fixed keyword arguments; pickles as (path, name, kwargs)."""

    def __init__(self, path: str | os.PathLike, name: str = DEFAULT_NAME, kwargs: dict[str, Any] | None = None):
        self.path = str(Path(path).expanduser().resolve())
        self.name = name
        self.kwargs = dict(kwargs or {})
        self._fn = load_function(self.path, name)

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        return self._fn(
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info,
            **self.kwargs,
        )

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name, "kwargs": self.kwargs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["name"], state["kwargs"])

    def __repr__(self) -> str:
        return f"FileFunction({self.path!r}, {self.name!r})"
