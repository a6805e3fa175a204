"""How far each phase of a training step is from its physical limit, and which phase to blame.

Floors (the least time the device could take for the phase's work; see :mod:`grpo_npu.perf.flops` for
what is counted):
    old_log_prob, ref, values    model FLOPs of a forward over every row / (peak x devices)
    update_actor, update_critic  ppo_epochs x forward+backward, plus the checkpointed layers'
                                 recompute when gradient checkpointing is on / (peak x devices), plus
                                 each optimizer step's reads on the device: the gradient norm reads
                                 every fp32 gradient, AdamW every fp32 parameter, gradient and both
                                 moments (OPTIMIZER_READS values per parameter) / (bandwidth x devices);
                                 writes are left out (on a CPU they go back to lines just read), so
                                 this stays a lower bound
    gen                          prefill of each prompt once (the n rows of a group share it), then
                                 one decode step per generated token for the rows still generating:
                                 each step takes at least max(FLOPs / peak, bytes / bandwidth), where
                                 the bytes are every weight read once (however many rows) plus the KV
                                 cache of every key attended to ("roofline"). The bandwidth term alone
                                 is reported too (``perf/limit_frac/gen_bandwidth``), and, where the
                                 engine timed its decode steps (``decode_s``), the decode steps' bandwidth
                                 term against their time (``perf/limit_frac/decode_bandwidth``), and the
                                 prefill's roofline against its own time (``prefill_s``:
                                 ``perf/limit_frac/prefill``).
    sync                         one in-memory copy of the weights into the engine (read in the compute
                                 dtype, written in the engine's) / bandwidth; each rank of a
                                 tensor-parallel engine copies its shard
Other phases (reward, adv, idle, ...) have no modelled floor; they are reported as shares of the step.

Rows are the unit, as in verl: a row's forward covers its prompt and response, the head runs on its
response tokens (the tokens scored). Each generation engine (one per rank, or one per ``rollout_tp``
ranks under vLLM tensor parallelism) generates a contiguous share of the prompt groups (how the trainer
dispatches them, :mod:`grpo_npu.rollout.layout`), so the gen floor is the slowest engine's. Tensor
parallelism splits an engine's weights and FLOPs over its ranks' devices (its communication is not
counted: the floor stays a lower bound). On a device the ranks share (CPU) the engines' floors add up
instead, and an engine's ranks split nothing.

Metrics: ``perf/mfu/actor`` (update), ``perf/mfu/actor_infer`` (old + ref log-prob forwards) and
``perf/mfu/critic`` under verl's names and meaning (model FLOPs, no recompute, over the peak of every
device); ``perf/floor_s/<phase>``, ``perf/limit_frac/<phase>`` (floor / measured time, 1.0 = at the
limit) and ``perf/share/<phase>`` (of the step's time) for each phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from grpo_npu.perf.flops import (
    DTYPE_BYTES,
    Flops,
    ModelShape,
    attention_pairs,
    decode_step_bytes,
    decode_step_flops,
    dtype_name,
    forward_flops,
    train_flops,
)
from grpo_npu.perf.hardware import DeviceSpec
from grpo_npu.perf.memory import ADAM_MOMENTS

STEP = "step"  # the whole step's seconds, every other timed phase inside it
# fp32 values an optimizer step reads per parameter: the gradient norm's pass over the gradient, then AdamW's
# parameter, gradient and moments (module docstring)
OPTIMIZER_READS = 1 + 2 + ADAM_MOMENTS
MASTER_BYTES = DTYPE_BYTES["fp32"]  # the optimizer's parameters, gradients and moments
IDLE = "idle"  # step time no phase accounts for (computed when not given)
# Phase sums may exceed the step by timer noise only; more means nested phases were passed.
_OVERLAP_TOLERANCE_S = 1e-3


@dataclass(frozen=True)
class StepWorkload:
    """What one step computed: its rows and how the models ran over them."""

    actor: ModelShape
    prompt_lengths: Sequence[int]  # (B*n,) prompt tokens per row, generation order: rows i*n..i*n+n-1 share prompt i
    response_lengths: Sequence[int]  # (B*n,) response tokens per row
    n: int  # responses per prompt
    world_size: int  # ranks, each generating and training on its share of the rows
    dtype: str  # compute dtype of the log-prob forwards and the updates ('fp32', 'bf16', 'fp16')
    rollout_dtype: str | None = None  # the generation engine's dtype; None: ``dtype``
    rollout_tp: int = 1  # ranks per generation engine (vLLM tensor parallelism); divides world_size
    gradient_checkpointing: bool = False  # the actor recomputes its layers in backward
    ppo_epochs: int = 1  # actor passes over the batch per step
    critic: ModelShape | None = None  # None: no critic phases
    critic_gradient_checkpointing: bool = False
    critic_ppo_epochs: int | None = None  # None: ``ppo_epochs``
    # Optimizer steps of the actor / critic in this step (mini-batches x epochs) run on the device the floors
    # describe; 0: not counted (an optimizer offloaded to the host, or not known)
    optimizer_steps: int = 0
    critic_optimizer_steps: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_lengths", tuple(int(x) for x in self.prompt_lengths))
        object.__setattr__(self, "response_lengths", tuple(int(x) for x in self.response_lengths))
        rows = len(self.prompt_lengths)
        if rows == 0 or len(self.response_lengths) != rows:
            raise ValueError(f"StepWorkload: {rows} prompt lengths and {len(self.response_lengths)} response "
                             "lengths; expected the same number (> 0), one per row")
        for name, value in (("n", self.n), ("world_size", self.world_size), ("rollout_tp", self.rollout_tp),
                            ("ppo_epochs", self.ppo_epochs), ("critic_ppo_epochs", self.critic_ppo_epochs or 1)):
            if value < 1:
                raise ValueError(f"StepWorkload.{name}={value} must be >= 1")
        if self.world_size % self.rollout_tp:
            raise ValueError(f"StepWorkload.rollout_tp={self.rollout_tp} must divide world_size={self.world_size}")
        for name in ("optimizer_steps", "critic_optimizer_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepWorkload.{name}={getattr(self, name)} must be >= 0")
        if rows % self.n:
            raise ValueError(f"StepWorkload: {rows} rows is not a multiple of n={self.n} (rows come in groups of n)")
        if min(self.prompt_lengths) < 1 or min(self.response_lengths) < 0:
            raise ValueError("StepWorkload: prompt lengths must be >= 1 and response lengths >= 0, got "
                             f"min {min(self.prompt_lengths)} and {min(self.response_lengths)}")
        for i in range(0, rows, self.n):
            if len(set(self.prompt_lengths[i:i + self.n])) > 1:
                raise ValueError(f"StepWorkload: rows {i}..{i + self.n - 1} share a prompt but have prompt lengths "
                                 f"{list(self.prompt_lengths[i:i + self.n])}; pass rows in generation order")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "rollout_dtype", dtype_name(self.rollout_dtype or self.dtype))

    @property
    def sequence_lengths(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_lengths, self.response_lengths)]

    @property
    def response_tokens(self) -> int:
        return sum(self.response_lengths)


@dataclass(frozen=True)
class PhaseCost:
    """One phase of a step: the time it took and the least time its work allows."""

    seconds: float
    floor_s: float | None = None  # None: no physical floor modelled (host work, waiting)
    bound: str = ""  # what sets the floor: 'compute', 'roofline' (gen), 'copy' (sync)


@dataclass(frozen=True)
class StepReport:
    """Every phase of one step against its limit; :meth:`metrics` flattens it for the tracker."""

    step_s: float
    phases: Mapping[str, PhaseCost] = field(hash=False)
    mfu: Mapping[str, float] = field(hash=False)  # perf/mfu/* -> value
    gen_bandwidth_floor_s: float | None = None  # gen's floor from memory traffic alone
    decode_bandwidth_floor_s: float | None = None  # the decode steps' (prefill excluded), from memory traffic alone
    decode_s: float | None = None  # the engine's decode steps, as it timed them
    prefill_floor_s: float | None = None  # the prefill's roofline: each group's prompt once
    prefill_s: float | None = None  # the engine's prefill step, as it timed it

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.mfu)
        for phase, cost in self.phases.items():
            out[f"perf/share/{phase}"] = cost.seconds / self.step_s
            if cost.floor_s is not None:
                out[f"perf/floor_s/{phase}"] = cost.floor_s
                if cost.seconds > 0:
                    out[f"perf/limit_frac/{phase}"] = cost.floor_s / cost.seconds
        gen = self.phases.get("gen")
        if self.gen_bandwidth_floor_s is not None and gen is not None and gen.seconds > 0:
            out["perf/limit_frac/gen_bandwidth"] = self.gen_bandwidth_floor_s / gen.seconds
        if self.decode_bandwidth_floor_s is not None and self.decode_s:
            out["perf/floor_s/decode_bandwidth"] = self.decode_bandwidth_floor_s
            out["perf/limit_frac/decode_bandwidth"] = self.decode_bandwidth_floor_s / self.decode_s
        if self.prefill_floor_s is not None and self.prefill_s:
            out["perf/floor_s/prefill"] = self.prefill_floor_s
            out["perf/limit_frac/prefill"] = self.prefill_floor_s / self.prefill_s
        return out


# ------------------------------------------------------------------------------------------------
# Floors
# ------------------------------------------------------------------------------------------------
def _engine_generation(shape: ModelShape, prompts: Sequence[int], responses: Sequence[int], n: int,
                       peak: float, bandwidth: float, dtype: str) -> tuple[float, float, float, float]:
    """(roofline, bandwidth-only, the decode steps' bandwidth-only, the prefill's roofline) seconds for one engine
    generating these rows together, on devices of this ``peak`` and ``bandwidth`` together."""
    if not prompts:
        return 0.0, 0.0, 0.0, 0.0
    weight_bytes = shape.read_weights * DTYPE_BYTES[dtype]
    kv_per_token = shape.kv_bytes_per_token(dtype)
    # Prefill, each prompt once: the n rows of a group have the same prompt, so 1/n of the rows' sum.
    prefill = Flops(linear=shape.linear_flops_per_token * sum(prompts) / n,
                    attention=shape.attention_flops_per_pair * sum(attention_pairs(p) for p in prompts) / n,
                    head=shape.head_flops_per_token * len(prompts) / n)  # one position per prompt is sampled
    memory = (weight_bytes + kv_per_token * sum(prompts) / n) / bandwidth
    prefill_roofline = max(prefill.total / peak, memory)
    roofline, bandwidth_only, decode = prefill_roofline, memory, 0.0
    # Decode step s >= 1 feeds each row's response token s; it runs for rows with more than s tokens
    # and attends to the row's prompt plus s response tokens.
    order = sorted(range(len(responses)), key=responses.__getitem__)
    active, active_prompt_tokens, done = len(responses), sum(prompts), 0
    for s in range(1, max(responses, default=0)):
        while responses[order[done]] <= s:
            active, active_prompt_tokens, done = active - 1, active_prompt_tokens - prompts[order[done]], done + 1
        keys = active_prompt_tokens + s * active
        memory = decode_step_bytes(shape, keys=keys, dtype=dtype) / bandwidth
        roofline += max(decode_step_flops(shape, rows=active, keys=keys).total / peak, memory)
        bandwidth_only += memory
        decode += memory
    return roofline, bandwidth_only, decode, prefill_roofline


def generation_floor(workload: StepWorkload, spec: DeviceSpec) -> tuple[float, float]:
    """(roofline, bandwidth-only) floor seconds of the gen phase: the slowest engine's (module docstring)."""
    return _generation_floors(workload, spec)[:2]


