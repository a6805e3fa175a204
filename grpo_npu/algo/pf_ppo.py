"""PF-PPO: policy filtration for PPO (Shan et al., 2024, arXiv:2409.06957; verl's ``algorithm.use_pf_ppo``).

After the advantages, the batch is resampled with replacement to its own size: row i is drawn with
probability proportional to a weight of its sequence score s_i (the summed token-level scores, before any
KL penalty), so the update learns mostly from the responses whose reward is most reliable. The weights,
as verl 0.9.1's ``compute_pf_ppo_reweight_data``:

- ``pow``: |s_i| ** weight_pow;
- ``max_min``: 1 for the rows holding the batch's highest or lowest score, 0 for the others;
- ``max_random``: 0.4 for the rows holding the highest score, 0.1 for the others;

each plus 1e-8 (no row has probability 0 once all weights are 0). verl draws with the process's global
RNG; grpo_npu draws with a generator the trainer seeds per step, so a resumed run draws what the
uninterrupted one drew. verl applies it with the GAE estimator only (PPO with a critic), and so does
grpo_npu: configuration refuses it with another estimator.
"""

from __future__ import annotations

import torch

from grpo_npu.algo.names import PF_PPO_REWEIGHT_METHODS
from grpo_npu.batch import RolloutBatch

FLOOR = 1e-8


def resample_weights(scores: torch.Tensor, method: str, weight_pow: float) -> torch.Tensor:
    """(B,) sequence scores -> (B,) unnormalised draw weights (see the module docstring)."""
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.full_like(scores, 0.1).masked_fill(scores == scores.max(), 0.4)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={method!r}; known: {', '.join(PF_PPO_REWEIGHT_METHODS)}")
    return torch.clamp(weights + FLOOR, min=FLOOR)


def resample_rows(token_level_scores: torch.Tensor, method: str, weight_pow: float,
                  generator: torch.Generator) -> torch.Tensor:
    """The (B,) row indices of the resampled batch: B draws with replacement, in draw order."""
    scores = token_level_scores.sum(-1).float()
    weights = resample_weights(scores, method, weight_pow)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)


def resample_batch(batch: RolloutBatch, reweight_method: str, weight_pow: float, seed: int) -> RolloutBatch:
    """``batch`` resampled by :func:`resample_rows` with a generator seeded by ``seed``: every field follows its row."""
    generator = torch.Generator().manual_seed(seed)
    return batch.select(resample_rows(batch.token_level_scores, reweight_method, weight_pow, generator))
