"""Advantage estimators, registered under verl's ``algorithm.adv_estimator`` names.

Shapes: B responses, T response tokens; ``token_level_rewards``, ``values``, ``response_mask`` and
both outputs are (B, T); ``group_ids`` holds one hashable key per response (the prompt uid).
Every estimator returns ``(advantages, returns)`` in float32 (float64 input stays float64), zero
outside the mask. Rewards at masked-out positions are ignored; a fully masked row still belongs to
its group (with score 0) and gets advantage 0. Formulas: docs/algorithms.md ("Advantage
estimators"). reinforce_plus_plus and gae discount once per valid token, skipping masked-out tokens
inside a response, as verl 0.9.1 does; where verl differs: rloo gives a group of one advantage 0
(verl leaves its raw score).

Calling convention for the trainer: one uniform call for every estimator,

    advantages, returns = compute_advantage(
        cfg.algorithm.adv_estimator,
        token_level_rewards=rewards, response_mask=mask, group_ids=uids, values=values_or_None,
        gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
        norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo, eps=1e-6)

Each registration declares which of the optional inputs its estimator reads (``uses``); the others
are ignored, and a missing required one (``group_ids`` for group estimators, ``values`` for gae) is
a ValueError naming it. Dr.GRPO is ``grpo`` with ``norm_by_std=False``.
"""

from __future__ import annotations

import torch

from grpo_npu.algo.advantage_base import (ADVANTAGE_ESTIMATORS, GRPO_EPS, OPTIONAL_INPUTS, AdvantageEstimator,
                                          broadcast_rows, compute_advantage, estimator_inputs, get_advantage_fn,
                                          register_advantage, reward_to_go, scores_by_group, sequence_scores,
                                          valid_mask)
from grpo_npu.algo.groups import group_index
from grpo_npu.algo.masked import acc_dtype, masked_values, masked_whiten
from grpo_npu.algo.token_baselines import score_norm_proxy  # importing it registers the optimal token baselines

__all__ = ["ADVANTAGE_ESTIMATORS", "GRPO_EPS", "OPTIONAL_INPUTS", "AdvantageEstimator", "compute_advantage",
           "estimator_inputs", "get_advantage_fn", "register_advantage", "score_norm_proxy", "batch_advantages",
           "gdpo_components"]


# ------------------------------------------------------------------------------------------------
# Estimators
# ------------------------------------------------------------------------------------------------
@register_advantage("grpo", uses=("group_ids", "norm_by_std", "eps"))
def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids,
    *,
    eps: float = GRPO_EPS,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (s_i - group mean) / (group std + eps); groups of one use mean 0, std 1."""
    valid, scores, mean, std, count = scores_by_group(token_level_rewards, response_mask, group_ids)
    centred = scores - mean
    if norm_by_std:
        std = torch.where(count > 1, std, torch.ones_like(std))
        centred = centred / (std + eps)
    advantages = broadcast_rows(centred, valid)
    return advantages, advantages


@register_advantage("gdpo", uses=("group_ids", "norm_by_std", "eps", "reward_components", "component_weights"))
def gdpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids,
    reward_components: torch.Tensor,
    *,
    component_weights: tuple[float, ...] | None = None,
    eps: float = GRPO_EPS,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: each reward component k (``reward_components`` (K, B), a row's score on each of
    algorithm.gdpo_reward_keys) normalised within its group as GRPO does, A_k = (r_k - group mean) / (group std +
    eps); their weighted sum (``component_weights``, default 1 each) broadcast over the response and whitened over
    the batch's valid tokens. The token-level rewards themselves are not read; a row without tokens scores 0."""
    valid = valid_mask(token_level_rewards, response_mask)
    if reward_components.dim() != 2 or reward_components.shape[1] != valid.shape[0]:
        raise ValueError(f"reward_components: expected (K, {valid.shape[0]}), got {tuple(reward_components.shape)}")
    weights = component_weights if component_weights is not None else (1.0,) * reward_components.shape[0]
    if len(weights) != reward_components.shape[0]:
        raise ValueError(f"{len(weights)} component weights for {reward_components.shape[0]} reward components")
    has_tokens = valid.any(-1)
    total = torch.zeros(valid.shape[0], dtype=acc_dtype(token_level_rewards), device=valid.device)
    for weight, component in zip(weights, reward_components):
        scores = torch.where(has_tokens, component.to(total.dtype), torch.zeros_like(total))
        _, _, mean, std, count = scores_by_group(token_level_rewards, response_mask, group_ids, scores)
        centred = scores - mean
        if norm_by_std:
            centred = centred / (torch.where(count > 1, std, torch.ones_like(std)) + eps)
        total = total + weight * centred
    advantages = masked_whiten(broadcast_rows(total, valid), valid)
    return advantages, advantages