def decode_bandwidth_floor(workload: StepWorkload, spec: DeviceSpec) -> float:
    """Floor seconds of the decode steps from memory traffic alone (the prefill's excluded): the slowest engine's."""
    return _generation_floors(workload, spec)[2]


def prefill_floor(workload: StepWorkload, spec: DeviceSpec) -> float:
    """Floor seconds of the prefill (each group's prompt once, its first token sampled): the slowest engine's."""
    return _generation_floors(workload, spec)[3]


def _generation_floors(workload: StepWorkload, spec: DeviceSpec) -> tuple[float, float, float, float]:
    w = workload
    groups, engines = len(w.prompt_lengths) // w.n, w.world_size // w.rollout_tp
    split = 1 if spec.ranks_share_device else w.rollout_tp  # devices an engine's weights and FLOPs are split over
    per_engine, start = [], 0
    for engine in range(engines):  # contiguous prompt groups per engine, the first engines one more
        count = groups // engines + (engine < groups % engines)
        rows = slice(start * w.n, (start + count) * w.n)
        per_engine.append(_engine_generation(w.actor, w.prompt_lengths[rows], w.response_lengths[rows], w.n,
                                           split * spec.peak(w.rollout_dtype), split * spec.bandwidth,
                                           w.rollout_dtype))
        start += count
    combine = sum if spec.ranks_share_device else max
    return tuple(combine(r[i] for r in per_engine) for i in range(4))


