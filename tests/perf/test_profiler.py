"""global_profiler and the roles' profiler keys: which steps, roles and ranks trace, what the traces hold, and the
torch_npu call checked against torch_npu 2.7.1's signatures on a stand-in module."""

from __future__ import annotations

import gzip
import inspect
import json
import sys
import types

import pytest
import torch

from grpo_npu.config import ConfigError, load_config
from grpo_npu.perf import profiler as P

BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]


def cfg(*keys: str):
    return load_config(BASE + list(keys))


def events(path) -> list[str]:
    with gzip.open(path, "rt") as f:
        return [e.get("name", "") for e in json.load(f)["traceEvents"]]


class Worker:
    """The shape of a worker the decorator wraps: a profiler and role methods."""

    def __init__(self, config, rank=0):
        self.profiler = P.StepProfiler(config, rank, "cpu")

    @P.profiled("actor")
    def update_actor(self, x):
        with torch.profiler.record_function("the_update"):
            return (x @ x).sum()

    @P.profiled("rollout")
    def generate(self, x):
        return x + 1


def test_whole_step_and_per_call_traces(tmp_path):
    keys = ("global_profiler.tool=torch", "global_profiler.steps=[2]", f"global_profiler.save_path={tmp_path}",
            "actor_rollout_ref.actor.profiler.enable=True", "actor_rollout_ref.actor.profiler.ranks=[0]")
    x = torch.ones(4, 4)
    whole = Worker(cfg(*keys))
    for step in (1, 2, 3):  # only step 2 is listed
        whole.profiler.begin_step(step)
        whole.update_actor(x)
        whole.generate(x)
        whole.profiler.end_step()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step2_rank0.json.gz"]
    assert "the_update" in events(tmp_path / "step2_rank0.json.gz")

    per_call = tmp_path / "discrete"
    worker = Worker(cfg(*keys, f"global_profiler.save_path={per_call}",
                        "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=True",
                        "actor_rollout_ref.rollout.profiler.enable=False"))
    worker.profiler.begin_step(2)
    worker.update_actor(x)
    worker.generate(x)  # the rollout's profiling is off here
    worker.profiler.end_step()
    assert sorted(p.name for p in per_call.iterdir()) == ["actor_update_actor_step2_rank0.json.gz"]
    assert "the_update" in events(per_call / "actor_update_actor_step2_rank0.json.gz")


def test_roles_ranks_and_the_rollouts_inherited_settings():
    on = ("global_profiler.tool=torch", "global_profiler.steps=[1]", "actor_rollout_ref.actor.profiler.enable=True",
          "actor_rollout_ref.actor.profiler.ranks=[1]", "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=True")
    assert set(P.StepProfiler(cfg(*on), 1, "cpu").settings) == {"actor", "rollout"}  # the rollout follows the actor
    assert not P.StepProfiler(cfg(*on), 0, "cpu").active  # rank 0 is not listed
    assert P.StepProfiler(cfg(*on), 1, "cpu").settings["rollout"].discrete  # ... and so does its tool config
    critic = cfg(*on, "critic.profiler.enable=True", "critic.profiler.all_ranks=True")
    assert set(P.StepProfiler(critic, 0, "cpu").settings) == {"critic"}
    assert not P.StepProfiler(cfg(*on[2:]), 1, "cpu").active  # no tool: nothing traces
    assert not P.StepProfiler(cfg("global_profiler.tool=torch", *on[2:]), 1, "cpu").active  # no steps listed
    with pytest.raises(ValueError, match=r"^global_profiler\.tool=npu traces with torch_npu's profiler, and this run's "
                                         r"device is cpu: use global_profiler\.tool=torch there$"):
        P.StepProfiler(cfg("global_profiler.tool=npu", *on[1:]), 1, "cpu")


