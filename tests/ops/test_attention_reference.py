"""The attention op's reference path: its cached masks, and shared-prompt groups (``prefix_groups``) == a naive
softmax over each row's own tokens written here, forward and backward, whichever way each group is computed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpo_npu.ops import attention as op
from grpo_npu.ops import attention_reference as ref

from .test_attention import _causal_keep


def test_causal_bias_is_sdpas_own_conversion_of_the_bool_mask():
    keep = _causal_keep(3, 5)
    bias = ref.causal_bias(3, 5, torch.float32, torch.device("cpu"))
    assert bias is ref.causal_bias(3, 5, torch.float32, torch.device("cpu"))
    assert torch.equal(bias, torch.where(keep, 0.0, float("-inf")))


def test_bottom_right_causal_masks_cached_only_when_small():
    small = ref.bottom_right_causal(3, 5, torch.device("cpu"))
    assert small is ref.bottom_right_causal(3, 5, torch.device("cpu"))
    torch.testing.assert_close(small, _causal_keep(3, 5))
    side = int(ref.CACHED_MASK_ELEMENTS**0.5) + 1
    big = ref.bottom_right_causal(side, side, torch.device("cpu"))
    assert big is not ref.bottom_right_causal(side, side, torch.device("cpu"))
    torch.testing.assert_close(big, _causal_keep(side, side))


def _packed(groups, nq=4, nkv=2, d=16, dtype=torch.float64):
    """Tokens of ``groups`` packed as shared-prompt packing lays them out, with the op's segment arguments, and
    (T, T) keep: True where a token may attend another (its prompt, and causally its own prompt or response)."""
    owner, first = [], []  # per token: its segment id, and the first token of its prompt; prompts own segment -1
    q_lens, k_lens, kv_index, cursor = [], [], [], 0
    for prompt_len, response_lens in groups:
        prompt = list(range(cursor, cursor + prompt_len))
        q_lens.append(prompt_len)
        k_lens.append(prompt_len)
        kv_index += prompt
        owner += [("p", cursor)] * prompt_len
        first += [cursor] * prompt_len
        start = cursor + prompt_len
        for r in response_lens:
            q_lens.append(r)
            k_lens.append(prompt_len + r)
            kv_index += prompt + list(range(start, start + r))
            owner += [("r", start)] * r
            first += [cursor] * r
            start += r
        cursor = start
    t = cursor
    keep = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        for j in range(t):
            in_prompt = owner[j] == ("p", first[i])
            same = owner[j] == owner[i]
            keep[i, j] = (in_prompt and (owner[i][0] == "r" or j <= i)) or (same and j <= i)
    q = torch.randn(t, nq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(t, nkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(t, nkv, d, dtype=dtype, requires_grad=True)
    args = {"cu_seqlens": op.cu_seqlens_from_lengths(q_lens), "cu_seqlens_k": op.cu_seqlens_from_lengths(k_lens),
            "kv_index": torch.tensor(kv_index), "prefix_groups": tuple((p, tuple(r)) for p, r in groups)}
    return q, k, v, keep, args


def _naive(q, k, v, keep, scale):
    """(T, N, D) attention of every token over the tokens ``keep`` allows it."""
    group = q.shape[1] // k.shape[1]
    kd, vd = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("tnd,snd->nts", q, kd) * scale
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    return torch.einsum("nts,snd->tnd", p, vd)


LAYOUTS = {
    "grpo_small": [(7, (3, 5, 2, 4)), (9, (6, 1, 3, 2))],  # short groups: one masked call each
    "long": [(40, (90, 70)), (3, (100,))],  # long responses: per-segment calls
    "mixed": [(5, (2, 3)), (60, (80, 80, 80)), (0, (4, 2)), (6, ())],  # both, an empty prompt, a prompt alone
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_prefix_groups_match_naive_fwd_bwd(name, reference_backend):
    q, k, v, keep, args = _packed(LAYOUTS[name])
    scale = 0.25
    got = op.attention(q, k, v, causal=True, scale=scale, **args)
    want = _naive(q, k, v, keep, scale)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b)


def test_prefix_groups_equal_the_gathered_segments_in_fp32(reference_backend):
    """The same call without the groups (keys gathered, one call per segment): equal up to fp32 rounding."""
    q, k, v, _, args = _packed(LAYOUTS["mixed"], dtype=torch.float32)
    got = op.attention(q, k, v, causal=True, **args)
    args.pop("prefix_groups")
    torch.testing.assert_close(got, op.attention(q, k, v, causal=True, **args), rtol=1e-5, atol=1e-5)


def test_each_group_takes_one_call_only_where_it_pays(reference_backend, monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[0].shape) or sdpa(*a, **kw))
    groups = LAYOUTS["mixed"]
    pays = [ref.one_call_pays(p, r, 4 * 32) for p, r in groups]
    assert pays == [True, False, True, False]  # a prompt alone is one segment either way
    q, k, v, _, args = _packed(groups, d=32)
    op.attention(q, k, v, causal=True, **args)
    # one call for each paying group and the lone prompt; the long group's prompt and three responses one each
    assert len(calls) == 3 + 4


def test_one_call_pays_follows_the_measured_crossover():
    """The rule on shapes measured on the CPU (docs/performance.md): one call won at the first three, lost at the
    last three."""
    assert ref.one_call_pays(37, (13,) * 4, 4 * 32)  # 0.43x the segments' time
    assert ref.one_call_pays(64, (32,) * 4, 4 * 32)  # 0.73x
    assert ref.one_call_pays(37, (13,) * 4, 14 * 64)  # 0.75x at the 0.5B model's heads
    assert not ref.one_call_pays(64, (64,) * 4, 4 * 32)  # 1.37x
    assert not ref.one_call_pays(64, (32,) * 4, 14 * 64)  # 1.28x
    assert not ref.one_call_pays(20, (100,) * 4, 4 * 32)  # 1.45x


def test_no_group_over_the_token_cap_takes_one_call(monkeypatch):
    """600 one-token responses would pass the cost rule; the cap keeps their mask from growing with L^2."""
    many = (1,) * 600
    assert not ref.one_call_pays(1, many, 1)
    monkeypatch.setattr(ref, "ONE_CALL_MAX_TOKENS", 10**6)
    assert ref.one_call_pays(1, many, 1)


def test_prefix_group_masks_are_built_once_per_layout(reference_backend):
    q, k, v, _, args = _packed(LAYOUTS["grpo_small"])
    op.attention(q, k, v, causal=True, **args)
    first = ref._plan(args["prefix_groups"], 64, q.dtype, q.device)
    args["prefix_groups"] = [(p, list(r)) for p, r in args["prefix_groups"]]  # an equal layout, rebuilt
    op.attention(q, k, v, causal=True, **args)
    assert ref._plan(args["prefix_groups"], 64, q.dtype, q.device) is first


def test_prefix_groups_on_the_npu_branch_gather_and_match(fake_npu):
    """The NPU kernel takes the gathered segments; the groups do not change its result."""
    q, k, v, keep, args = _packed(LAYOUTS["mixed"], dtype=torch.float32)
    got = op.attention(q, k, v, causal=True, scale=0.25, **args)
    torch.testing.assert_close(got, _naive(q.double(), k.double(), v.double(), keep, 0.25).float(),
                               rtol=1e-4, atol=1e-4)
    assert fake_npu.calls


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(prefix_groups=((7, (3, 5, 2, 4)), (9, (6, 1, 3)))), "not this call's segments"),
    (lambda a: a.pop("kv_index"), "needs kv_index"),
    (lambda a: a.update(prefix_groups=((7, (3, 0, 2, 4)), (9, (6, 1, 3, 2)))), "response lengths > 0"),
    (lambda a: a.update(kv_index=a["kv_index"][None]), "kv_index must be"),
])
def test_prefix_groups_reject_a_wrong_layout(change, message, reference_backend):
    q, k, v, _, args = _packed(LAYOUTS["grpo_small"])
    change(args)
    with pytest.raises(ValueError, match=message):
        op.attention(q, k, v, causal=True, **args)
