"""The one rollout interface every engine implements (vLLM family, transformers).

A rollout lives inside a worker, next to the actor it serves (the hybrid engine): the worker hands
it left-padded prompt ids, gets back right-padded responses, streams new weights into it after each
actor update, and puts it to sleep while training runs.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """Per-call sampling settings (training rollouts and validation use different ones)."""

    n: int = 1  # responses per prompt; outputs are grouped: prompt i -> rows i*n .. i*n+n-1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    do_sample: bool = True  # False: greedy, whatever the temperature
    max_new_tokens: int = 512  # = data.max_response_length
    ignore_eos: bool = False
    seed: Optional[int] = None  # base seed; sample j of prompt i is seeded deterministically from it
    return_logprobs: bool = False  # ask the engine for the sampled tokens' log-probs

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


@dataclass
class GenerationOutput:
    """Responses for B prompts x n samples, grouped by prompt."""

    response_ids: torch.Tensor  # (B*n, T) long, right-padded with pad_token_id, T <= max_new_tokens
    response_mask: torch.Tensor  # (B*n, T) long: 1 up to and including eos
    logprobs: Optional[torch.Tensor] = None  # (B*n, T) float32 engine log-probs of the sampled tokens
    stop_reason: list[str] = field(default_factory=list)  # "stop" (eos) | "length"
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. rollout/mem_* from the memory ledger


class Rollout(abc.ABC):
    """generate / update_weights / sleep / wake_up, as the hybrid worker calls them per step."""

    @abc.abstractmethod
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig) -> GenerationOutput:
        """prompt_ids, prompt_mask: (B, P) left-padded. Returns B*n responses grouped by prompt."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names), streamed one tensor/bucket at a time."""

    def sleep(self) -> None:
        """Release device memory between rollouts (a documented no-op where unsupported)."""

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Re-acquire memory: tags 'weights' and/or 'kv_cache' (None: both)."""

    def close(self) -> None:
        """Free the engine."""
