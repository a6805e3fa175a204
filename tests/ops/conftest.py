"""Fixtures for grpo_npu.ops: force a backend, or run the NPU branch against the torch_npu emulator."""

from __future__ import annotations

import sys

import pytest
import torch

from grpo_npu.ops import dispatch

from . import fake_torch_npu


@pytest.fixture
def reference_backend():
    """Every op on its plain-PyTorch reference for the duration of the test."""
    with dispatch.use_backend("reference"):
        yield


@pytest.fixture
def cuda_branch():
    """rms_norm and rotary on their CUDA branches (plain torch ops, so they run on CPU tensors too)."""
    with dispatch.use_backend("cuda", ops=("rms_norm", "rotary")):
        yield


@pytest.fixture
def fake_npu(monkeypatch):
    """Every op on its NPU branch, with the emulator standing in for torch_npu in sys.modules."""
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu)
    fake_torch_npu.calls.clear()
    with dispatch.use_backend("npu"):
        yield fake_torch_npu


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