def test_unsupported_profiler_settings_are_refused():
    with pytest.raises(ConfigError, match=r"global_profiler\.tool=nsys \(nsys \(the workers would have to start under "
                                          r"Nsight Systems\), torch_memory and precision_debugger\)"):
        cfg("global_profiler.tool=nsys")
    with pytest.raises(ConfigError, match=r"schedule\.active=2 \(a profiler setting grpo_npu does not have"):
        cfg("global_profiler.tool=torch", "actor_rollout_ref.actor.profiler.tool_config.torch.schedule.active=2")
    with pytest.raises(ConfigError, match=r"npu\.level='level3' is not accepted; choose one of: level_none, level0, level1, level2"):
        cfg("actor_rollout_ref.actor.profiler.tool_config.npu.level=level3")
    # verl's command lines that set the per-role copies of the global settings to what they already are load
    cfg("global_profiler.tool=npu", "global_profiler.save_path=/tmp/p", "actor_rollout_ref.actor.profiler.save_path=/tmp/p",
        "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_start=null")


# torch_npu 2.7.1, torch_npu/profiler/profiler.py:188 (profile.__init__), :171 (tensorboard_trace_handler) and
# experimental_config.py:68 (_ExperimentalConfig.__init__): the keyword names grpo_npu may pass.
PROFILE_KEYWORDS = {"activities", "schedule", "on_trace_ready", "record_shapes", "profile_memory", "with_stack",
                    "with_flops", "with_modules", "experimental_config", "use_cuda"}
HANDLER_PARAMETERS = ("dir_name", "worker_name", "analyse_flag", "async_mode")
EXPERIMENTAL_KEYWORDS = {"profiler_level", "aic_metrics", "l2_cache", "msprof_tx", "mstx", "data_simplification",
                         "record_op_args", "op_attr", "gc_detect_threshold", "export_type", "host_sys",
                         "mstx_domain_include", "mstx_domain_exclude", "sys_io", "sys_interconnection"}


def _stand_in(calls: dict) -> types.ModuleType:
    def profile(**kwargs):
        assert set(kwargs) <= PROFILE_KEYWORDS, set(kwargs) - PROFILE_KEYWORDS
        calls["profile"] = kwargs
        return types.SimpleNamespace(start=lambda: None, stop=lambda: None)

    def handler(dir_name=None, worker_name=None, analyse_flag=True, async_mode=False):
        calls["handler"] = (dir_name, analyse_flag)
        return lambda prof: None

    def experimental(**kwargs):
        assert set(kwargs) <= EXPERIMENTAL_KEYWORDS, set(kwargs) - EXPERIMENTAL_KEYWORDS
        calls["experimental"] = kwargs
        return kwargs

    assert tuple(inspect.signature(handler).parameters) == HANDLER_PARAMETERS
    npu_profiler = types.SimpleNamespace(
        profile=profile, tensorboard_trace_handler=handler, _ExperimentalConfig=experimental,
        ProfilerActivity=types.SimpleNamespace(CPU="CPU", NPU="NPU"),
        ProfilerLevel=types.SimpleNamespace(Level0=0, Level1=1, Level2=2, Level_none=-1))
    return types.SimpleNamespace(profiler=npu_profiler)


def test_npu_profiler_call_matches_torch_npu(monkeypatch, tmp_path):
    calls: dict = {}
    monkeypatch.setitem(sys.modules, "torch_npu", _stand_in(calls))
    P.npu_profiler("step2_rank0", ["npu", "shapes"], "level1", False, str(tmp_path))
    assert calls["profile"]["activities"] == ["CPU", "NPU"]
    assert calls["profile"]["record_shapes"] and not calls["profile"]["profile_memory"]
    assert not calls["profile"]["with_stack"] and not calls["profile"]["with_modules"]
    assert calls["experimental"] == {"profiler_level": 1}
    assert calls["handler"] == (str(tmp_path / "step2_rank0"), False)
    P.npu_profiler("x", [], "level_none", True, str(tmp_path))  # empty contents: everything
    assert calls["profile"]["activities"] == ["CPU", "NPU"] and calls["profile"]["with_modules"]
    assert calls["experimental"] == {"profiler_level": -1}
    P.npu_profiler("x", ["cpu"], "level0", True, str(tmp_path))
    assert calls["profile"]["activities"] == ["CPU"]
