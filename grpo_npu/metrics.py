"""Step metrics under the names verl users already chart (definitions: docs/algorithms.md, "Metrics").

Pure functions: a filled :class:`~grpo_npu.batch.RolloutBatch` (rewards and advantages computed)
or plain numbers in, a flat ``{name: float}`` dict out. Shapes: B responses, T response tokens.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import torch

from grpo_npu.algo.advantages import score_norm_proxy
from grpo_npu.algo.masked import masked_mean, masked_sum
from grpo_npu.batch import RolloutBatch

# Sections whose per-token time is measured against generated tokens only: generation cost grows
# with what is generated, every other phase with the whole sequence (prompt + response).
RESPONSE_TOKEN_SECTIONS = ("gen",)


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """{prefix}/mean, /max, /min of a 1-D tensor (float64 so the mean of many tokens stays exact)."""
    if values.numel() == 0:
        raise ValueError(f"{prefix}: no values to summarise (empty batch or no valid response tokens)")
    v = values.detach().to(torch.float64)
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


def _require(batch: RolloutBatch, name: str) -> torch.Tensor:
    t = getattr(batch, name)
    if t is None:
        raise ValueError(f"compute_data_metrics: RolloutBatch.{name} is not filled in yet "
                         "(call it after rewards, advantages and returns are computed)")
    return t


def compute_data_metrics(
    batch: RolloutBatch,
    *,
    use_critic: bool,
    max_response_length: int,
    max_prompt_length: int | None = None,
    reward_component_keys: Sequence[str] = (),
) -> dict[str, float]:
    """Score, reward, advantage, return (and value) statistics plus prompt/response lengths; for each of
    ``reward_component_keys`` (GDPO's algorithm.gdpo_reward_keys) verl's ``gdpo/<key>/mean|std|max|min`` of the
    rows' values (population std).

    Sequence score = sum over tokens of token_level_scores, sequence reward = sum of
    token_level_rewards; advantages, returns and values are summarised over valid response tokens.
    clip_ratio = fraction of responses whose length equals ``max_response_length`` (prompts:
    ``max_prompt_length``, default the batch's prompt width, to which prompts are left-padded).
    """
    if max_response_length <= 0:
        raise ValueError(f"max_response_length={max_response_length} must be > 0")
    mask = batch.response_mask.bool()  # (B, T)
    scores = _require(batch, "token_level_scores")  # (B, T)
    rewards = _require(batch, "token_level_rewards")  # (B, T)
    advantages = _require(batch, "advantages")  # (B, T)
    returns = _require(batch, "returns")  # (B, T)

    metrics: dict[str, float] = {}
    metrics |= _stats("critic/score", scores.sum(dim=-1))
    metrics |= _stats("critic/rewards", rewards.sum(dim=-1))
    metrics |= _stats("critic/advantages", advantages[mask])
    metrics |= _stats("critic/returns", returns[mask])
    if use_critic:
        values = _require(batch, "values")  # (B, T)
        valid_values, valid_returns = values[mask].double(), returns[mask].double()
        metrics |= _stats("critic/values", valid_values)
        # Fraction of the return variance the critic explains (1: perfect, <= 0: no better than a constant).
        return_var = valid_returns.var(unbiased=False)
        residual_var = (valid_returns - valid_values).var(unbiased=False)
        metrics["critic/vf_explained_var"] = (1.0 - residual_var / (return_var + 1e-5)).item()

    response_length = batch.response_lengths.double()  # (B,)
    prompt_length = batch.prompt_lengths.double()  # (B,)
    prompt_limit = batch.prompt_ids.shape[1] if max_prompt_length is None else max_prompt_length
    metrics |= _stats("response_length", response_length)
    metrics["response_length/clip_ratio"] = (response_length == max_response_length).double().mean().item()
    metrics |= _stats("prompt_length", prompt_length)
    metrics["prompt_length/clip_ratio"] = (prompt_length == prompt_limit).double().mean().item()
    for key in reward_component_keys:
        values = torch.tensor([float(extra[key]) for extra in batch.reward_extra], dtype=torch.float64)
        metrics |= {**_stats(f"gdpo/{key}", values), f"gdpo/{key}/std": values.std(unbiased=False).item()}
    return metrics


def compute_timing_metrics(
    timings: Mapping[str, float], num_tokens: int, *, num_response_tokens: int | None = None
) -> dict[str, float]:
    """timing_s/<section> and timing_per_token_ms/<section> for each timed section of a step.

    Per-token time divides by ``num_tokens`` (prompt + response tokens of the step), except for the
    sections in RESPONSE_TOKEN_SECTIONS ("gen"), which divide by ``num_response_tokens`` when given.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens={num_tokens} must be > 0")
    if num_response_tokens is not None and num_response_tokens <= 0:
        raise ValueError(f"num_response_tokens={num_response_tokens} must be > 0")
    metrics: dict[str, float] = {}
    for name, seconds in timings.items():
        seconds = float(seconds)
        if seconds < 0 or not math.isfinite(seconds):
            raise ValueError(f"timing {name!r} = {seconds} s must be a finite non-negative number")
        metrics[f"timing_s/{name}"] = seconds
        tokens = num_response_tokens if name in RESPONSE_TOKEN_SECTIONS and num_response_tokens else num_tokens
        metrics[f"timing_per_token_ms/{name}"] = seconds * 1000.0 / tokens
    return metrics


def compute_throughput_metrics(num_tokens: int, step_seconds: float, n_devices: int) -> dict[str, float]:
    """perf/total_num_tokens, perf/time_per_step and perf/throughput = tokens / (seconds x devices)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    if not step_seconds > 0:
        raise ValueError(f"step_seconds={step_seconds} must be > 0")
    if n_devices < 1:
        raise ValueError(f"n_devices={n_devices} must be >= 1")
    return {
        "perf/total_num_tokens": float(num_tokens),
        "perf/time_per_step": float(step_seconds),
        "perf/throughput": num_tokens / (step_seconds * n_devices),
    }


def variance_proxy_metrics(batch: RolloutBatch, grad_norm: float | None) -> dict[str, float]:
    """verl's ``variance_proxy/*`` (compute_variance_proxy_metrics), for a batch with ``sum_pi_squared``.

    Per response: the mean advantage a and W = sum_t w_t over the tokens the losses count, with w_t the
    score-norm proxy 1 - 2 pi_t + sum pi^2 (times the rollout IS weight squared, when rollout correction gives
    weights). proxy2 = E[a^2 max(W, 0)] (with IS weights: E[rho^2 a^2 max(W_raw, 0)], rho the row's mean weight and
    W_raw the sum without them); proxy1 = grad_norm^2 (``actor/grad_norm``; 0 without an update);
    proxy3 = max(0, (proxy2 - proxy1) / (B - 1)); expected_a_squared = E[a^2]; expected_w = E[W].
    """
    mask = batch.loss_tokens()  # (B, T)
    old_logp, sum_sq, adv = (_require(batch, n).double() for n in ("old_logp", "sum_pi_squared", "advantages"))
    w = score_norm_proxy(old_logp, sum_sq)  # (B, T)
    is_w = batch.rollout_is_weights.double() if batch.rollout_is_weights is not None else None
    if is_w is not None:
        w = w * is_w.square()
    a = masked_mean(adv, mask, dim=-1)  # (B,)
    w_rows = masked_sum(w, mask, dim=-1)  # (B,)
    if is_w is not None:
        raw = masked_sum(w / is_w.square().clamp(min=1e-10), mask, dim=-1).clamp(min=0.0)
        proxy2 = (masked_mean(is_w, mask, dim=-1).square() * a.square() * raw).mean().item()
    else:
        proxy2 = (a.square() * w_rows.clamp(min=0.0)).mean().item()
    proxy1 = grad_norm ** 2 if grad_norm is not None else None
    rows = a.shape[0]
    proxy3 = max(0.0, (proxy2 - proxy1) / (rows - 1)) if proxy1 is not None and rows > 1 else 0.0
    return {
        "variance_proxy/proxy1_signal_strength": proxy1 if proxy1 is not None else 0.0,
        "variance_proxy/proxy2_total_power": proxy2,
        "variance_proxy/proxy3_pure_noise": proxy3,
        "variance_proxy/expected_a_squared": a.square().mean().item(),
        "variance_proxy/expected_w": w_rows.mean().item(),
    }


def scalar_value(key: str, value: Any) -> float:
    """A metric value (number, one-element tensor, numpy scalar) as a float; errors name the key."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {tuple(value.shape)}, expected one value")
        return value.item()
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item"):  # numpy scalars
        return float(value.item())
    raise TypeError(f"metric {key!r} has type {type(value).__name__}, expected a number")


def reduce_metrics(metrics: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean per key over a list of metric dicts (a key absent from some dicts averages where present)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for m in metrics:
        for key, value in m.items():
            sums[key] = sums.get(key, 0.0) + scalar_value(key, value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
