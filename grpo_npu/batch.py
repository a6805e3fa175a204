"""RolloutBatch: the typed batch that flows through a training step.

Shapes: B responses, P prompt tokens (left-padded), T response tokens (right-padded).
Optional tensors are filled in as the step proceeds (old log-probs, reference log-probs, values,
rewards, advantages). Which ones are filled is the config's decision (``grpo_npu.config.Derived``), and
a consumer that needs one refuses a batch without it. Two presences do steer the code: the actor's
update reads a missing ``old_logp`` as "old log-probs from the update" (allowed only when the config
derives ``old_logp_from_update``), and ``rollout_logp`` exists only when the engine returns log-probs,
which is what turns on the ``rollout/logp_diff_*`` metrics and the rollout correction. ``loss_mask``
(rollout rejection sampling) narrows the tokens the losses see without touching the model's inputs,
which ``response_mask`` drives.
Per-row metadata (uid, data_source, ground truth, extra info) travels in plain lists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

TENSOR_FIELDS = (
    "prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logp", "old_logp", "ref_logp",
    "values", "token_level_scores", "token_level_rewards", "advantages", "returns", "rollout_is_weights", "loss_mask",
    "reward_baselines", "sum_pi_squared",
)
LIST_FIELDS = ("uid", "data_source", "ground_truth", "extra_info", "stop_reason", "reward_extra")


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # (B, P) long, left-padded
    prompt_mask: torch.Tensor  # (B, P) long, 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) long, right-padded with the pad id
    response_mask: torch.Tensor  # (B, T) long, 1 on generated tokens up to and including eos
    uid: list[str] = field(default_factory=list)  # group key: responses to the same prompt share it
    data_source: list[str] = field(default_factory=list)
    ground_truth: list[Any] = field(default_factory=list)
    extra_info: list[dict] = field(default_factory=list)
    stop_reason: list[str] = field(default_factory=list)  # "stop" (eos) | "length"
    reward_extra: list[dict] = field(default_factory=list)  # per-row reward details (acc, pred, ...)
    rollout_logp: Optional[torch.Tensor] = None  # (B, T) engine log-probs, when the engine returns them
    old_logp: Optional[torch.Tensor] = None  # (B, T) actor log-probs before the update
    ref_logp: Optional[torch.Tensor] = None  # (B, T) reference-policy log-probs
    values: Optional[torch.Tensor] = None  # (B, T) critic values
    token_level_scores: Optional[torch.Tensor] = None  # (B, T) raw rule scores (on the last token)
    token_level_rewards: Optional[torch.Tensor] = None  # (B, T) scores minus KL-in-reward, if on
    advantages: Optional[torch.Tensor] = None  # (B, T)
    returns: Optional[torch.Tensor] = None  # (B, T)
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, T) rollout-correction IS weights (algorithm.rollout_correction)
    loss_mask: Optional[torch.Tensor] = None  # (B, T) response_mask minus rollout-rejected tokens (None: response_mask)
    reward_baselines: Optional[torch.Tensor] = None  # (B,) ReMax: the score of the prompt's greedy response
    sum_pi_squared: Optional[torch.Tensor] = None  # (B, T) sum_v pi_old(v)^2 per response token (actor.calculate_sum_pi_squared)

    def __post_init__(self) -> None:
        b = self.prompt_ids.shape[0]
        for name in TENSOR_FIELDS:
            t = getattr(self, name)
            if t is not None and t.shape[0] != b:
                raise ValueError(f"RolloutBatch.{name} has {t.shape[0]} rows, prompt_ids has {b}")
        for name in LIST_FIELDS:
            values = getattr(self, name)
            if values and len(values) != b:
                raise ValueError(f"RolloutBatch.{name} has {len(values)} rows, prompt_ids has {b}")

    # -- views the model needs ------------------------------------------------------------------
    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:  # (B, P + T)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P + T)
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:  # (B, P + T): 0 at the first real token, clamped at 0 on left pads
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    @property
    def response_lengths(self) -> torch.Tensor:  # (B,)
        return self.response_mask.sum(dim=1)

    def loss_tokens(self) -> torch.Tensor:  # (B, T)
        """The tokens the losses see: ``loss_mask`` when rollout rejection sampling set one, else response_mask."""
        return self.loss_mask if self.loss_mask is not None else self.response_mask

    @property
    def prompt_lengths(self) -> torch.Tensor:  # (B,)
        return self.prompt_mask.sum(dim=1)

    # -- row operations -------------------------------------------------------------------------
    def select(self, index: Sequence[int] | torch.Tensor) -> "RolloutBatch":
        """Rows ``index`` (a list of ints, a long tensor, or a bool mask), in that order."""
        idx = torch.as_tensor(index)
        if idx.dtype == torch.bool:
            idx = idx.nonzero(as_tuple=True)[0]
        idx_list = idx.tolist()
        changes: dict[str, Any] = {}
        for name in TENSOR_FIELDS:
            t = getattr(self, name)
            changes[name] = None if t is None else t[idx]
        for name in LIST_FIELDS:
            values = getattr(self, name)
            changes[name] = [values[i] for i in idx_list] if values else []
        return RolloutBatch(**changes)

    def split(self, size: int) -> list["RolloutBatch"]:
        """Consecutive chunks of ``size`` rows (the last may be smaller)."""
        return [self.select(list(range(i, min(i + size, len(self))))) for i in range(0, len(self), size)]

    def chunk(self, parts: int) -> list["RolloutBatch"]:
        """``parts`` equal consecutive chunks (for ranks); the row count must divide evenly."""
        if len(self) % parts:
            raise ValueError(f"cannot split {len(self)} rows into {parts} equal parts")
        return self.split(len(self) // parts)

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Stack batches row-wise; prompt and response widths are padded to the widest."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        # Zero-row batches (e.g. a DAPO round whose groups were all filtered) carry empty metadata
        # lists; they add nothing and must not make the others' metadata look absent.
        batches = [b for b in batches if len(b)] or list(batches[:1])
        p_width = max(b.prompt_ids.shape[1] for b in batches)
        t_width = max(b.response_ids.shape[1] for b in batches)
        changes: dict[str, Any] = {}
        for name in TENSOR_FIELDS:
            parts = [getattr(b, name) for b in batches]
            if all(p is None for p in parts):
                changes[name] = None
                continue
            if any(p is None for p in parts):
                raise ValueError(f"RolloutBatch.concat: {name} is set in some batches but not others")
            if name in ("prompt_ids", "prompt_mask"):
                parts = [_pad_left(p, p_width, 0) for p in parts]
            elif parts[0].dim() > 1:  # (B, T); a (B,) field has no width
                parts = [pad_right(p, t_width, 0) for p in parts]
            changes[name] = torch.cat(parts, dim=0)
        for name in LIST_FIELDS:
            lists = [getattr(b, name) for b in batches]
            changes[name] = [v for lst in lists for v in lst] if all(lists) else []
        return RolloutBatch(**changes)

    def replace(self, **changes: Any) -> "RolloutBatch":
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        changes = {n: getattr(self, n).to(device) for n in TENSOR_FIELDS if getattr(self, n) is not None}
        return dataclasses.replace(self, **changes)

    def num_tokens(self) -> int:
        """Prompt + response tokens (for throughput)."""
        return int(self.prompt_mask.sum() + self.response_mask.sum())


def _pad_left(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1]) + tuple(t.shape[2:]), value)
    return torch.cat([pad, t], dim=1)


def pad_right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """(B, w) -> (B, width): ``value`` appended on the right of each row."""
    if t.shape[1] == width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1]) + tuple(t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def balance_order(lengths: list[int], parts: int) -> list[int]:
    """A row order whose ``parts`` equal consecutive chunks have similar token totals (greedy LPT)."""
    size = len(lengths) // parts
    bins: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        open_bins = [b for b in range(parts) if len(bins[b]) < size]
        b = min(open_bins, key=lambda b: totals[b])
        bins[b].append(i)
        totals[b] += lengths[i]
    return [i for b in bins for i in sorted(b)]


def cat_right_padded(parts: list[torch.Tensor], value) -> torch.Tensor:
    """Concatenate (b_i, t_i) tensors along rows, right-padding each to the widest t_i with ``value``."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([pad_right(p, width, value) for p in parts], dim=0)