def _model_flops(workload: StepWorkload) -> dict[str, tuple[Flops, Flops]]:
    """phase -> (model FLOPs, hardware FLOPs) of the forward/backward phases; they differ by recompute."""
    w = workload
    seqs, scored = w.sequence_lengths, w.response_tokens
    actor_fwd = forward_flops(w.actor, seqs, head_tokens=scored)
    out = {"old_log_prob": (actor_fwd, actor_fwd), "ref": (actor_fwd, actor_fwd)}
    out["update_actor"] = (w.ppo_epochs * train_flops(w.actor, seqs, head_tokens=scored),
                           w.ppo_epochs * train_flops(w.actor, seqs, head_tokens=scored,
                                                      recompute=w.gradient_checkpointing))
    if w.critic is not None:
        critic_fwd = forward_flops(w.critic, seqs, head_tokens=scored)
        epochs = w.critic_ppo_epochs or w.ppo_epochs
        out["values"] = (critic_fwd, critic_fwd)
        out["update_critic"] = (epochs * train_flops(w.critic, seqs, head_tokens=scored),
                                epochs * train_flops(w.critic, seqs, head_tokens=scored,
                                                     recompute=w.critic_gradient_checkpointing))
    return out


def _optimizer_floors(workload: StepWorkload, spec: DeviceSpec) -> dict[str, float]:
    """update phase -> seconds its optimizer steps' reads take at the device's bandwidth (module docstring); only
    phases with optimizer steps counted. FSDP shards the state: each device reads its share."""
    w = workload
    per_param = OPTIMIZER_READS * MASTER_BYTES / (spec.bandwidth * spec.devices(w.world_size))
    out = {"update_actor": w.optimizer_steps * w.actor.params * per_param}
    if w.critic is not None:
        out["update_critic"] = w.critic_optimizer_steps * w.critic.params * per_param
    return {phase: seconds for phase, seconds in out.items() if seconds > 0}