def batch_advantages(batch, rewards: torch.Tensor, alg) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_advantage` of ``alg.adv_estimator`` (the config's ``algorithm`` section) on a RolloutBatch, with
    ``rewards`` (B, T) as its token-level rewards, over the tokens its losses count (``batch.loss_tokens()``: rollout
    rejection sampling's mask, as verl modifies its response_mask)."""
    return compute_advantage(
        alg.adv_estimator, token_level_rewards=rewards, response_mask=batch.loss_tokens(), group_ids=batch.uid,
        values=batch.values, reward_baselines=batch.reward_baselines,
        reward_components=gdpo_components(batch.reward_extra, alg.gdpo_reward_keys),
        component_weights=alg.gdpo_reward_weights, gamma=alg.gamma, lam=alg.lam, norm_by_std=alg.norm_adv_by_std_in_grpo,
        old_logp=batch.old_logp, sum_pi_squared=batch.sum_pi_squared, rollout_is_weights=batch.rollout_is_weights)


def gdpo_components(reward_extra: list[dict], keys) -> torch.Tensor | None:
    """(K, B) float32: each row's score on each of ``keys`` (algorithm.gdpo_reward_keys) from the reward function's
    results (``RolloutBatch.reward_extra``); None without keys. A key a row lacks is an error naming it."""
    if not keys:
        return None
    for row, extra in enumerate(reward_extra):
        missing = [k for k in keys if k not in extra]
        if missing:
            raise ValueError(f"algorithm.gdpo_reward_keys: row {row}'s reward result has no {', '.join(missing)} "
                             f"(it has: {', '.join(sorted(extra))}); the reward function must return a dict with them")
    return torch.tensor([[float(extra[k]) for extra in reward_extra] for k in keys], dtype=torch.float32)


@register_advantage("rloo", uses=("group_ids",))
def rloo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: s_i minus the mean of the other responses of its group, n/(n-1) (s_i - mu); 0 alone."""
    valid, scores, mean, _, count = scores_by_group(token_level_rewards, response_mask, group_ids)
    leave_one_out = torch.where(count > 1, count / (count - 1).clamp(min=1) * (scores - mean), torch.zeros_like(scores))
    advantages = broadcast_rows(leave_one_out, valid)
    return advantages, advantages


# verl's vectorized implementations of the two above: the same formulas (its grpo_vectorized always divides by the
# std: validation refuses it with norm_adv_by_std_in_grpo=False, which verl would silently ignore)
register_advantage("grpo_vectorized", uses=("group_ids", "norm_by_std", "eps"))(grpo_advantage)
register_advantage("rloo_vectorized", uses=("group_ids",))(rloo_advantage)


@register_advantage("opo", uses=("group_ids",))
def opo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (On-Policy RL with Optimal reward baseline): s_i minus the length-weighted mean score of its group,
    sum_j |y_j| s_j / sum_j |y_j|; a group of one keeps its score (baseline 0), as does a group with no tokens."""
    valid = valid_mask(token_level_rewards, response_mask)
    scores = sequence_scores(token_level_rewards, valid)  # (B,)
    lengths = valid.sum(-1).to(scores.dtype)
    index, num_groups = group_index(group_ids, scores.shape[0], device=scores.device)
    weighted = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, lengths * scores)
    total = torch.zeros_like(weighted).index_add_(0, index, lengths)
    count = torch.bincount(index, minlength=num_groups)
    baseline = torch.where((count > 1) & (total > 0), weighted / total.clamp(min=1), torch.zeros_like(weighted))
    advantages = broadcast_rows(scores - baseline[index], valid)
    return advantages, advantages


@register_advantage("grpo_passk", uses=("group_ids", "norm_by_std", "eps"))
def grpo_passk_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids, *, eps: float = GRPO_EPS,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (arXiv:2503.19595): only each group's best response gets an advantage, its score minus the
    group's second best (divided by the group's std + eps with norm_by_std); every other response gets 0. A
    group of one is an error (the trainer's groups have rollout.n >= 2 members; validation says so)."""
    valid, scores, _, std, count = scores_by_group(token_level_rewards, response_mask, group_ids)
    if bool((count < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per group (actor_rollout_ref.rollout.n >= 2)")
    index, num_groups = group_index(group_ids, scores.shape[0], device=scores.device)
    per_row = torch.zeros_like(scores)
    for g in range(num_groups):  # one small top-2 per group, as verl does
        members = torch.nonzero(index == g).flatten()
        top = torch.topk(scores[members], 2)
        gap = top.values[0] - top.values[1]
        per_row[members[top.indices[0]]] = gap / (std[members[0]] + eps) if norm_by_std else gap
    advantages = broadcast_rows(per_row, valid)
    return advantages, advantages


@register_advantage("gpg", uses=("group_ids",))
def gpg_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: alpha * (s_i - group mean), no std; alpha = B / (responses with a non-zero score, at least 1), which
    scales the batch up as fewer responses score; groups of one use mean 0."""
    valid, scores, mean, _, _ = scores_by_group(token_level_rewards, response_mask, group_ids)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    advantages = broadcast_rows(alpha * (scores - mean), valid)
    return advantages, advantages


@register_advantage("remax", uses=("reward_baselines",))
def remax_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns = reverse cumsum of the rewards over the valid tokens (no discount); advantages = returns minus
    the prompt's baseline, the score of its greedy response (``reward_baselines`` (B,))."""
    valid = valid_mask(token_level_rewards, response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"reward_baselines: expected ({token_level_rewards.shape[0]},), got {tuple(reward_baselines.shape)}")
    returns = masked_values(reward_to_go(token_level_rewards, valid), valid)
    advantages = returns - broadcast_rows(reward_baselines.to(returns.dtype), valid)
    return advantages, returns


@register_advantage("reinforce_plus_plus", uses=("gamma",))
def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: returns = discounted reverse cumsum of rewards over the valid tokens; advantages = whitened returns.

    The discount applies once per valid token: masked-out tokens inside a response are skipped, as in gae.
    """
    valid = valid_mask(token_level_rewards, response_mask)
    rewards = masked_values(token_level_rewards, valid)  # (B, T)
    if gamma == 1.0:
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = torch.empty_like(rewards)
        running = torch.zeros_like(rewards[:, 0])  # (B,)
        for t in range(rewards.shape[1] - 1, -1, -1):  # a scan over time steps, vectorised over B
            running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
            returns[:, t] = running
    returns = torch.where(valid, returns, torch.zeros((), dtype=returns.dtype, device=returns.device))
    return masked_whiten(returns, valid), returns


@register_advantage("reinforce_plus_plus_baseline", uses=("group_ids",))
def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: s_i - group mean, broadcast, whitened over the batch."""
    valid, scores, mean, _, _ = scores_by_group(token_level_rewards, response_mask, group_ids)
    advantages = masked_whiten(broadcast_rows(scores - mean, valid), valid)
    return advantages, advantages


@register_advantage("gae", uses=("values", "gamma", "lam"))
def gae_advantage(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the valid tokens (masked-out tokens are skipped); returns = A + V; A whitened.

    The value after the last valid token is 0. A masked-out token between two valid ones (a tool
    output in a multi-turn response) is skipped: the next valid token's value and advantage carry over it.
    """
    valid = valid_mask(token_level_rewards, response_mask)
    if values.shape != token_level_rewards.shape:
        raise ValueError(f"values: expected shape {tuple(token_level_rewards.shape)}, got {tuple(values.shape)}")
    dtype = acc_dtype(token_level_rewards)
    rewards = masked_values(token_level_rewards, valid)  # (B, T)
    values = torch.where(valid, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # (B,)
    next_adv = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in range(rewards.shape[1] - 1, -1, -1):  # a scan over time steps, vectorised over B
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        advantages[:, t] = adv_t
    advantages = torch.where(valid, advantages, torch.zeros((), dtype=dtype, device=advantages.device))
    returns = advantages + values
    return masked_whiten(advantages, valid), returns
