"""Log-probs at vocab 151,936: grpo_npu's chunked paths against the naive full log_softmax.

Run: ``python -m bench.logprob [--quick]``. Targets (full size, the default chunking the actor
uses): extra peak memory of the chunked path <= 1/4 of the naive path's, time <= 1.2x.

Cases, each naive vs grpo_npu:
- ``fwd``      old/ref log-probs under no_grad: logits (N, V) in bf16, as a device model emits them;
               naive = log_softmax(logits.float() / T).gather(labels).
- ``fwd_bwd``  the same with backward into the logits (the logits' own bf16 gradient, N x V, is
               part of both sides' peak).
- ``linear``   fused lm_head + log-prob, fwd + bwd, fp32 (bf16 matmuls are ~300x slower on CPU):
               naive = hidden @ W.T then the log_softmax; grpo_npu = linear_logprobs, which never
               forms the full logits and recomputes each chunk's logits in backward (one extra
               matmul: expect ~1.3x time when the matmul dominates, the price of the memory).

Memory method (torch has no CPU allocator statistics): every (case, variant) runs once in a fresh
Python subprocess started with ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor buffer is its own
mmap, returned to the OS on free, and resident memory tracks live tensors (as a device allocator's
"allocated" counter does) instead of glibc's heap reuse, which made repeated runs differ by 2x.
After the inputs exist the worker resets the kernel's peak-RSS counter (``echo 5 >
/proc/self/clear_refs``) and reports VmHWM - VmRSS after one call: the extra resident memory the
call needed at its peak. Where the reset is refused it falls back to the ru_maxrss delta, and says
so. Time is measured in this (driver) process with the default allocator, both sides alternating,
best of a few calls, one intra-op thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import BenchResult, bench_main

VOCAB = 151_936
TEMPERATURE = 0.7
TARGET_MEMORY_RATIO = 0.25
TARGET_TIME_RATIO = 1.2
LINEAR_HIDDEN = 64  # small H keeps the CPU matmuls affordable; memory is dominated by N x V anyway
# One intra-op thread: on a shared 2-core CPU a parallel region stalls whenever another process holds
# a core; both sides run under the same setting.
BENCH_THREADS = 1
# Buffers >= 64 KiB get their own mmap, released on free: RSS then follows live tensors (see docstring).
MMAP_THRESHOLD = 65536
REPO_ROOT = Path(__file__).resolve().parent.parent
_MIB = 1024**2


# ------------------------------------------------------------------------------------------------
# Worker side (runs in a fresh subprocess)
# ------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def _make_inputs(case: str, n: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, VOCAB, (n,), generator=gen)
    if case == "linear":  # in-place init: no temporary copies before the measurement
        hidden = torch.empty(n, LINEAR_HIDDEN).normal_(generator=gen).requires_grad_()
        weight = torch.empty(VOCAB, LINEAR_HIDDEN).normal_(0, 0.05, generator=gen).requires_grad_()
        return {"hidden": hidden, "weight": weight, "labels": labels}
    logits = torch.empty(n, VOCAB, dtype=torch.bfloat16).normal_(0, 3, generator=gen)
    if case == "fwd_bwd":
        logits.requires_grad_()
    return {"logits": logits, "labels": labels}


def _naive_logp(logits, labels):
    import torch

    return torch.log_softmax(logits.float() / TEMPERATURE, dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def _call(case: str, variant: str, inputs: dict, chunk: int | None) -> None:
    import torch

    from grpo_npu.ops.logprob import linear_logprobs, logprobs_from_logits

    if case == "fwd":
        with torch.no_grad():
            if variant == "naive":
                _naive_logp(inputs["logits"], inputs["labels"])
            else:
                logprobs_from_logits(inputs["logits"], inputs["labels"], temperature=TEMPERATURE, chunk_size=chunk)
        return
    if case == "fwd_bwd":
        logits = inputs["logits"]
        logits.grad = None
        if variant == "naive":
            logp = _naive_logp(logits, inputs["labels"])
        else:
            logp = logprobs_from_logits(logits, inputs["labels"], temperature=TEMPERATURE, chunk_size=chunk)
        logp.sum().backward()
        return
    hidden, weight = inputs["hidden"], inputs["weight"]
    hidden.grad = weight.grad = None
    if variant == "naive":
        logp = _naive_logp(hidden @ weight.t(), inputs["labels"])
    else:
        logp = linear_logprobs(hidden, weight, inputs["labels"], chunk_size=chunk, temperature=TEMPERATURE)
    logp.sum().backward()


def _setup():
    import torch

    from grpo_npu.ops import dispatch

    torch.set_num_threads(BENCH_THREADS)
    dispatch.set_backend("reference")  # CPU: the chunked reference is the path being measured


def worker(spec: dict) -> dict:
    """Extra peak memory (MiB) of one call of (case, variant), measured in this fresh process."""
    _setup()
    inputs = _make_inputs(spec["case"], spec["n"])
    method = "VmHWM after reset"
    if _reset_peak():
        base_kib = _status_kib("VmRSS")
        _call(spec["case"], spec["variant"], inputs, spec["chunk"])
        peak_kib = _status_kib("VmHWM")
    else:
        import resource

        method = "ru_maxrss delta"
        base_kib = max(_status_kib("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        _call(spec["case"], spec["variant"], inputs, spec["chunk"])
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_extra_mib": (peak_kib - base_kib) / 1024, "method": method}


# ------------------------------------------------------------------------------------------------
# Driver side
# ------------------------------------------------------------------------------------------------
def _peak_memories(specs: list[dict], parallel: int) -> list[dict]:
    """Run :func:`worker` for each spec in its own subprocess, ``parallel`` at a time (peaks are per process)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(BENCH_THREADS), MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    results: list[dict] = []
    for start in range(0, len(specs), parallel):
        batch = specs[start : start + parallel]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", f"import json, bench.logprob as b; print(json.dumps(b.worker({spec!r})))"],
                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            for spec in batch
        ]
        for spec, proc in zip(batch, procs):
            out, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"bench worker {spec} failed:\n{err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _best_seconds(case: str, n: int, chunk: int | None, repeat: int) -> dict[str, float]:
    """Best-of-repeat seconds per variant, the two variants alternating on the same inputs."""
    _setup()
    inputs = _make_inputs(case, n)
    best = {"naive": float("inf"), "grpo_npu": float("inf")}
    for _ in range(repeat):
        for variant in best:
            t0 = time.perf_counter()
            _call(case, variant, inputs, chunk)
            best[variant] = min(best[variant], time.perf_counter() - t0)
    return best