# verl metric -> the phases whose model FLOPs and seconds it pools
_MFU_PHASES = {"perf/mfu/actor": ("update_actor",), "perf/mfu/actor_infer": ("old_log_prob", "ref"),
               "perf/mfu/critic": ("update_critic",)}


def step_report(seconds: Mapping[str, float], workload: StepWorkload, spec: DeviceSpec | None,
                decode_s: float | None = None, prefill_s: float | None = None) -> StepReport:
    """Each timed phase of one step against its floor.

    ``seconds``: ``{"step": total, phase: seconds, ...}`` with disjoint phases inside the step (e.g.
    ``gen`` without the weight sync, passed as ``sync``); ``idle`` is the remainder unless given.
    ``spec`` None (a device not in the table): shares only, no floors or MFU. ``decode_s``: the seconds the
    engine spent in its decode steps (the prefill's and the engine's host work excluded), where it timed them;
    ``prefill_s``: the seconds of its prefill step, likewise.
    """
    if STEP not in seconds:
        raise ValueError(f"step_report: seconds has no {STEP!r} entry (the whole step's time); got {sorted(seconds)}")
    for name, value in seconds.items():
        if not 0 <= float(value) < float("inf"):
            raise ValueError(f"step_report: phase {name!r} took {value} s; expected a finite time >= 0")
    for name, value in (("decode_s", decode_s), ("prefill_s", prefill_s)):
        if value is not None and not 0 <= float(value) < float("inf"):
            raise ValueError(f"step_report: {name}={value}; expected a finite time >= 0")
    step_s = float(seconds[STEP])
    if step_s <= 0:
        raise ValueError(f"step_report: step took {step_s} s; expected > 0")
    times = {name: float(value) for name, value in seconds.items() if name != STEP}
    accounted = sum(times.values())
    if accounted > step_s + _OVERLAP_TOLERANCE_S:
        raise ValueError(f"step_report: phases {sorted(times)} add up to {accounted:.4g} s, more than the step's "
                         f"{step_s:.4g} s; pass disjoint phases (e.g. gen minus the weight sync)")
    times.setdefault(IDLE, max(step_s - accounted, 0.0))
    if spec is None:
        return StepReport(step_s, {name: PhaseCost(t) for name, t in times.items()}, {})

    w = workload
    critic_phases = sorted({"values", "update_critic"} & set(times))
    if critic_phases and w.critic is None:
        raise ValueError(f"step_report: phases {critic_phases} were timed but StepWorkload.critic is None "
                         "(pass the critic's ModelShape)")
    peak_all = spec.peak(w.dtype) * spec.devices(w.world_size)
    flops = _model_flops(w)
    phases: dict[str, PhaseCost] = {}
    gen_bandwidth = decode_floor = prefill = None
    optimizer = _optimizer_floors(w, spec)
    for name, t in times.items():
        if name in optimizer:
            phases[name] = PhaseCost(t, flops[name][1].total / peak_all + optimizer[name], "compute + optimizer")
        elif name in flops:
            phases[name] = PhaseCost(t, flops[name][1].total / peak_all, "compute")
        elif name == "gen":
            roofline, gen_bandwidth, decode_floor, prefill = _generation_floors(w, spec)
            phases[name] = PhaseCost(t, roofline, "roofline")
        elif name == "sync":
            # read (compute dtype) + write (engine dtype) of each rank's shard of its engine's weights
            copy_bytes = w.actor.params * (DTYPE_BYTES[w.dtype] + DTYPE_BYTES[w.rollout_dtype]) / w.rollout_tp
            copies = w.world_size if spec.ranks_share_device else 1
            phases[name] = PhaseCost(t, copies * copy_bytes / spec.bandwidth, "copy")
        else:
            phases[name] = PhaseCost(t)
    mfu = {}
    for metric, names in _MFU_PHASES.items():
        ran = [p for p in names if p in flops and times.get(p, 0.0) > 0]
        if ran:
            mfu[metric] = sum(flops[p][0].total for p in ran) / (sum(times[p] for p in ran) * peak_all)
    return StepReport(step_s, phases, mfu, gen_bandwidth, decode_floor, decode_s, prefill, prefill_s)


