"""grpo_npu.compat: the version-gated fallbacks, decided once, for the three supported Ascend stacks.

The stacks themselves cannot be installed here (torch_npu needs CANN), so each is fed to :func:`probe` as
its versions plus fake torch modules shaped like the real ones (which module holds fully_shard, which
methods FSDPModule has: read in the torch 2.5.1 / 2.7.1 / 2.10.0 wheels, docs/npu.md section 1).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_npu import compat

REPO = Path(__file__).resolve().parents[1]


def _fake_torch(*, fsdp_home: str, reshard_toggle: bool, total_norm: bool):
    fsdp_module = type("FSDPModule", (), {"set_reshard_after_forward": lambda self: None} if reshard_toggle else {})
    fsdp = SimpleNamespace(fully_shard=lambda m: m, FSDPModule=fsdp_module)
    modules = {fsdp_home: fsdp, "torch.nn.utils": SimpleNamespace(**({"get_total_norm": 1} if total_norm else {}))}
    if fsdp_home == "torch.distributed._composable.fsdp":  # torch 2.5.1: the public module has no FSDP2 yet
        modules["torch.distributed.fsdp"] = SimpleNamespace()
    return modules.get


def _stack(name: str, **overrides) -> compat.Compat:
    stack = next(s for s in compat.STACKS if s.name == name)
    versions = {**stack.pins(), "ray": "2.40.0", **overrides}
    torch_features = {
        "npu-8.1": dict(fsdp_home="torch.distributed._composable.fsdp", reshard_toggle=False, total_norm=False),
        "npu-8.3": dict(fsdp_home="torch.distributed.fsdp", reshard_toggle=False, total_norm=True),
        "npu-9.1": dict(fsdp_home="torch.distributed.fsdp", reshard_toggle=True, total_norm=True),
    }[name]
    return compat.probe(versions, import_module=_fake_torch(**torch_features),
                        npu_allocator_toggle=lambda: name == "npu-9.1")


def test_stacks_match_the_constraint_files():
    for stack in compat.STACKS:
        text = (REPO / "requirements" / f"{stack.name}.txt").read_text()
        pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.M))
        pins = {name.replace("-", "_"): version for name, version in pins.items()}
        assert {k: pins[k] for k in stack.pins()} == stack.pins(), stack.name
        assert re.search(rf"^# cann: {re.escape(stack.cann)} ", text, re.M), stack.name
    assert compat.MINIMUM["torch"] == compat.STACKS[0].torch and compat.MINIMUM["vllm"] == compat.STACKS[0].vllm


def test_quickstart_stack_degrades_and_names_what_is_off():
    stack = _stack("npu-8.1")
    assert stack.fsdp2_module == "torch.distributed._composable.fsdp"
    assert not (stack.fsdp_reshard_toggle or stack.grad_total_norm or stack.npu_allocator_toggle)
    assert not (stack.vllm_tagged_wake_up or stack.vllm_sleep_mode_query or stack.vllm_logprobs_mode)
    assert not stack.sleep_level2_keeps_buffers
    stack.require_supported(vllm=True)  # supported: degrades, is not refused
    assert stack.matching_stack().name == "npu-8.1"
    off = stack.off("npu", rollout="vllm", sleep_mode=True, sleep_level=2)
    assert len(off) == 3 and all("\n" not in line for line in off)
    assert any("torch_npu 2.5.1 has no run-time allocator toggle" in line and "off for the whole run" in line
               for line in off)
    assert any("wakes without tags" in line for line in off) and any("level 1" in line for line in off)
    assert any("all-gathers each layer" in line for line in stack.off("npu", rollout="hf", sleep_mode=False,
                                                                        sleep_level=1))


def test_seed_era_and_current_stacks():
    seed = _stack("npu-8.3")
    assert seed.fsdp2_module == "torch.distributed.fsdp" and not seed.fsdp_reshard_toggle and seed.grad_total_norm
    assert seed.vllm_tagged_wake_up and seed.vllm_sleep_mode_query and seed.vllm_logprobs_mode
    assert seed.sleep_level2_keeps_buffers  # vllm-ascend 0.11.0rc1 restores buffers after a level-2 sleep
    assert seed.off("npu", rollout="vllm", sleep_mode=True, sleep_level=1) == [
        "torch_npu 2.7.1 has no run-time allocator toggle (memory._set_allocator_settings): expandable segments stay "
        "off for the whole run (the sleep-mode pool refuses them in PYTORCH_NPU_ALLOC_CONF)"]
    current = _stack("npu-9.1")
    assert current.off("npu", rollout="vllm", sleep_mode=True, sleep_level=2) == []
    assert current.matching_stack().name == "npu-9.1"
    assert _stack("npu-9.1", transformers="5.19.0").matching_stack() is None


def test_older_than_the_oldest_stack_is_refused_in_one_line():
    with pytest.raises(compat.UnsupportedStack) as err:
        _stack("npu-8.1", torch="2.4.1", torch_npu="2.5.1rc1", vllm="0.6.6").require_supported(vllm=True)
    message = str(err.value)
    assert "\n" not in message
    assert "torch 2.4.1 < 2.5.1" in message and "torch_npu 2.5.1rc1 < 2.5.1" in message and "vllm 0.6.6 < 0.7.3" in message
    assert "torch >= 2.5.1" in message and "transformers >= 4.56.0" in message and "vllm >= 0.7.3" in message
    _stack("npu-8.1", vllm="0.6.6").require_supported(vllm=False)  # an old vllm the run does not use is fine
    with pytest.raises(compat.UnsupportedStack, match=r"transformers 4\.55\.4 < 4\.56\.0"):
        _stack("npu-8.3", transformers="4.55.4").require_supported(vllm=False)


def test_feature_thresholds_follow_the_released_sources():
    def vllm(version):
        return compat.Compat({"vllm": version}, "torch.distributed.fsdp", True, True, False)

    assert [vllm(v).vllm_tagged_wake_up for v in ("0.8.2", "0.8.3")] == [False, True]
    assert [vllm(v).vllm_sleep_mode_query for v in ("0.8.4", "0.8.5")] == [False, True]
    assert [vllm(v).vllm_logprobs_mode for v in ("0.9.2", "0.10.0", "0.32.0+cpu")] == [False, True, True]
    assert vllm("0.7.3+empty").matching_stack() is None and not vllm("0.7.3+empty").vllm_tagged_wake_up


def test_this_machine_is_probed_once():
    compat.current.cache_clear()
    try:
        first = compat.current()
        assert first is compat.current()
        assert first.fsdp2_module == "torch.distributed.fsdp" and first.fsdp_reshard_toggle and first.grad_total_norm
        assert not first.npu_allocator_toggle  # no torch_npu here
    finally:
        compat.current.cache_clear()


_TORCH_25_SHIM = """
import torch.distributed._composable.fsdp  # the torch 2.5 home, bound before the public names go
import transformers.distributed.fsdp, transformers.generation.utils, transformers.modeling_utils  # (this transformers
# is not one for torch 2.5: it reads the public names itself, so it is loaded first)
import torch.distributed.fsdp as public
import torch.nn.utils as nn_utils
for name in ("fully_shard", "FSDPModule", "register_fsdp_forward_method", "CPUOffloadPolicy", "MixedPrecisionPolicy",
             "OffloadPolicy"):
    delattr(public, name)  # torch 2.5.1: FSDP2 only under torch.distributed._composable.fsdp
