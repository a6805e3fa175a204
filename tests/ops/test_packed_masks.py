"""Packed (remove-padding) batches reach the grpo_npu attention without a (T, T) mask (issue 17 section 4).

transformers builds a block-diagonal (1, 1, T, T) bool mask from packed position ids for SDPA-style
implementations; the fused kernel ignores it when the segments come as cu_seq_lens, and at 16k tokens it
is gigabytes. The attention sees what the model hands it through a spy registered in its place.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from grpo_npu.ops import patch_model
from grpo_npu.ops.attention import cu_seqlens_from_lengths
from grpo_npu.ops.patch import ATTN_IMPLEMENTATION, hf_attention_forward, packed_segments, packing_aware_mask

from .test_patch import BRANCHES, LAYERS, _tiny


@pytest.fixture
def seen_masks(monkeypatch):
    """Patch-time registration, then a spy in front of the grpo_npu attention recording each mask it gets."""
    class Seen(list):
        install = None

    seen = Seen()

    def spy(module, q, k, v, attention_mask, **kwargs):
        seen.append(attention_mask)
        return hf_attention_forward(module, q, k, v, attention_mask, **kwargs)

    def install(model):
        patch_model(model)
        monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION, spy)
        return model

    seen.install = install
    return seen


def _packed(lengths):
    seqs = [torch.randint(0, 97, (1, n)) for n in lengths]
    return seqs, torch.cat(seqs, dim=1), torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("branch", BRANCHES)
def test_packed_batch_with_cu_seq_lens_gets_no_mask(branch, request, seen_masks):
    request.getfixturevalue(branch)
    lengths = [300, 1, 211]  # T = 512: the old path handed every layer a (1, 1, 512, 512) mask
    model = _tiny("qwen2", max_position_embeddings=512)
    seqs, ids, pos = _packed(lengths)
    separate = torch.cat([model(input_ids=s).logits for s in seqs], dim=1).detach()
    seen_masks.install(model)
    cu = cu_seqlens_from_lengths(lengths)
    packed = model(input_ids=ids, position_ids=pos, use_cache=False,  # as the actor calls it (response_model.py)
                   cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)).logits
    assert len(seen_masks) == LAYERS and all(mask is None for mask in seen_masks)
    torch.testing.assert_close(packed.detach(), separate, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("use_cache", [False, True])  # with a (fresh) cache transformers does not look for packing
def test_position_id_packing_alone_isolates_sequences_without_a_mask(branch, use_cache, request, seen_masks):
    request.getfixturevalue(branch)
    lengths = [5, 1, 7]
    model = _tiny("qwen3")
    seqs, ids, pos = _packed(lengths)
    separate = torch.cat([model(input_ids=s).logits for s in seqs], dim=1).detach()
    seen_masks.install(model)
    packed = model(input_ids=ids, position_ids=pos, use_cache=use_cache).logits
    assert all(mask is None for mask in seen_masks)
    torch.testing.assert_close(packed.detach(), separate, atol=2e-5, rtol=1e-4)
    if branch == "fake_npu":  # the varlen (TND) call, once per layer
        assert request.getfixturevalue("fake_npu").calls["npu_fusion_attention"] == LAYERS


def test_padded_and_cached_batches_still_get_their_mask():
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    padded = packing_aware_mask(batch_size=2, q_length=6, kv_length=6, attention_mask=mask)
    assert padded.shape == (2, 1, 6, 6) and not padded[0, 0, :, :2].any()
    history = packing_aware_mask(batch_size=1, q_length=2, kv_length=6, q_offset=4, attention_mask=None,
                                 allow_is_causal_skip=False)
    assert history.shape == (1, 1, 2, 6)  # a chunk after cached tokens: bottom-right causal, built as before
    assert packing_aware_mask(batch_size=1, q_length=6, kv_length=6, attention_mask=None) is None


def test_packed_segments_from_position_ids():
    assert packed_segments(torch.arange(6)[None], 1, 6) is None  # one sequence per row: plain causal
    assert packed_segments(None, 1, 6) is None
    pos = torch.tensor([[0, 1, 2, 0, 0, 1]])
    assert packed_segments(pos, 1, 6).tolist() == [0, 3, 4, 6]
    rows = torch.tensor([[0, 1, 0], [0, 1, 2]])  # two rows: each row starts a sequence too
    assert packed_segments(rows, 2, 3).tolist() == [0, 2, 3, 6]
