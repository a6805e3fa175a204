"""The advantage estimators' registry and the pieces they share.

:func:`register_advantage` files an estimator under its ``algorithm.adv_estimator`` name with the optional inputs
it reads; :func:`compute_advantage` runs one from the trainer's single keyword set. The helpers turn token-level
rewards into sequence scores and group statistics. The estimators themselves are in :mod:`grpo_npu.algo.advantages` (and
:mod:`grpo_npu.algo.token_baselines`, which it imports); their conventions are in that module's docstring.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from grpo_npu.algo.groups import group_index, group_stats
from grpo_npu.algo.masked import masked_values
from grpo_npu.algo.names import ADV_ESTIMATORS
from grpo_npu.algo.registry import Registry

# Added to the group std in GRPO so that a group whose rewards are all equal gets advantage 0.
GRPO_EPS = 1e-6

# The optional inputs compute_advantage can hand to an estimator.
OPTIONAL_INPUTS = ("group_ids", "values", "reward_baselines", "reward_components", "component_weights", "gamma", "lam",
                   "norm_by_std", "eps", "old_logp", "sum_pi_squared", "rollout_is_weights")
_REQUIRED_WHEN_USED = ("group_ids", "values", "reward_baselines", "reward_components", "old_logp", "sum_pi_squared")


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
def valid_mask(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The response mask as bool (B, T), converted once per call (it is often int64)."""
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards and response_mask: expected equal (B, T) shapes, got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    return response_mask.bool()


def reward_to_go(token_level_rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) the undiscounted sum of the rewards at valid tokens from t on (rewards off the mask ignored)."""
    return masked_values(token_level_rewards, valid).flip(-1).cumsum(-1).flip(-1)


def sequence_scores(token_level_rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """s_i = sum_t of the rewards on valid tokens, (B,)."""
    return masked_values(token_level_rewards, valid).sum(-1)


def broadcast_rows(per_seq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T), zero off the mask."""
    return torch.where(valid, per_seq.unsqueeze(-1), torch.zeros((), dtype=per_seq.dtype, device=per_seq.device))


class GroupScores(NamedTuple):
    """A batch's sequence scores beside their group's statistics, each (B,); ``valid`` (B, T) bool."""

    valid: torch.Tensor
    scores: torch.Tensor
    mean: torch.Tensor  # the group's mean score; 0 for groups of one
    std: torch.Tensor
    count: torch.Tensor


def scores_by_group(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids,
                    scores: torch.Tensor | None = None) -> GroupScores:
    """Sequence scores s_i (the rewards' sums, or ``scores`` (B,) as given) and their group's (mean, std, size)
    gathered to (B,); mean 0 for groups of one."""
    valid = valid_mask(token_level_rewards, response_mask)
    scores = sequence_scores(token_level_rewards, valid) if scores is None else scores  # (B,)
    index, num_groups = group_index(group_ids, scores.shape[0], device=scores.device)
    stats = group_stats(scores, index, num_groups)
    count = stats.count[index]
    mean = torch.where(count > 1, stats.mean[index], torch.zeros_like(scores))
    return GroupScores(valid, scores, mean, stats.std[index], count)