def run(quick: bool = False) -> BenchResult:
    """Chunked log-probs vs naive log_softmax at vocab 151,936: peak memory and time."""
    import torch

    from grpo_npu.ops.logprob import default_chunk_rows

    # Quick: few tokens, so the chunk is set small for the ratio to mean something; full: the default.
    # Quick runs its six small memory workers at once; full sizes one at a time (GiBs each).
    n, chunk, repeat, parallel = (128, 16, 2, 6) if quick else (2048, None, 3, 1)
    result = BenchResult(name="logprob")
    cases, variants = ("fwd", "fwd_bwd", "linear"), ("naive", "grpo_npu")
    specs = [{"case": c, "variant": v, "n": n, "chunk": chunk} for c in cases for v in variants]
    memories = iter(_peak_memories(specs, parallel))
    methods = set()
    threads = torch.get_num_threads()
    for case in cases:
        naive, ours = next(memories), next(memories)
        methods |= {naive["method"], ours["method"]}
        seconds = _best_seconds(case, n, chunk, repeat)
        naive["seconds"], ours["seconds"] = seconds["naive"], seconds["grpo_npu"]
        mem_ratio = ours["peak_extra_mib"] / naive["peak_extra_mib"]
        time_ratio = ours["seconds"] / naive["seconds"]
        result.rows.append(
            {
                "case": case,
                "tokens": n,
                "vocab": VOCAB,
                "chunk_rows": chunk or default_chunk_rows(VOCAB),
                "naive_peak_mib": round(naive["peak_extra_mib"], 1),
                "grpo_npu_peak_mib": round(ours["peak_extra_mib"], 1),
                "memory_ratio": round(mem_ratio, 3),
                "naive_s": round(naive["seconds"], 3),
                "grpo_npu_s": round(ours["seconds"], 3),
                "time_ratio": round(time_ratio, 3),
            }
        )
        if case != "linear":
            result.add_target(f"{case}_memory_ratio", mem_ratio, TARGET_MEMORY_RATIO, higher_is_better=False)
            result.add_target(f"{case}_time_ratio", time_ratio, TARGET_TIME_RATIO, higher_is_better=False)
    torch.set_num_threads(threads)
    result.notes.append(
        f"peak = extra resident memory of one call above its inputs ({', '.join(sorted(methods))}, "
        f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}), fresh subprocess per variant; "
        f"time = best of {repeat} alternating calls in one process, {BENCH_THREADS} intra-op thread(s)"
    )
    result.notes.append(
        f"fwd/fwd_bwd: bf16 logits (N, {VOCAB}), temperature {TEMPERATURE}; linear: fp32 hidden (N, "
        f"{LINEAR_HIDDEN}) and lm_head ({VOCAB}, {LINEAR_HIDDEN}), no target (recompute costs one extra matmul)"
    )
    if quick:
        result.notes.append(f"quick sizes (N={n}, chunk {chunk} rows): ratios are indicative only")
    return result


def main() -> None:
    bench_main(run)


if __name__ == "__main__":
    main()