delattr(public._fully_shard._fully_shard.FSDPModule, "set_reshard_after_forward")
delattr(nn_utils, "get_total_norm")
"""


def test_workers_import_and_shard_on_a_torch_25_layout(tmp_path):
    """grpo_npu.workers.fsdp imported `fully_shard` from torch.distributed.fsdp: an ImportError on torch 2.5.1."""
    script = _TORCH_25_SHIM + """
import torch
from torch import nn
from grpo_npu import compat
from grpo_npu.device import Device
from grpo_npu.workers import fsdp, fsdp_gather
stack = compat.current()
assert stack.fsdp2_module == "torch.distributed._composable.fsdp", stack
assert not stack.fsdp_reshard_toggle and not stack.grad_total_norm
fsdp.init_distributed(Device("cpu"), rank=0, world_size=1, master_addr="127.0.0.1", master_port=fsdp.free_port())
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
fsdp.shard_model(model, list(model), fsdp.build_mesh(Device("cpu"), -1), param_dtype=torch.float32,
                 master_dtype=torch.float32, reduce_dtype=torch.float32, cpu_offload=False,
                 reshard_after_forward=True, forward_prefetch=False)
model(torch.ones(3, 4)).sum().backward()
params = list(model.parameters())
want = torch.linalg.vector_norm(torch.stack([p.grad.full_tensor().norm() for p in params]))
torch.testing.assert_close(fsdp.grad_norm(params), want)
with fsdp_gather.gathered(model):  # no set_reshard_after_forward: the block runs with per-forward gathers
    model(torch.ones(1, 4))
fsdp.destroy_distributed()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_workers_refuse_an_old_stack_before_starting_and_log_what_is_off(monkeypatch, caplog):
    import logging

    from grpo_npu import cluster
    from tests.workers.helpers import make_cfg

    cfg = make_cfg("/m", "actor_rollout_ref.rollout.name=vllm")
    monkeypatch.setattr(compat, "current", lambda: _stack("npu-8.1", vllm="0.6.6"))
    with pytest.raises(compat.UnsupportedStack, match=r"vllm 0\.6\.6 < 0\.7\.3"):
        cluster.check_stack(cfg, with_rollout=True)
    cluster.check_stack(cfg, with_rollout=False)  # an SFT run does not use vllm
    cfg = make_cfg("/m")  # the transformers rollout
    with caplog.at_level(logging.INFO, logger=cluster.__name__):
        cluster.check_stack(cfg, with_rollout=True)
    assert "stack: torch 2.5.1 has no FSDPModule.set_reshard_after_forward" in caplog.text
