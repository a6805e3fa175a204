"""Automatic backend choice of the ops with a CUDA branch (rms_norm, rotary, logprob)."""

from __future__ import annotations

import pytest

from grpo_npu import device
from grpo_npu.ops import dispatch


@pytest.mark.parametrize("npu,cuda,ready,want", [
    (True, True, True, "npu"), (False, True, True, "cuda"), (False, True, False, "reference"),
    (False, False, True, "reference"),
])  # fmt: skip
def test_auto_npu_cuda_or_reference(monkeypatch, npu, cuda, ready, want):
    monkeypatch.setattr(device, "is_npu_available", lambda: npu)
    monkeypatch.setattr(device, "is_cuda_available", lambda: cuda)
    assert dispatch.auto_npu_cuda_or_reference(lambda: ready)() == want
    if ready:
        assert dispatch.auto_npu_cuda_or_reference()() == want  # no library condition: ready by default
