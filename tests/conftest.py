"""Shared pytest setup: hardware markers skip cleanly where the hardware is absent."""

from __future__ import annotations

import os

import pytest

# Keep the CPU suite deterministic and quiet, and never let a test reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _have(kind: str) -> bool:
    from grpo_npu import device

    return device.is_npu_available() if kind == "npu" else device.is_cuda_available()


def pytest_collection_modifyitems(config, items):
    for kind in ("npu", "cuda"):
        if _have(kind):
            continue
        skip = pytest.mark.skip(reason=f"needs a {kind.upper()} device")
        for item in items:
            if kind in item.keywords:
                item.add_marker(skip)
