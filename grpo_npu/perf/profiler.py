"""Traces of chosen training steps (verl's ``global_profiler`` and per-role ``profiler`` keys), on each worker.

``global_profiler.tool`` picks the profiler: ``torch`` (``torch.profiler``: CPU ops always, CUDA kernels unless
``contents`` leaves ``cuda`` out; a Chrome trace, ``.json.gz``) or ``npu`` (``torch_npu.profiler``: CPU ops always,
NPU activity unless ``contents`` leaves ``npu`` out, ``profiler_level`` from ``level``; torch_npu writes its
own directory under ``save_path`` and parses it when ``analysis`` is on). ``global_profiler.steps`` lists the
training steps to trace. A role (actor: old log-probs and updates; ref; rollout: generation; critic) traces when
its ``profiler.enable`` is on and this rank is one of its ``ranks`` (or ``all_ranks``):

- ``discrete=False`` (verl's default): one trace of the rank's whole step, opened when the step begins and
  closed when it ends, named ``step<N>_rank<R>``;
- ``discrete=True``: one trace per call of that role (``actor_update_actor``, ``rollout_generate``, ...) within
  the step, named ``<role>_<call>_step<N>_rank<R>``; not while a whole-step trace of the same rank is open (one
  profiler at a time).

All roles of a grpo_npu rank live in one process (verl's hybrid worker also holds actor, rollout and reference),
so a whole-step trace shows every role's work on that rank. The rollout's ``enable``, ``ranks`` and
``all_ranks`` follow the actor's unless set; its ``tool_config`` follows the actor's unless it differs from
the defaults. NPU calls are written against torch_npu 2.7.1's ``torch_npu/profiler`` (``profile``'s keywords,
``ProfilerActivity``, ``ProfilerLevel``, ``_ExperimentalConfig(profiler_level=)``,
``tensorboard_trace_handler(dir_name, analyse_flag=)``); ``tests/perf/test_profiler.py`` checks the call against
those signatures on a stand-in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
from typing import Any, Callable, Iterator

import torch

from grpo_npu.names import PROFILER_ROLES

log = logging.getLogger(__name__)

NPU_LEVELS = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}


def role_settings(cfg: Any, role: str) -> tuple[bool, bool, tuple[int, ...], Any]:
    """(enable, all_ranks, ranks, tool_config) of ``role``'s ``profiler`` section ('actor' | 'ref' | 'rollout' |
    'critic'); the rollout's unset ones are the actor's, as verl interpolates them."""
    arr = cfg.actor_rollout_ref
    own = {"actor": arr.actor.profiler, "ref": arr.ref.profiler, "rollout": arr.rollout.profiler,
           "critic": cfg.critic.profiler}[role]
    if role != "rollout":
        return own.enable, own.all_ranks, tuple(own.ranks), own.tool_config
    actor = arr.actor.profiler
    unset = json.dumps(dataclasses.asdict(own.tool_config)) == json.dumps(dataclasses.asdict(type(own.tool_config)()))
    tool_config = actor.tool_config if unset else own.tool_config
    return (*(getattr(own, k) if getattr(own, k) is not None else getattr(actor, k)
              for k in ("enable", "all_ranks", "ranks")), tool_config)


def profiled(role: str) -> Callable:
    """A worker method traced per call when ``role`` traces per call (``discrete``) in a profiled step; the worker
    holds its :class:`StepProfiler` as ``self.profiler``."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def traced(self, *args, **kwargs):
            with self.profiler.region(role, method.__name__):
                return method(self, *args, **kwargs)
        return traced
    return wrap


