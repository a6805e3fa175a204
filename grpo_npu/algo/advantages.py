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

import inspect
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from grpo_npu.algo.groups import group_index, group_stats
from grpo_npu.algo.masked import acc_dtype, masked_values, masked_whiten
from grpo_npu.algo.names import ADV_ESTIMATORS
from grpo_npu.algo.registry import Registry

# Added to the group std in GRPO so that a group whose rewards are all equal gets advantage 0.
GRPO_EPS = 1e-6

# The optional inputs compute_advantage can hand to an estimator.
OPTIONAL_INPUTS = ("group_ids", "values", "reward_baselines", "reward_components", "component_weights", "gamma", "lam",
                   "norm_by_std", "eps", "old_logp", "sum_pi_squared", "rollout_is_weights")
_REQUIRED_WHEN_USED = ("group_ids", "values", "reward_baselines", "reward_components", "old_logp", "sum_pi_squared")
# The optimal token baseline's epsilon in the denominator of B_t = sum(G W) / (sum W + eps), as verl's.
OTB_EPS = 1e-8


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator and the optional inputs (of OPTIONAL_INPUTS) it reads."""

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    uses: tuple[str, ...]


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("algorithm.adv_estimator", ADV_ESTIMATORS)


def register_advantage(name: str, *, uses: tuple[str, ...] = ()):
    """Decorator registering an estimator under ``name``, reading the optional inputs in ``uses``."""

    def decorate(fn):
        params = inspect.signature(fn).parameters
        for key in uses:
            if key not in OPTIONAL_INPUTS or key not in params:
                raise ValueError(f"register_advantage({name!r}): {fn.__name__} has no optional input {key!r}")
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(fn=fn, uses=tuple(uses)))
        return fn

    return decorate


def estimator_inputs(name: str) -> tuple[str, ...]:
    """The optional inputs (of OPTIONAL_INPUTS) estimator ``name`` reads."""
    return ADVANTAGE_ESTIMATORS.get(name).uses


def get_advantage_fn(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The estimator function registered as ``name`` (its own signature; see compute_advantage)."""
    return ADVANTAGE_ESTIMATORS.get(name).fn


