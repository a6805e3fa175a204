"""Shared pytest setup: hardware markers skip cleanly where the hardware is absent."""

from __future__ import annotations

import os

import pytest

# Keep the CPU suite deterministic and quiet, and never let a test reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _no_process_malloc_changes(monkeypatch):
    """Entry points called in-process would switch the whole test process to keeping freed memory
    (env.retain_freed_host_memory), and later tests that watch RSS would see it. The settings' own tests
    pass a C library explicitly or run a fresh process."""
    from grpo_npu import env

    monkeypatch.setattr(env, "_glibc", lambda: None)


def _have(kind: str) -> bool:
    from grpo_npu import device

    if kind == "cpu_bf16":
        return device.cpu_has_bf16_dot_products()
    return device.is_npu_available() if kind == "npu" else device.is_cuda_available()


_NEEDS = {"npu": "an NPU device", "cuda": "a CUDA device",
          "cpu_bf16": "a CPU with AVX512-BF16 or AMX (where the vLLM engine's auto dtype is bf16)"}


def pytest_collection_modifyitems(config, items):
    for kind, what in _NEEDS.items():
        if _have(kind):
            continue
        skip = pytest.mark.skip(reason=f"needs {what}")
        for item in items:
            if kind in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """Where the session's tiny models are built: $GRPO_NPU_TEST_CACHE, else a session temp folder."""
    return os.environ.get("GRPO_NPU_TEST_CACHE") or tmp_path_factory.mktemp("tiny_cache")


@pytest.fixture(scope="session")
def tiny_model_path(tiny_cache):
    """The offline tiny Qwen2 + tokenizer kit, built once per test session (a few seconds)."""
    from grpo_npu.models.tiny import build_tiny_model

    return str(build_tiny_model(tiny_cache))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)
