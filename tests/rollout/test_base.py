"""Shared pieces of the interface: sampling validation, prompt unpadding, response packing."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.rollout.base import SamplingConfig, pack_responses, unpad_prompts


@pytest.mark.parametrize("bad, message", [
    (dict(n=0), "n=0"), (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_p=0.0), "top_p=0.0"), (dict(top_k=-2), "top_k=-2"),
])
def test_sampling_config_rejects_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**bad)


def test_greedy_and_prompt_seeds():
    assert SamplingConfig(temperature=0.0).greedy and SamplingConfig(do_sample=False).greedy
    assert not SamplingConfig().greedy
    seeded = SamplingConfig(n=4, seed=100)
    assert [seeded.prompt_seed(i) for i in range(3)] == [100, 104, 108]  # sample j of prompt i: 100 + 4i + j
    assert SamplingConfig(n=4).prompt_seed(2) is None


def test_unpad_prompts_keeps_the_real_tokens():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert unpad_prompts(ids, mask) == [[5, 6], [7, 8, 9, 1]]
    with pytest.raises(ValueError, match="must both be"):
        unpad_prompts(ids, mask[:, :3])


def test_pack_responses_right_pads():
    out = pack_responses([[4, 5, 2], [6], [7, 8, 9, 10]], ["stop", "length", "length"], pad_token_id=0,
                         logprobs=[[-1.0, -2.0, -3.0], [-4.0], [-5.0, -6.0, -7.0, -8.0]])
    assert out.response_ids.tolist() == [[4, 5, 2, 0], [6, 0, 0, 0], [7, 8, 9, 10]]
    assert out.response_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert out.logprobs.tolist() == [[-1.0, -2.0, -3.0, 0.0], [-4.0, 0.0, 0.0, 0.0], [-5.0, -6.0, -7.0, -8.0]]
    assert out.stop_reason == ["stop", "length", "length"]
    assert pack_responses([[1]], ["length"], pad_token_id=0).logprobs is None