# ------------------------------------------------------------------------------------------------
# Verdict
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseTotal:
    """One phase summed over a run's steps."""

    name: str
    seconds: float
    floor_s: float | None  # None: no modelled floor in at least one step
    bound: str

    @property
    def above_s(self) -> float:
        """Seconds above the floor (all of them without one): what a faster phase could save."""
        return self.seconds - (self.floor_s or 0.0)


def ranked_phases(reports: Sequence[StepReport]) -> list[PhaseTotal]:
    """Every phase over the run, the most seconds above its floor first (the verdict's order)."""
    seconds: dict[str, float] = {}
    floors: dict[str, float | None] = {}
    bounds: dict[str, str] = {}
    for report in reports:
        for name, cost in report.phases.items():
            seconds[name] = seconds.get(name, 0.0) + cost.seconds
            known = floors.get(name, 0.0)
            floors[name] = None if known is None or cost.floor_s is None else known + cost.floor_s
            bounds[name] = cost.bound
    totals = [PhaseTotal(name, seconds[name], floors[name], bounds[name]) for name in seconds]
    return sorted(totals, key=lambda t: t.above_s, reverse=True)


def verdict(reports: Sequence[StepReport]) -> str:
    """One line for the end of a run: the phase furthest from its limit over all steps.

    "Furthest" is measured in time: the seconds a phase spends above its floor (all of them when it
    has none). A fraction alone would blame a phase of a few milliseconds that no speed-up could pay
    for; the line still gives the phase's share of the step and its fraction of the limit. Where it names
    gen and the engine timed its steps, it also says how far its prefill and its decode steps are from
    their own limits.
    """
    if not reports:
        return "perf: no steps to judge"
    steps, step_total = len(reports), sum(r.step_s for r in reports)
    ranked = ranked_phases(reports)
    worst = ranked[0]
    line = (f"perf: slowest against its limit: {worst.name}, {worst.seconds / step_total:.0%} of step time "
            f"({worst.seconds / steps:.3g} s/step)")
    if worst.floor_s is None:
        line += ", no physical floor modelled (host-side work or waiting)"
    elif worst.seconds > 0:
        line += (f" at {worst.floor_s / worst.seconds:.0%} of its {worst.bound} limit ({worst.floor_s / steps:.3g} "
                 f"s/step), {worst.above_s / steps:.3g} s/step above it")
    split = _generation_split(reports)
    if worst.name == "gen" and split:
        line += f" ({split})"
    if len(ranked) > 1:
        nxt = ranked[1]
        line += f"; next: {nxt.name} ({nxt.above_s / steps:.3g} s/step above its limit"
        line += f"; {split})" if nxt.name == "gen" and split else ")"
    return line


def _generation_split(reports: Sequence[StepReport]) -> str:
    """Where the engine timed its steps: the prefill's and the decode steps' fractions of their own limits over the
    run ('' when neither was timed), so that a verdict naming gen says which part of it is slow."""
    parts = []
    for label, floor_of, seconds_of in (
            ("prefill at {:.0%} of its roofline", lambda r: r.prefill_floor_s, lambda r: r.prefill_s),
            ("decode steps at {:.0%} of their bandwidth floor", lambda r: r.decode_bandwidth_floor_s,
             lambda r: r.decode_s)):
        timed = [r for r in reports if floor_of(r) is not None and seconds_of(r)]
        if timed:
            parts.append(label.format(sum(map(floor_of, timed)) / sum(map(seconds_of, timed))))
    return ", ".join(parts)
