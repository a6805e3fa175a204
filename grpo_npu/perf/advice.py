"""What to try when the verdict blames a model pass far from its limit on an accelerator: fewer, larger passes.

On an accelerator a forward or backward pass over one micro-batch of a small or mid-size model is bound by the host
launching its kernels, a cost that does not grow with the rows in the pass. On an H100 at the Qwen2.5-0.5B shape in
bf16, the update of 64 rows took 0.87 s in four micro-batches of 16 and 0.23 s in one of 64 (docs/performance.md,
"On an H100: where the update's time goes"). Each phase's passes are set by a key of its own: rows per pass, or,
with dynamic batch sizes, tokens per pass. Where the phase the verdict names runs several passes per batch at under
:data:`FAR` of its limit on an accelerator, :func:`passes_advice` names that key, its value and the pass count,
beside the run's peak memory, which bounds how far the passes can grow.

On a CPU the passes are bound by their matrix products, not by launches (one reference pass of 64 rows took the
time of four of 16 there: 0.529 against 0.532 s), so nothing is advised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from grpo_npu.perf.report import PhaseTotal

# A phase under this fraction of its limit is far enough from it for its pass count to be the first suspect.
FAR = 0.5


@dataclass(frozen=True)
class Passes:
    """How one phase splits a rank's rows into model passes, and the key that sets their size."""

    batch_rows: int  # a rank's rows per optimizer step (updates) or per step (log-prob and value forwards)
    passes: int  # model passes over them
    key: str  # the key that sets the size of a pass
    value: int  # its value: rows per pass, or tokens when ``packed``
    packed: bool = False  # dynamic batch sizes: ``value`` is a token budget
    alternative: str = ""  # another setting that makes fewer passes ('' when none)


def passes_advice(ranked: Sequence[PhaseTotal], passes: Mapping[str, Passes], *, accelerator: bool,
                  peak_gb: float | None = None, capacity_gb: float | None = None) -> str:
    """One line for the end of a run, or '' when there is nothing to advise: the phase furthest from its limit
    (``ranked[0]``, :func:`grpo_npu.perf.report.ranked_phases`) is a model pass in ``passes``, runs more than one
    pass per batch, and is under :data:`FAR` of its limit on an accelerator."""
    if not (accelerator and ranked):
        return ""
    worst = ranked[0]
    layout = passes.get(worst.name)
    if layout is None or layout.passes <= 1 or worst.floor_s is None or worst.seconds <= 0:
        return ""
    fraction = worst.floor_s / worst.seconds
    if fraction >= FAR:
        return ""
    unit = "tokens" if layout.packed else "rows"
    other = f", or {layout.alternative}" if layout.alternative else ""
    line = (f"perf: to try: {worst.name} runs at {fraction:.0%} of its limit in {layout.passes} passes per "
            f"{layout.batch_rows}-row batch ({layout.key}={layout.value} {unit} per pass); on an accelerator such "
            f"passes are bound by launching their kernels, whatever their size: fewer, larger ones (raise "
            f"{layout.key}{other}) as memory allows")
    if peak_gb is not None and capacity_gb:
        line += f" (peak allocated {peak_gb:.1f} of {capacity_gb:.1f} GiB)"
    return line


__all__ = ["FAR", "Passes", "passes_advice"]