class StepProfiler:
    """One rank's profiler: whole-step and per-call traces of the configured steps and roles."""

    def __init__(self, cfg: Any, rank: int, device_kind: str):
        gp = cfg.global_profiler
        self.tool, self.save_path, self.rank, self.device_kind = gp.tool, gp.save_path, rank, device_kind
        self.steps = set(gp.steps or ()) if gp.tool is not None else set()
        self.settings: dict[str, Any] = {}  # role -> its tool's settings, for the roles this rank profiles
        for role in PROFILER_ROLES:
            enable, all_ranks, ranks, tool_config = role_settings(cfg, role)
            if self.steps and enable and (all_ranks or rank in ranks):
                self.settings[role] = getattr(tool_config, self.tool)
        if self.settings and self.tool == "npu" and device_kind != "npu":
            raise ValueError(f"global_profiler.tool=npu traces with torch_npu's profiler, and this run's device is "
                             f"{device_kind}: use global_profiler.tool=torch there")
        self.step: int | None = None
        self._whole: Any = None

    @property
    def active(self) -> bool:
        return bool(self.settings)

    def begin_step(self, step: int) -> None:
        """Open this rank's whole-step trace when ``step`` is profiled and a role here traces whole steps."""
        self.step = step if step in self.steps else None
        whole = [s for s in self.settings.values() if not s.discrete]
        if self.step is not None and whole:
            every = any(not s.contents for s in whole)  # an empty contents asks for everything
            contents = [] if every else sorted({c for s in whole for c in s.contents})
            self._whole = self._start(f"step{step}_rank{self.rank}", contents, whole[0])

    def end_step(self) -> None:
        """Close the whole-step trace (written to ``save_path``)."""
        if self._whole is not None:
            self._whole.stop()
            self._whole = None
        self.step = None

    @contextlib.contextmanager
    def region(self, role: str, call: str) -> Iterator[None]:
        """A trace of one call of ``role`` when that role traces per call on this rank in a profiled step."""
        settings = self.settings.get(role)
        if self.step is None or settings is None or not settings.discrete or self._whole is not None:
            yield
            return
        prof = self._start(f"{role}_{call}_step{self.step}_rank{self.rank}", list(settings.contents), settings)
        try:
            yield
        finally:
            prof.stop()

    def _start(self, name: str, contents: list[str], settings: Any) -> Any:
        os.makedirs(self.save_path, exist_ok=True)
        prof = torch_profiler(name, contents, self.save_path, self.device_kind) if self.tool == "torch" else npu_profiler(
            name, contents, settings.level, settings.analysis, self.save_path)
        prof.start()
        log.info("profiler: tracing %s (%s) into %s", name, self.tool, self.save_path)
        return prof


def torch_profiler(name: str, contents: list[str], save_path: str, device_kind: str) -> torch.profiler.profile:
    """A torch.profiler over CPU ops (always) and CUDA kernels (``cuda`` in contents, or contents empty, on a CUDA
    run), writing ``<save_path>/<name>.json.gz`` when stopped."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if (not contents or "cuda" in contents) and device_kind == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(os.path.join(save_path, f"{name}.json.gz"))

    return torch.profiler.profile(activities=activities, record_shapes="shapes" in contents,
                                  profile_memory="memory" in contents, with_stack="stack" in contents,
                                  on_trace_ready=write)


def npu_profiler(name: str, contents: list[str], level: str, analysis: bool, save_path: str) -> Any:
    """A torch_npu.profiler over CPU ops (always) and NPU activity (``npu`` in contents, or contents empty), with
    shapes / memory / module / stack as contents asks (all of them when it is empty), writing into
    ``<save_path>/<name>/`` (torch_npu's layout) and parsing it there when ``analysis`` is on."""
    import torch_npu  # only on Ascend, where the run's device already imported it

    npu_prof = torch_npu.profiler
    every = not contents
    activities = [npu_prof.ProfilerActivity.CPU]
    if every or "npu" in contents:
        activities.append(npu_prof.ProfilerActivity.NPU)
    experimental = npu_prof._ExperimentalConfig(profiler_level=getattr(npu_prof.ProfilerLevel, NPU_LEVELS[level]))
    return npu_prof.profile(
        activities=activities, record_shapes=every or "shapes" in contents,
        profile_memory=every or "memory" in contents, with_stack=every or "stack" in contents,
        with_modules=every or "module" in contents, experimental_config=experimental,
        on_trace_ready=npu_prof.tensorboard_trace_handler(os.path.join(save_path, name), analyse_flag=analysis))
