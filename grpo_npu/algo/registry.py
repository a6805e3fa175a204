"""A name -> object registry whose lookup error lists the known names.

Algorithms are registered under the names users write in verl-style config keys
(``algorithm.adv_estimator=grpo``, ``actor.policy_loss.loss_mode=gspo``) and looked up once. A
registry built with ``declared`` names (from the torch-free :mod:`grpo_npu.algo.names`, which the
config validates against) accepts only those, so the config and the registry cannot drift apart.
"""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps config names to objects; ``key`` is the config key quoted in error messages."""

    def __init__(self, key: str, declared: Sequence[str] | None = None):
        self.key = key
        self.declared = tuple(declared) if declared is not None else None
        self._entries: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator registering an object under one or more names (aliases such as kl / k1)."""
        if not names:
            raise ValueError(f"{self.key}: register() needs at least one name")

        def decorate(obj: T) -> T:
            for name in names:
                self.add(name, obj)
            return obj

        return decorate

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` under ``name``; a name can be registered once, and must be declared if names are."""
        if self.declared is not None and name not in self.declared:
            raise ValueError(f"{self.key}: {name!r} is not a declared name ({', '.join(self.declared)}); "
                             "declare it in grpo_npu.algo.names first")
        if name in self._entries:
            raise ValueError(f"{self.key}: {name!r} is already registered")
        self._entries[name] = obj

    def get(self, name: str) -> T:
        """The object registered as ``name``; an unknown name is a ValueError listing the known ones."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"{self.key}: unknown value {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
