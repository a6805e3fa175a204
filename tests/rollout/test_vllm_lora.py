"""AdapterSync's stream handling without an engine: base once, adapters each time, base again after a discarding sleep."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.rollout.vllm_lora import AdapterSync, max_lora_rank

PEFT = {"r": 8, "lora_alpha": 16, "target_modules": {"q_proj", "v_proj"}}
BASE = [("model.layers.0.self_attn.q_proj.weight", torch.ones(4, 4)), ("model.norm.weight", torch.ones(4))]
ADAPTERS = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(8, 4)),
            ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(4, 8))]


class FakeLLM:
    def __init__(self):
        self.calls = []

    def collective_rpc(self, fn, args=()):
        lora_id, peft, tensors = args
        self.calls.append((fn.__name__, lora_id, peft, sorted(tensors)))
        return [len(tensors)]


def _loader(loaded):
    def load(stream):
        names = [n for n, _ in stream]
        loaded.append(names)
        return len(names)
    return load


def test_base_once_then_adapters_with_a_new_id_each_sync():
    sync, llm, loaded = AdapterSync(PEFT), FakeLLM(), []
    assert sync.peft_config["target_modules"] == ["q_proj", "v_proj"]  # a set is not JSON: sorted list
    with pytest.raises(RuntimeError, match="no adapter yet"):
        sync.request()
    with pytest.raises(ValueError, match="no base weights yet"):
        sync.update(llm, iter(ADAPTERS), _loader(loaded))
    assert sync.update(llm, iter(BASE + ADAPTERS), _loader(loaded)) == {"base": 2, "adapters": 2}
    assert loaded == [[n for n, _ in BASE]] and sync.has_base
    assert sync.update(llm, iter(ADAPTERS), _loader(loaded)) == {"base": 0, "adapters": 2}
    assert len(loaded) == 1  # the base was not loaded again
    assert [c[1] for c in llm.calls] == [1, 2] and sync.request().lora_int_id == 2
    sync.weights_discarded()  # sleep level 2
    with pytest.raises(ValueError, match="no base weights yet"):
        sync.update(llm, iter(ADAPTERS), _loader(loaded))


def test_a_stream_out_of_order_or_without_adapters_is_refused():
    sync, llm = AdapterSync(PEFT), FakeLLM()
    with pytest.raises(ValueError, match="after the adapter tensors"):
        sync.update(llm, iter(BASE[:1] + ADAPTERS + BASE[1:]), _loader([]))
    with pytest.raises(ValueError, match="no adapter tensors"):
        AdapterSync(PEFT).update(llm, iter(BASE), _loader([]))
    with pytest.raises(ValueError, match="no tensors"):
        AdapterSync(PEFT).update(llm, iter(()), _loader([]))


def test_max_lora_rank_rounds_up_to_a_rank_vllm_allows():
    pytest.importorskip("vllm")
    assert max_lora_rank(8) == 8
    assert max_lora_rank(12) == 16
    assert max_lora_rank(32) == 32
