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
    top_k: int = -1  # -1 (or 0): off
    do_sample: bool = True  # False: greedy, whatever the temperature
    max_new_tokens: int = 512  # = data.max_response_length
    ignore_eos: bool = False
    seed: Optional[int] = None  # base seed; sample j of prompt i is seeded deterministically from it
    return_logprobs: bool = False  # ask the engine for the sampled tokens' log-probs (see GenerationOutput)

    def __post_init__(self) -> None:
        checks = [
            (self.n >= 1, f"n={self.n} must be >= 1"),
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be >= 1"),
            (self.temperature >= 0.0, f"temperature={self.temperature} must be >= 0"),
            (0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must be in (0, 1]"),
            (self.top_k >= -1, f"top_k={self.top_k} must be -1 or 0 (off) or >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingConfig: {message}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def prompt_seed(self, prompt_index: int) -> Optional[int]:
        """Seed of prompt i's first sample; sample j uses ``prompt_seed(i) + j`` (None: unseeded)."""
        return None if self.seed is None else self.seed + prompt_index * self.n


@dataclass
class GenerationOutput:
    """Responses for B prompts x n samples, grouped by prompt."""

    response_ids: torch.Tensor  # (B*n, T) long, right-padded with pad_token_id, T <= max_new_tokens
    response_mask: torch.Tensor  # (B*n, T) long: 1 up to and including eos
    # (B*n, T) float32 log-probs of the sampled tokens under the distribution actually sampled from:
    # log_softmax(logits / temperature) with top-k/top-p-removed tokens at -inf ("processed" log-probs).
    # With top_k/top_p off this is exactly the actor's temperature-scaled log-prob; greedy: temperature 1.
    logprobs: Optional[torch.Tensor] = None
    stop_reason: list[str] = field(default_factory=list)  # "stop" (eos) | "length"
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. rollout/mem_* from the memory ledger
    # ReMax's baseline: one greedy response per prompt (B rows), generated in the same engine wake
    baseline: Optional["GenerationOutput"] = None


class Rollout(abc.ABC):
    """generate / update_weights / sleep / wake_up, as the hybrid worker calls them per step."""

    # update_weights takes floating tensors in any dtype and casts them to its own as it loads them (the caller
    # need not cast first); False: the caller sends the engine's dtype.
    casts_weights: bool = False

    @abc.abstractmethod
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig) -> GenerationOutput:
        """prompt_ids, prompt_mask: (B, P) left-padded. Returns B*n responses grouped by prompt."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names), streamed one tensor/bucket at a time."""

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced log-probs of tokens 1.. of each sequence under the engine's current weights: one
        (L-1,) float32 tensor per sequence, from the raw logits (temperature 1). The weight-sync canary's
        engine side (:mod:`grpo_npu.rollout.sync_check`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score prompts; set "
                                  "actor_rollout_ref.rollout.sync_check.enable=False")

    def sleep(self) -> None:
        """Release device memory between rollouts (a documented no-op where unsupported)."""

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Re-acquire memory: tags 'weights' and/or 'kv_cache' (None: both)."""

    def reset_prefix_cache(self) -> None:
        """Forget KV blocks computed with the previous weights (a no-op for engines without a prefix cache)."""

    def close(self) -> None:
        """Free the engine."""


def check_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    """Raise ValueError unless (B, P) ids and mask match and every row is left-padded and non-empty."""
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(
            f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} must both be (B, P)"
        )
    mask = prompt_mask.bool()
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt rows {empty[:8]} are empty (prompt_mask all 0)")
    # Left padding: once a row's mask turns 1 it stays 1 to the end.
    not_left = (mask.long().diff(dim=1) < 0).any(dim=1).nonzero().flatten().tolist()
    if not_left:
        raise ValueError(f"prompt rows {not_left[:8]} are not left-padded (0s after the first 1 in prompt_mask)")


def unpad_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """(B, P) left-padded ids -> B lists of the real prompt tokens."""
    check_prompts(prompt_ids, prompt_mask)
    lengths = prompt_mask.bool().sum(dim=1).tolist()
    rows = prompt_ids.tolist()
    return [row[len(row) - n :] for row, n in zip(rows, lengths)]


def pack_responses(
    tokens: list[list[int]],
    stop_reason: list[str],
    pad_token_id: int,
    logprobs: Optional[list[list[float]]] = None,
) -> GenerationOutput:
    """Right-pad per-row generated tokens (each ending at its eos, if any) into a GenerationOutput."""
    rows = len(tokens)
    width = max((len(t) for t in tokens), default=0)
    response_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)  # (B*n, T)
    response_mask = torch.zeros((rows, width), dtype=torch.long)  # (B*n, T)
    logp = torch.zeros((rows, width), dtype=torch.float32) if logprobs is not None else None  # (B*n, T)
    for i, row in enumerate(tokens):
        response_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        response_mask[i, : len(row)] = 1
        if logp is not None:
            logp[i, : len(row)] = torch.tensor(logprobs[i], dtype=torch.float32)
    return GenerationOutput(response_ids, response_mask, logp, list(stop_reason))
