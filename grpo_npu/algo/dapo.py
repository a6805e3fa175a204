"""DAPO pieces: dynamic-sampling group filter and overlong reward shaping.

Formulas: docs/algorithms.md ("DAPO pieces"). The trainer owns the "keep sampling
until enough groups survive" loop; these are the pure per-batch parts.
"""

from __future__ import annotations

import torch

from grpo_npu.algo.groups import group_all_equal, group_index


def filter_groups(scores: torch.Tensor, group_ids, metric_values=None) -> torch.Tensor:
    """Keep mask (B,) bool: drop prompt groups whose metric has zero population std; keep groups of one.

    scores: (B,) sequence scores or (B, T) token-level scores (summed over T);
    metric_values: (B,) values of algorithm.filter_groups.metric (acc, score, seq_reward, ...);
    when None the sequence score is the metric. "Zero std" is tested exactly (max == min).
    """
    scores = torch.as_tensor(scores)
    if scores.dim() not in (1, 2):
        raise ValueError(f"scores: expected (B,) or (B, T), got shape {tuple(scores.shape)}")
    batch_size = scores.shape[0]
    if metric_values is None:
        metric = scores.sum(-1) if scores.dim() == 2 else scores
    else:
        metric = torch.as_tensor(metric_values, device=scores.device)
    if metric.dim() != 1 or metric.shape[0] != batch_size:
        raise ValueError(f"metric_values: expected shape ({batch_size},), got {tuple(metric.shape)}")
    metric = metric.to(torch.float64)
    if not bool(torch.isfinite(metric).all()):
        raise ValueError("metric_values: expected finite values, got nan or inf")
    index, num_groups = group_index(group_ids, batch_size, device=metric.device)
    size = torch.zeros(num_groups, dtype=torch.int64, device=metric.device).index_add_(0, index, torch.ones_like(index))
    keep_group = (size == 1) | ~group_all_equal(metric, index, num_groups)  # (G,)
    return keep_group[index]


def filter_metric_values(metric: str, token_level_scores: torch.Tensor, reward_extra: list[dict]) -> torch.Tensor:
    """(B,) values of ``algorithm.filter_groups.metric``: acc (the scorer's, else its score) and score from the
    reward manager's per-row details; seq_reward and seq_final_reward sum the (B, T) token-level scores (overlong
    shaping included). verl's seq_final_reward is that sum after KL-in-reward, which grpo_npu applies after filtering,
    so the two coincide here."""
    if metric == "acc":
        return torch.tensor([float(e.get("acc", e["score"])) for e in reward_extra])
    if metric == "score":
        return torch.tensor([float(e["score"]) for e in reward_extra])
    return token_level_scores.sum(-1)


def overlong_penalty(
    response_lengths, *, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """Soft overlong punishment (B,) float32, <= 0: min(-(len - (max_len - buffer_len)) / buffer_len * factor, 0).

    Add it to the sequence reward (reward_model.overlong_buffer.{len, penalty_factor};
    max_response_length is data.max_response_length).
    """
    if buffer_len <= 0:
        raise ValueError(f"reward_model.overlong_buffer.len: expected > 0, got {buffer_len}")
    if buffer_len > max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len: expected <= data.max_response_length ({max_response_length}), got {buffer_len}"
        )
    if penalty_factor < 0:
        raise ValueError(f"reward_model.overlong_buffer.penalty_factor: expected >= 0, got {penalty_factor}")
    lengths = torch.as_tensor(response_lengths).to(torch.float32)
    if lengths.dim() != 1:
        raise ValueError(f"response_lengths: expected shape (B,), got {tuple(lengths.shape)}")
    expected = max_response_length - buffer_len
    exceed = lengths - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
