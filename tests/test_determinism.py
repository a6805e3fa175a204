"""trainer.deterministic=True: the environment and the torch switches of grpo_npu/determinism.py."""

from __future__ import annotations

import logging
import os

import torch

from grpo_npu import determinism
from grpo_npu.config.schema import TrainerConfig


def test_env_is_set_and_a_different_value_replaced_with_a_warning(caplog):
    environ = {"HCCL_DETERMINISTIC": "false", "OTHER": "kept"}
    with caplog.at_level(logging.WARNING, logger="grpo_npu.determinism"):
        changed = determinism.set_deterministic_env(environ)
    assert environ == {**determinism.DETERMINISTIC_ENV, "OTHER": "kept"}
    assert environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and environ["HCCL_DETERMINISTIC"] == "true"
    assert changed == determinism.DETERMINISTIC_ENV
    assert "HCCL_DETERMINISTIC=false replaced by true" in caplog.text
    assert determinism.set_deterministic_env(environ) == {}  # idempotent


def test_make_deterministic_switches_torch(monkeypatch):
    for key in determinism.DETERMINISTIC_ENV:
        monkeypatch.delenv(key, raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        determinism.make_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert all(os.environ[k] == v for k, v in determinism.DETERMINISTIC_ENV.items())
    finally:
        torch.use_deterministic_algorithms(before)
        torch.backends.cudnn.deterministic = False


def test_the_key_defaults_off():
    assert TrainerConfig().deterministic is False
