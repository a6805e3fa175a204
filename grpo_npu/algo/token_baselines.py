"""The optimal token baseline estimators (verl 0.9.1's ``optimal_token_baseline`` and its multi-turn
``tir_optimal_token_baseline``): one baseline per token position and prompt group, each response's return weighted
by its path's score-function norm. Formulas: docs/algorithms.md; conventions: :mod:`grpo_npu.algo.advantages`."""

from __future__ import annotations

import torch

from grpo_npu.algo.advantage_base import register_advantage, reward_to_go, valid_mask
from grpo_npu.algo.groups import group_index

# The optimal token baseline's epsilon in the denominator of B_t = sum(G W) / (sum W + eps), as verl's.
OTB_EPS = 1e-8


def score_norm_proxy(old_logp: torch.Tensor, sum_pi_squared: torch.Tensor) -> torch.Tensor:
    """(B, T) ||s_t||^2 proxy of each token's score-function norm: 1 - 2 pi_t(y_t) + sum_v pi_t(v)^2."""
    return 1.0 - 2.0 * torch.exp(old_logp) + sum_pi_squared


@register_advantage("optimal_token_baseline", uses=("group_ids", "old_logp", "sum_pi_squared", "rollout_is_weights"))
def optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids, old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (verl 0.9.1's compute_optimal_token_baseline_advantage): A_t = G_t - B_t per token.

    G_t is the reward-to-go; W_t = sum_{j<=t} w_j with w_j = 1 - 2 pi_j + sum pi^2 (times the rollout IS weight
    squared, when rollout correction gives weights); each prompt group gets one baseline per position,
    B_t = sum_i G_it W_it / (sum_i W_it + 1e-8) over its members' valid tokens. A group of one has B = 0. The
    positions of a group's single longest response past its second longest get B = 0 (verl's handle_zero_tail).
    Returns (advantages, returns = G), zero outside the mask.
    """
    valid = valid_mask(token_level_rewards, response_mask)
    for name, t in (("old_logp", old_logp), ("sum_pi_squared", sum_pi_squared), ("rollout_is_weights", rollout_is_weights)):
        if t is not None and t.shape != valid.shape:
            raise ValueError(f"optimal_token_baseline: {name} {tuple(t.shape)}, expected {tuple(valid.shape)}")
    returns = reward_to_go(token_level_rewards, valid)  # (B, T) G_t
    dtype = returns.dtype
    m = valid.to(dtype)
    w = score_norm_proxy(old_logp.to(dtype), sum_pi_squared.to(dtype))
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(dtype).square()
    w_cum = (w * m).cumsum(-1)  # (B, T) W_t
    index, num_groups = group_index(group_ids, valid.shape[0], valid.device)
    width = valid.shape[1]
    num = torch.zeros(num_groups, width, dtype=dtype).index_add_(0, index, returns * w_cum * m)
    den = torch.zeros(num_groups, width, dtype=dtype).index_add_(0, index, w_cum * m) + OTB_EPS
    count = torch.bincount(index, minlength=num_groups)
    baselines = torch.where((count > 1)[index, None], (num / den)[index], torch.zeros_like(returns))  # (B, T)
    lengths = valid.sum(-1)  # (B,)
    for g in torch.nonzero(count > 1).flatten().tolist():  # the zero tail: one longest response per group
        members = torch.nonzero(index == g).flatten()
        top2 = torch.topk(lengths[members], 2).values
        longest = members[lengths[members] == top2[0]]
        if longest.numel() == 1 and top2[0] > top2[1]:
            baselines[longest[0], int(top2[1]):] = 0.0
    return (returns - baselines) * m, returns


@register_advantage("tir_optimal_token_baseline", uses=("group_ids", "old_logp", "sum_pi_squared", "rollout_is_weights"))
def tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids, old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl 0.9.1's multi-turn optimal token baseline (compute_multi_turn_optimal_token_baseline_advantage): the
    optimal token baseline over each response's valid tokens moved to the front, so that a group's baseline at
    step k averages its members' k-th valid tokens (in a multi-turn response the masked tool outputs leave
    holes); the advantages go back to their positions. On a mask without holes (a single-turn response) it is
    :func:`optimal_token_baseline_advantage`. Returns (advantages, returns = G), zero outside the mask."""
    valid = valid_mask(token_level_rewards, response_mask)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)  # each row's valid positions first

    def front(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.gather(-1, order)

    packed, _ = optimal_token_baseline_advantage(front(token_level_rewards * valid), front(valid), group_ids,
                                                 front(old_logp), front(sum_pi_squared), front(rollout_is_weights))
    returns = reward_to_go(token_level_rewards, valid)
    return torch.zeros_like(packed).scatter_(-1, order, packed) * valid, returns
