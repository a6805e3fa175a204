"""GRPO advantage: the vectorised grpo_advantage against a per-group Python loop (verl-style reference).

Run: ``python -m bench.advantage [--quick]``. Target: >= 20x the looped reference at B=8192 responses
in 1024 groups with uuid-string group ids (what the trainer stamps on prompts), T=128.

Both implementations also make a few memory-bound passes over the (B, T) rewards and mask (masked
sum, broadcast); those cost the same in both and grow with T, while the group statistics the
loop pays for do not. The ratio therefore falls as T grows; rows at T=1 (the group statistics alone)
and T=512 are shown next to the target row so that this is visible.
"""

from __future__ import annotations

import uuid
from collections import defaultdict

import numpy as np
import torch

from bench.common import BenchResult, bench_main, timeit
from grpo_npu.algo.advantages import grpo_advantage

TARGET_SPEEDUP = 20.0
# The vectorised call takes milliseconds; many repeats let best-of-N skip scheduler stalls on a shared CPU.
VECTORISED_REPEATS = 20
# One intra-op thread: on a shared CPU a parallel region waits whenever another process holds a core
# (stalls of tens of ms per call); both sides run under the same setting.
BENCH_THREADS = 1
EPS = 1e-6


def looped_grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids, eps: float = EPS):
    """The obvious implementation: Python dicts, one loop over responses, one over groups."""
    scores = (token_level_rewards * response_mask).sum(-1)  # (B,)
    members = defaultdict(list)
    for i, key in enumerate(group_ids):
        members[key].append(scores[i])
    mean, std = {}, {}
    for key, values in members.items():
        if len(values) == 1:
            mean[key], std[key] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(values)
            mean[key], std[key] = stacked.mean(), stacked.std()
    normalised = torch.stack([(scores[i] - mean[key]) / (std[key] + eps) for i, key in enumerate(group_ids)])
    advantages = normalised.unsqueeze(-1) * response_mask
    return advantages, advantages


def _inputs(batch: int, groups: int, width: int, seed: int = 0):
    """Outcome rewards on the last token, an int64 response mask as RolloutBatch carries, interleaved groups."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # (B, T)
    rewards = torch.zeros(batch, width)
    rewards[torch.arange(batch), lengths - 1] = (torch.rand(batch, generator=gen) < 0.5).float()
    codes = torch.randperm(batch, generator=gen) % groups  # (B,) groups of batch / groups members
    uids = [str(uuid.UUID(int=int(c) + 1)) for c in codes]
    return rewards, mask, codes, uids


def run(quick: bool = False) -> BenchResult:
    """GRPO advantage: vectorised vs looped reference."""
    batch, groups = (1024, 128) if quick else (8192, 1024)
    widths, target_width = ((1, 64), 64) if quick else ((1, 128, 512), 128)
    result = BenchResult(name="advantage")
    threads = torch.get_num_threads()
    torch.set_num_threads(BENCH_THREADS)
    try:
        _measure(result, batch, groups, widths, target_width)
    finally:
        torch.set_num_threads(threads)
    result.notes.append(
        f"torch {torch.__version__}, {BENCH_THREADS} intra-op thread(s) for both sides; "
        f"best of 2 (looped) and {VECTORISED_REPEATS} (vectorised) runs"
    )
    if quick:
        result.notes.append("quick sizes: ratios are indicative only; the target is set for B=8192, 1024 groups, T=128")
    return result


def _measure(result: BenchResult, batch: int, groups: int, widths: tuple[int, ...], target_width: int) -> None:
    for width in widths:
        rewards, mask, codes, uids = _inputs(batch, groups, width)
        expected, _ = looped_grpo(rewards, mask, uids)
        t_loop = timeit(lambda: looped_grpo(rewards, mask, uids), repeat=2, warmup=0)
        containers = {"uuid str list": uids}
        if width == target_width:
            containers.update({"uuid numpy object": np.asarray(uids, dtype=object), "int64 tensor": codes})
        for label, ids in containers.items():
            got, _ = grpo_advantage(rewards, mask, ids, eps=EPS)
            max_err = float((got - expected).abs().max())
            if max_err > 1e-4:
                raise RuntimeError(f"grpo_advantage disagrees with the looped reference ({label}, T={width}): {max_err}")
            t_vec = timeit(lambda: grpo_advantage(rewards, mask, ids, eps=EPS), repeat=VECTORISED_REPEATS)
            result.rows.append(
                {
                    "group_ids": label, "B": batch, "groups": groups, "T": width,
                    "looped_ms": t_loop * 1e3, "vectorised_ms": t_vec * 1e3,
                    "speedup": t_loop / t_vec, "max_abs_diff": max_err,
                }
            )
            if width == target_width and label == "uuid str list":
                result.add_target(f"speedup (B={batch}, {groups} groups, T={width}, uuid str ids)", t_loop / t_vec, TARGET_SPEEDUP)


def main() -> None:
    bench_main(run)


if __name__ == "__main__":
    main()
