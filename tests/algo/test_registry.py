"""The name registry and the registration checks built on it."""

from __future__ import annotations

import pytest

from grpo_npu.algo import advantages
from grpo_npu.algo.registry import Registry


def test_registry_lookup_aliases_and_errors():
    registry: Registry[int] = Registry("some.key")
    registry.register("a", "alias")(1)
    registry.add("b", 2)
    assert registry.get("a") == registry.get("alias") == 1
    assert registry.names() == ["a", "alias", "b"] and "b" in registry and "c" not in registry
    with pytest.raises(ValueError, match="some.key: unknown value 'c'; known: a, alias, b"):
        registry.get("c")
    with pytest.raises(ValueError, match="some.key: 'a' is already registered"):
        registry.add("a", 3)
    with pytest.raises(ValueError, match="unknown value"):
        registry.get(["unhashable"])


def test_register_advantage_checks_declared_inputs():
    with pytest.raises(ValueError, match="has no optional input 'values'"):

        @advantages.register_advantage("bad_estimator", uses=("values",))
        def bad(token_level_rewards, response_mask):  # pragma: no cover - never registered
            return token_level_rewards, token_level_rewards

    assert "bad_estimator" not in advantages.ADVANTAGE_ESTIMATORS
    assert advantages.ADVANTAGE_ESTIMATORS.names() == ["gae", "gdpo", "gpg", "grpo", "grpo_passk", "grpo_vectorized", "opo", "optimal_token_baseline", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "rloo_vectorized", "tir_optimal_token_baseline"]
