"""Two Ray workers with gloo (what CI runs) against one in-process rank: same log-probs, values, losses,
updated weights and checkpoints; dynamic batch sizes that differ per rank; errors that name the rank.

One Ray launch for the whole module (starting Ray and two worker processes costs ~15 s).
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from grpo_npu.batch import RolloutBatch
from grpo_npu.rollout import training_sampling
from grpo_npu.workers import LocalGroup, RayGroup, WorkerError
from grpo_npu.workers.hybrid import HybridWorker

from .helpers import make_batch, make_cfg

pytestmark = pytest.mark.slow

# Same-model fp32 passes whose reductions run in another order (sharded vs whole parameters).
ATOL = 1e-5
# Every role at once: GAE builds a critic, the KL loss a reference; actor passes pack by a token budget
# small enough that the rank holding the long rows needs more micro-batches than the other.
OVERRIDES = (
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",
    "actor_rollout_ref.model.use_remove_padding=True",
    "critic.use_dynamic_bsz=False",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.optim.lr=1e-4",
)


def _long_rows_first(batch: RolloutBatch) -> RolloutBatch:
    """Rows sorted by length, longest first: rank 0's chunk is long, rank 1's short."""
    order = torch.argsort(batch.attention_mask.sum(1), descending=True, stable=True)
    return batch.select(order)


@pytest.fixture(scope="module")
def groups(tiny_model_path):
    local = LocalGroup(HybridWorker, device_kind="cpu", args=(make_cfg(tiny_model_path, *OVERRIDES),))
    try:
        ray_group = RayGroup(HybridWorker, world_size=2, device_kind="cpu", ray_num_cpus=2,
                             args=(make_cfg(tiny_model_path, *OVERRIDES, world_size=2),))
    except BaseException:
        local.close()
        raise
    try:
        yield local, ray_group
    finally:
        ray_group.close()
        local.close()


def _cat(results):
    return torch.cat([r if isinstance(r, torch.Tensor) else r[0] for r in results])


def test_two_ranks_equal_one_rank(groups, tiny_model_path, tmp_path):
    local, ray_group = groups
    assert local.call("init_model", 10) == [{"actor": True, "ref": True, "critic": True, "rollout": True}]
    assert ray_group.call("init_model", 10) == [{"actor": True, "ref": True, "critic": True, "rollout": True}] * 2
    batch = _long_rows_first(make_batch(seed=30))

    # generation: ranks hold prompts of different lengths and finish at different steps
    sampling = training_sampling(make_cfg(tiny_model_path).actor_rollout_ref.rollout, response_length=5, seed=1)
    outs = ray_group.call_ranks("generate", [(batch.prompt_ids[:2], batch.prompt_mask[:2], sampling),
                                             (batch.prompt_ids[6:], batch.prompt_mask[6:], sampling)])
    assert [o.response_ids.shape[0] for o in outs] == [4, 4]

    # forward passes
    (logp_1, metrics_1, _), = local.chunk_and_call("compute_log_prob", batch)
    results_2 = ray_group.chunk_and_call("compute_log_prob", batch)
    torch.testing.assert_close(_cat(results_2), logp_1, atol=ATOL, rtol=0)
    assert results_2[0][1]["actor/entropy"] == results_2[1][1]["actor/entropy"]
    assert results_2[0][1]["actor/entropy"] == pytest.approx(metrics_1["actor/entropy"], rel=1e-5)
    ref_1 = local.chunk_and_call("compute_ref_log_prob", batch)[0]
    torch.testing.assert_close(_cat(ray_group.chunk_and_call("compute_ref_log_prob", batch)), ref_1, atol=ATOL, rtol=0)
    values_1 = local.chunk_and_call("compute_values", batch)[0]
    torch.testing.assert_close(_cat(ray_group.chunk_and_call("compute_values", batch)), values_1, atol=ATOL, rtol=0)

    # one actor step and one critic step
    returns = (torch.linspace(-1, 1, batch.response_ids.shape[1]) * batch.response_mask).contiguous()
    train = batch.replace(old_logp=logp_1, ref_logp=ref_1 - 0.05 * batch.response_mask, values=values_1, returns=returns)
    m1 = local.chunk_and_call("update_actor", train)[0]
    m2 = ray_group.chunk_and_call("update_actor", train)
    assert m2[0] == m2[1]  # metrics are reduced over ranks
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert m2[0][key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    c1 = local.chunk_and_call("update_critic", train)[0]
    c2 = ray_group.chunk_and_call("update_critic", train)[0]
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac"):
        assert c2[key] == pytest.approx(c1[key], rel=1e-5, abs=1e-7), key

    # updated weights, exported in HF format (rank 0 writes, both ranks gather)
    local.call("export_hf", str(tmp_path / "one"))
    ray_group.call("export_hf", str(tmp_path / "two"))
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert one.keys() == two.keys() and "lm_head.weight" not in one  # tied: stored once, as HF does
    for name in one:
        # SGD-like first step (optim.eps=1): weights differ by ~lr x gradient rounding.
        torch.testing.assert_close(two[name], one[name], atol=1e-7, rtol=0, msg=name)

    # sharded checkpoint: save, train on, load -> back to the saved weights
    ray_group.call("save_checkpoint", str(tmp_path / "ckpt"), 1)
    ray_group.chunk_and_call("update_actor", train)
    assert ray_group.call("load_checkpoint", str(tmp_path / "ckpt")) == [1, 1]
    ray_group.call("export_hf", str(tmp_path / "restored"))
    restored = load_file(tmp_path / "restored" / "model.safetensors")
    for name in two:
        torch.testing.assert_close(restored[name], two[name], atol=0, rtol=0, msg=name)


def test_worker_errors_name_rank_and_method(groups):
    _, ray_group = groups
    with pytest.raises(WorkerError, match=r"rank [01] failed in update_actor\(\)(.|\n)*needs advantages") as info:
        ray_group.chunk_and_call("update_actor", make_batch(seed=31).replace(advantages=None))
    assert info.value.rank in (0, 1)
    with pytest.raises(ValueError, match="2 ranks, got 1"):
        ray_group.call_ranks("compute_values", [(make_batch(),)])


def test_closing_stops_the_cluster_with_sigkill_and_leaves_no_process(groups, monkeypatch):
    """Last in the module: it closes the module's group. The cluster's processes run with SIGTERM blocked, so
    Ray's graceful stop (SIGTERM, up to 1 s per process, then SIGKILL) only waited, 5 s a run: close() has Ray
    stop them with SIGKILL at once. Nothing of the cluster is left running: not the raylet's agents, which outlive
    a raylet killed at once, nor the ranks."""
    from ray._private.node import Node

    from grpo_npu.workers.reaper import alive, descendants, ray_node_pids

    _, ray_group = groups
    cluster = descendants(ray_node_pids())  # Ray's own processes, its agents and the ranks
    graceful = []
    stop = Node.kill_all_processes

    def recorded(node, check_alive=True, allow_graceful=False, wait=False):
        graceful.append(allow_graceful)
        return stop(node, check_alive=check_alive, allow_graceful=allow_graceful, wait=wait)

    monkeypatch.setattr(Node, "kill_all_processes", recorded)
    ray_group.close()
    assert graceful == [False]
    deadline = time.monotonic() + 30  # a bound for a loaded host, not a speed target
    while any(alive(p) for p in cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(cluster) >= 5 and not [p for p in cluster if alive(p)]