def compute_advantage(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids=None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    component_weights: tuple[float, ...] | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = GRPO_EPS,
    old_logp: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator ``name`` with the inputs it uses out of one common keyword set."""
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    given = {"group_ids": group_ids, "values": values, "reward_baselines": reward_baselines,
             "reward_components": reward_components, "component_weights": component_weights, "gamma": gamma,
             "lam": lam, "norm_by_std": norm_by_std, "eps": eps, "old_logp": old_logp,
             "sum_pi_squared": sum_pi_squared, "rollout_is_weights": rollout_is_weights}
    for key in _REQUIRED_WHEN_USED:
        if key in estimator.uses and given[key] is None:
            raise ValueError(f"algorithm.adv_estimator={name} needs {key}, got None")
    kwargs = {key: given[key] for key in estimator.uses}
    return estimator.fn(token_level_rewards=token_level_rewards, response_mask=response_mask, **kwargs)


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _valid_mask(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The response mask as bool (B, T), converted once per call (it is often int64)."""
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards and response_mask: expected equal (B, T) shapes, got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    return response_mask.bool()


def _reward_to_go(token_level_rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) the undiscounted sum of the rewards at valid tokens from t on (rewards off the mask ignored)."""
    return masked_values(token_level_rewards, valid).flip(-1).cumsum(-1).flip(-1)


def _sequence_scores(token_level_rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """s_i = sum_t of the rewards on valid tokens, (B,)."""
    return masked_values(token_level_rewards, valid).sum(-1)


def _broadcast(per_seq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T), zero off the mask."""
    return torch.where(valid, per_seq.unsqueeze(-1), torch.zeros((), dtype=per_seq.dtype, device=per_seq.device))


class _GroupScores(NamedTuple):
    """A batch's sequence scores beside their group's statistics, each (B,); ``valid`` (B, T) bool."""

    valid: torch.Tensor
    scores: torch.Tensor
    mean: torch.Tensor  # the group's mean score; 0 for groups of one
    std: torch.Tensor
    count: torch.Tensor


def _group_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids,
                  scores: torch.Tensor | None = None) -> _GroupScores:
    """Sequence scores s_i (the rewards' sums, or ``scores`` (B,) as given) and their group's (mean, std, size)
    gathered to (B,); mean 0 for groups of one."""
    valid = _valid_mask(token_level_rewards, response_mask)
    scores = _sequence_scores(token_level_rewards, valid) if scores is None else scores  # (B,)
    index, num_groups = group_index(group_ids, scores.shape[0], device=scores.device)
    stats = group_stats(scores, index, num_groups)
    count = stats.count[index]
    mean = torch.where(count > 1, stats.mean[index], torch.zeros_like(scores))
    return _GroupScores(valid, scores, mean, stats.std[index], count)


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
    valid, scores, mean, std, count = _group_scores(token_level_rewards, response_mask, group_ids)
    centred = scores - mean
    if norm_by_std:
        std = torch.where(count > 1, std, torch.ones_like(std))
        centred = centred / (std + eps)
    advantages = _broadcast(centred, valid)
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
    valid = _valid_mask(token_level_rewards, response_mask)
    if reward_components.dim() != 2 or reward_components.shape[1] != valid.shape[0]:
        raise ValueError(f"reward_components: expected (K, {valid.shape[0]}), got {tuple(reward_components.shape)}")
    weights = component_weights if component_weights is not None else (1.0,) * reward_components.shape[0]
    if len(weights) != reward_components.shape[0]:
        raise ValueError(f"{len(weights)} component weights for {reward_components.shape[0]} reward components")
    has_tokens = valid.any(-1)
    total = torch.zeros(valid.shape[0], dtype=acc_dtype(token_level_rewards), device=valid.device)
    for weight, component in zip(weights, reward_components):
        scores = torch.where(has_tokens, component.to(total.dtype), torch.zeros_like(total))
        _, _, mean, std, count = _group_scores(token_level_rewards, response_mask, group_ids, scores)
        centred = scores - mean
        if norm_by_std:
            centred = centred / (torch.where(count > 1, std, torch.ones_like(std)) + eps)
        total = total + weight * centred
    advantages = masked_whiten(_broadcast(total, valid), valid)
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
    valid = _valid_mask(token_level_rewards, response_mask)
    for name, t in (("old_logp", old_logp), ("sum_pi_squared", sum_pi_squared), ("rollout_is_weights", rollout_is_weights)):
        if t is not None and t.shape != valid.shape:
            raise ValueError(f"optimal_token_baseline: {name} {tuple(t.shape)}, expected {tuple(valid.shape)}")
    returns = _reward_to_go(token_level_rewards, valid)  # (B, T) G_t
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
    valid = _valid_mask(token_level_rewards, response_mask)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)  # each row's valid positions first

    def front(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.gather(-1, order)

    packed, _ = optimal_token_baseline_advantage(front(token_level_rewards * valid), front(valid), group_ids,
                                                 front(old_logp), front(sum_pi_squared), front(rollout_is_weights))
    returns = _reward_to_go(token_level_rewards, valid)
    return torch.zeros_like(packed).scatter_(-1, order, packed) * valid, returns


@register_advantage("rloo", uses=("group_ids",))
def rloo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: s_i minus the mean of the other responses of its group, n/(n-1) (s_i - mu); 0 alone."""
    valid, scores, mean, _, count = _group_scores(token_level_rewards, response_mask, group_ids)
    leave_one_out = torch.where(count > 1, count / (count - 1).clamp(min=1) * (scores - mean), torch.zeros_like(scores))
    advantages = _broadcast(leave_one_out, valid)
    return advantages, advantages


@register_advantage("gpg", uses=("group_ids",))
def gpg_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: alpha * (s_i - group mean), no std; alpha = B / (responses with a non-zero score, at least 1), which
    scales the batch up as fewer responses score; groups of one use mean 0."""
    valid, scores, mean, _, _ = _group_scores(token_level_rewards, response_mask, group_ids)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    advantages = _broadcast(alpha * (scores - mean), valid)
    return advantages, advantages


@register_advantage("remax", uses=("reward_baselines",))
def remax_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns = reverse cumsum of the rewards over the valid tokens (no discount); advantages = returns minus
    the prompt's baseline, the score of its greedy response (``reward_baselines`` (B,))."""
    valid = _valid_mask(token_level_rewards, response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"reward_baselines: expected ({token_level_rewards.shape[0]},), got {tuple(reward_baselines.shape)}")
    returns = masked_values(_reward_to_go(token_level_rewards, valid), valid)
    advantages = returns - _broadcast(reward_baselines.to(returns.dtype), valid)
    return advantages, returns


@register_advantage("reinforce_plus_plus", uses=("gamma",))
def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: returns = discounted reverse cumsum of rewards over the valid tokens; advantages = whitened returns.

    The discount applies once per valid token: masked-out tokens inside a response are skipped, as in gae.
    """
    valid = _valid_mask(token_level_rewards, response_mask)
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
    valid, scores, mean, _, _ = _group_scores(token_level_rewards, response_mask, group_ids)
    advantages = masked_whiten(_broadcast(scores - mean, valid), valid)
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
    valid = _valid_mask(token_level_rewards, response_mask)
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
