"""trainer.nnodes on a real two-node Ray cluster (two raylets on this host, two CPUs each, so either node could
hold both ranks): nnodes=2 puts one rank on each node, nnodes=1 both on one, and the two runs log the same losses
and metrics; a cluster with fewer nodes than trainer.nnodes is refused in one line.

The cluster is started in-process with ``ray.cluster_utils.Cluster`` (no auth token needed for its second raylet)
and the trainer joins it through RAY_ADDRESS, as ``RAY_ADDRESS=... python -m grpo_npu.main_ppo`` would.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import pytest

from grpo_npu.config import load_config
from grpo_npu.data.synthetic import write_synthetic
from grpo_npu.errors import UserError
from grpo_npu.trainer import Trainer
from grpo_npu.workers import RayGroup
from grpo_npu.workers.hybrid import HybridWorker
from tests.test_trainer_e2e import NONDETERMINISTIC, overrides, read_metrics

pytestmark = pytest.mark.slow

# Room for both ranks on either node: a placement that packs ranks would put them on one.
CPUS_PER_NODE = 2
# Seconds a raylet may take to register with the head before the test gives up (they take ~2 s).
NODE_START_TIMEOUT_S = 60
# The job both runs share: GRPO with a KL loss (so the reference model runs on both ranks too).
JOB = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.use_kl_loss=True",
       "trainer.save_freq=-1", "trainer.ray_wait_register_center_timeout=120")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("task")
    write_synthetic(str(out), train_size=32, test_size=8, difficulty=1, seed=0, write_sft=False)
    return out


@contextlib.contextmanager
def two_node_cluster() -> Iterator[str]:
    """A head and one worker raylet with CPUS_PER_NODE each; RAY_ADDRESS points at it; all torn down after."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": False})
    before = os.environ.get("RAY_ADDRESS")
    try:
        cluster.add_node(num_cpus=CPUS_PER_NODE)
        cluster.wait_for_nodes(timeout=NODE_START_TIMEOUT_S)
        os.environ["RAY_ADDRESS"] = cluster.address
        yield cluster.address
    finally:
        if before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()  # SIGTERM, SIGKILL after a short wait; asserts that no process of a node is left


def train(cfg_overrides: list[str]) -> tuple[dict[int, dict], list[str], str]:
    """Metrics by step, the Ray node id of each rank and the driver's node id."""
    import ray

    trainer = Trainer(load_config(cfg_overrides))
    try:
        trainer.fit()
        node_ids = list(trainer.workers.group.node_ids)
        driver_node = ray.get_runtime_context().get_node_id()
    finally:
        trainer.close()
    return read_metrics(Path(trainer.run_dir)), node_ids, driver_node


def deterministic(metrics: dict[int, dict]) -> dict[int, dict]:
    return {step: {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)} for step, row in metrics.items()}


def test_two_nodes_one_rank_each_equal_one_node(tiny_model_path, task, tmp_path):
    with two_node_cluster():
        one_node, one_node_ids, _ = train(overrides(tiny_model_path, task, tmp_path / "one_node", *JOB,
                                                 "trainer.nnodes=1", "trainer.n_gpus_per_node=2"))
        two_nodes, two_node_ids, driver_node = train(overrides(tiny_model_path, task, tmp_path / "two_nodes", *JOB,
                                                  "trainer.nnodes=2", "trainer.n_gpus_per_node=1"))
    assert len(set(one_node_ids)) == 1, f"trainer.nnodes=1 spread its ranks: {one_node_ids}"
    assert len(set(two_node_ids)) == 2, f"trainer.nnodes=2 put both ranks on one node: {two_node_ids}"
    assert two_node_ids[0] == driver_node  # rank 0 writes its files beside the driver's

    assert sorted(two_nodes) == sorted(one_node) and max(one_node) == 2
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
        assert key in one_node[2], key
    # Same ranks, same seeds, same gloo collectives: only the node each rank runs on differs.
    assert deterministic(two_nodes) == deterministic(one_node)


def test_fewer_nodes_than_nnodes_is_one_line():
    with two_node_cluster():
        with pytest.raises(UserError, match=r"trainer.nnodes=3 needs 3 Ray nodes .* the cluster has 2 such node") \
                as info:
            RayGroup(HybridWorker, world_size=3, nnodes=3, device_kind="cpu", start_timeout_s=5)
        assert "\n" not in str(info.value)
        # a node too small for its share counts as missing: 3 ranks a node need 3 CPUs, these nodes have 2
        with pytest.raises(UserError, match=r"trainer.nnodes=2 needs 2 Ray nodes with \{'CPU': 3\} each, but the "
                                            r"cluster has 0 such node\(s\) \(2 alive\)"):
            RayGroup(HybridWorker, world_size=6, nnodes=2, device_kind="cpu", start_timeout_s=5)
