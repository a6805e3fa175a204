"""Accepted names are declared once, torch-free, and match the code that acts on them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_npu
from grpo_npu import device
from grpo_npu import names as top_names
from grpo_npu.algo import advantages, kl, losses
from grpo_npu.algo import names as algo_names
from grpo_npu.algo.registry import Registry
from grpo_npu.reward import manager
from grpo_npu.reward import names as reward_names
from grpo_npu.rollout import vllm_settings
from grpo_npu.rollout import names as rollout_names
from grpo_npu.workers import fsdp, optim
from grpo_npu.workers import names as workers_names


def test_algo_registries_hold_exactly_the_declared_names():
    assert advantages.ADVANTAGE_ESTIMATORS.names() == sorted(algo_names.ADV_ESTIMATORS)
    assert kl.KL_ESTIMATORS.names() == sorted(algo_names.KL_TYPES)
    assert losses.POLICY_LOSSES.names() == sorted(algo_names.POLICY_LOSS_MODES)
    assert sorted(n for n in algo_names.ADV_ESTIMATORS if "norm_by_std" in advantages.estimator_inputs(n)) == \
        sorted(algo_names.NORM_BY_STD_READERS)


def test_a_registry_refuses_an_undeclared_name():
    registry: Registry[int] = Registry("some.key", ("a",))
    registry.add("a", 1)
    with pytest.raises(ValueError, match=r"some.key: 'b' is not a declared name \(a\)"):
        registry.add("b", 2)


def test_every_kl_controller_and_agg_mode_is_built():
    for kind in algo_names.KL_CTRL_TYPES:
        kl.make_kl_controller(kind, kl_coef=0.1, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError, match="known: adaptive, fixed"):
        kl.make_kl_controller("other", kl_coef=0.1)
    assert losses.AGG_MODES is algo_names.AGG_MODES


def test_rollout_reward_and_worker_tables_cover_the_declared_names():
    from grpo_npu import rollout

    assert set(rollout._BUILDERS) == set(rollout_names.ROLLOUT_NAMES)
    assert set(vllm_settings._LOAD_FORMATS) == set(rollout_names.LOAD_FORMATS)
    assert set(manager.REWARD_MANAGERS) == set(reward_names.REWARD_MANAGER_NAMES)
    assert set(device.DTYPES) | {"auto"} == set(workers_names.DTYPE_NAMES)
    for name in workers_names.DTYPE_NAMES:  # every name resolves, for training and for the engine
        for kind in ("cpu", "cuda"):
            fsdp.resolve_dtype(name, device.Device(kind))
            device.Device(kind).engine_dtype(name)
    for impl in workers_names.OPTIM_IMPLS:
        assert optim.resolve_impl(impl, "cpu") in workers_names.OPTIM_IMPLS
    for style in workers_names.WARMUP_STYLES:
        optim.lr_multiplier(5, total_steps=10, warmup=2, style=style, min_lr_ratio=0.0, num_cycles=0.5)


def test_top_level_names_match_their_modules():
    from grpo_npu import device
    from grpo_npu.tracking import sinks

    assert tuple(sinks.SINKS) == top_names.LOGGERS
    assert device.DEVICE_CHOICES == ("auto", *top_names.DEVICE_KINDS)
    assert device.resolve_kind("cpu") == "cpu"


def test_parsing_a_config_imports_no_torch():
    """The entry points set process-environment defaults before torch loads: the config must not load it."""
    code = (
        "import sys\n"
        "from grpo_npu.config import ConfigError, help_text, load_config\n"
        "load_config(['actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1', 'trainer.n_gpus_per_node=1'])\n"
        "help_text()\n"
        "try:\n"
        "    load_config(['data.train_batchsize=3'])\n"
        "except ConfigError:\n"
        "    pass\n"
        "import grpo_npu.names, grpo_npu.algo.names, grpo_npu.data.names, grpo_npu.reward.names\n"
        "import grpo_npu.rollout.names, grpo_npu.workers.names\n"
        "assert 'torch' not in sys.modules, 'parsing the config imported torch'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(grpo_npu.__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
