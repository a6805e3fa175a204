"""Profiler settings, verl's keys: ``global_profiler.*`` (which tool, which steps, where) and each role's
``profiler.*`` (actor, ref, rollout, critic: whether and on which ranks, and what to record). Acted on by
:mod:`grpo_npu.perf.profiler`; docs/configuration.md explains them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from grpo_npu.config.fields import choice, many
from grpo_npu.names import NPU_PROFILER_CONTENTS, NPU_PROFILER_LEVELS, PROFILER_TOOLS, TORCH_PROFILER_CONTENTS


@dataclass(frozen=True)
class TorchProfilerToolConfig:
    contents: List[str] = many([], TORCH_PROFILER_CONTENTS)
    """What torch.profiler records besides CPU ops: cuda (kernels; also when empty), shapes, memory, stack."""
    discrete: bool = False
    """One trace per call of the role (generate, log-probs, update) instead of one for the whole step."""


@dataclass(frozen=True)
class NpuProfilerToolConfig:
    contents: List[str] = many([], NPU_PROFILER_CONTENTS)
    """What torch_npu.profiler records besides CPU ops: npu, shapes, memory, module, stack (empty: all of them)."""
    level: str = choice("level0", NPU_PROFILER_LEVELS)
    """torch_npu's profiler_level (level_none | level0 | level1 | level2)."""
    analysis: bool = True
    """Let torch_npu parse the raw data when a trace ends (analyse_flag)."""
    discrete: bool = False
    """One trace per call of the role instead of one for the whole step."""


@dataclass(frozen=True)
class ProfilerToolConfig:
    torch: TorchProfilerToolConfig = field(default_factory=TorchProfilerToolConfig)
    """global_profiler.tool=torch settings of this role."""
    npu: NpuProfilerToolConfig = field(default_factory=NpuProfilerToolConfig)
    """global_profiler.tool=npu settings of this role."""


@dataclass(frozen=True)
class RoleProfilerConfig:
    enable: bool = False
    """Profile this role on the profiled steps (global_profiler.steps)."""
    all_ranks: bool = False
    """On every rank (else only on profiler.ranks)."""
    ranks: List[int] = many([])
    """Ranks that profile this role."""
    tool_config: ProfilerToolConfig = field(default_factory=ProfilerToolConfig)
    """What each tool records."""


@dataclass(frozen=True)
class RolloutProfilerConfig:
    enable: Optional[bool] = None
    """Profile generation on the profiled steps (None: actor.profiler.enable)."""
    all_ranks: Optional[bool] = None
    """On every rank (None: actor.profiler.all_ranks)."""
    ranks: Optional[List[int]] = None
    """Ranks that profile generation (None: actor.profiler.ranks)."""
    tool_config: ProfilerToolConfig = field(default_factory=ProfilerToolConfig)
    """What each tool records."""


@dataclass(frozen=True)
class GlobalProfilerConfig:
    tool: Optional[str] = choice(None, (None, *PROFILER_TOOLS))
    """torch (torch.profiler: CPU, CUDA) | npu (torch_npu.profiler) | null: no profiling."""
    steps: Optional[List[int]] = None
    """Training steps to profile (null: none)."""
    save_path: str = "outputs/profile"
    """Directory the traces go to."""
