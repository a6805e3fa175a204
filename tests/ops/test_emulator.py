"""The emulator itself: signatures equal to the torch_npu schemas, documented semantics, strictness."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F

from . import fake_torch_npu as npu


def _parse_schema(schema: str) -> tuple[str, list[tuple[str, object]]]:
    """'name(Type a, Type b=default, ...) -> ret' -> (name, [(param, default or EMPTY)])."""
    name, params = re.fullmatch(r"(\w+)\((.*)\) -> .*", schema).groups()
    out = []
    for item in params.split(", "):
        if item == "*":
            continue
        decl, _, default = item.partition("=")
        pname = decl.split()[-1]
        out.append((pname, _literal(default) if default else inspect.Parameter.empty))
    return name, out


def _literal(text: str) -> object:
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    if text[0] in "'\"":
        return text[1:-1]
    return float(text) if any(c in text for c in ".e") else int(text)


@pytest.mark.parametrize("op", sorted(npu.SCHEMAS))
def test_signature_matches_schema(op):
    name, params = _parse_schema(npu.SCHEMAS[op])
    assert name == op
    sig = inspect.signature(getattr(npu, op))
    got = [(p.name, p.default) for p in sig.parameters.values()]
    assert [n for n, _ in got] == [n for n, _ in params]
    for (pname, want), (_, have) in zip(params, got):
        assert have == want and type(have) is type(want), f"{op}.{pname}: default {have!r} != schema {want!r}"


def test_rms_norm_returns_y_and_fp32_rstd():
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    g = torch.randn(8, dtype=torch.bfloat16)
    y, rstd = npu.npu_rms_norm(x, g, 1e-5)
    xf = x.float()
    want_rstd = 1 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1)
    torch.testing.assert_close(rstd, want_rstd)
    torch.testing.assert_close(y, (xf * want_rstd).to(torch.bfloat16) * g)


def test_rms_norm_rejects_wrong_keyword_and_dtype_mix():
    x, g = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(TypeError):
        npu.npu_rms_norm(x, g, eps=1e-6)  # the schema names it epsilon
    with pytest.raises(npu.NpuKernelError, match="gamma dtype"):
        npu.npu_rms_norm(x, g.bfloat16())
    with pytest.raises(npu.NpuKernelError, match="2-8 dims"):
        npu.npu_rms_norm(torch.randn(8), g)


def test_rotary_mul_semantics_and_broadcasts():
    x = torch.randn(2, 3, 5, 8)  # BNSD
    cos, sin = torch.rand(2, 1, 5, 8), torch.rand(2, 1, 5, 8)
    x1, x2 = x.chunk(2, -1)
    torch.testing.assert_close(npu.npu_rotary_mul(x, cos, sin), x * cos + torch.cat((-x2, x1), -1) * sin)
    npu.npu_rotary_mul(x, cos[:1], sin[:1])  # 11SD
    with pytest.raises(npu.NpuKernelError, match="broadcast"):
        npu.npu_rotary_mul(x, cos.transpose(1, 2), sin.transpose(1, 2))  # (B, S, 1, D) against BNSD
    with pytest.raises(npu.NpuKernelError, match="4-D"):
        npu.npu_rotary_mul(x, cos[:, 0], sin[:, 0])  # HF's raw (B, S, D)
    with pytest.raises(npu.NpuKernelError, match="documented"):
        npu.npu_rotary_mul(x, torch.rand(1, 1, 1, 8), torch.rand(1, 1, 1, 8))
    with pytest.raises(npu.NpuKernelError, match="even"):
        npu.npu_rotary_mul(torch.randn(1, 1, 2, 7), torch.rand(1, 1, 2, 7), torch.rand(1, 1, 2, 7))


def test_swiglu_gates_first_half_and_needs_contiguous():
    x = torch.randn(4, 6)
    torch.testing.assert_close(npu.npu_swiglu(x), F.silu(x[:, :3]) * x[:, 3:])
    with pytest.raises(npu.NpuKernelError, match="contiguous"):
        npu.npu_swiglu(torch.randn(6, 4).t())


def _naive(q, k, v, scale, keep):  # BNSD, keep True = attend
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


def test_fusion_attention_scale_default_and_mask_polarity():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out = npu.npu_fusion_attention(q, k, v, 4, "BNSD")[0]
    torch.testing.assert_close(out, _naive(q, k, v, 1.0, torch.ones(5, 5, dtype=torch.bool)))
    masked = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)  # True = masked out
    out = npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=masked, scale=0.3)[0]
    torch.testing.assert_close(out, _naive(q, k, v, 0.3, ~masked))


def test_fusion_attention_sparse_modes():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    full = npu.npu_fusion_attention(q, k, v, 2, "BNSD", sparse_mode=3)[0]  # no mask: sparse_mode ignored
    torch.testing.assert_close(full, _naive(q, k, v, 1.0, torch.ones(3, 6, dtype=torch.bool)))
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    right = npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=compressed, sparse_mode=3)[0]
    torch.testing.assert_close(right, _naive(q, k, v, 1.0, torch.ones(3, 6, dtype=torch.bool).tril(3)))
    left = npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=compressed, sparse_mode=2)[0]
    torch.testing.assert_close(left, _naive(q, k, v, 1.0, torch.ones(3, 6, dtype=torch.bool).tril(0)))
    with pytest.raises(npu.NpuKernelError, match="compressed"):
        npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=compressed[:64, :64], sparse_mode=3)


def test_fusion_attention_tnd_offsets():
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    out = npu.npu_fusion_attention(
        q, k, v, 2, "TND", atten_mask=compressed, sparse_mode=3, actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5]
    )[0]
    for s, e in ((0, 2), (2, 5)):
        seg = [t[s:e].transpose(0, 1)[None] for t in (q, k, v)]
        want = _naive(*seg, 1.0, torch.ones(e - s, e - s, dtype=torch.bool).tril())[0].transpose(0, 1)
        torch.testing.assert_close(out[s:e], want)
    kwargs = {"atten_mask": compressed, "sparse_mode": 3}
    with pytest.raises(npu.NpuKernelError, match="leading 0"):
        npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[0, 2, 5], actual_seq_kvlen=[0, 2, 5], **kwargs)
    with pytest.raises(npu.NpuKernelError, match="host list"):
        npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=torch.tensor([2, 5]), actual_seq_kvlen=[2, 5], **kwargs)
    with pytest.raises(npu.NpuKernelError, match="ends at 4"):
        npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[2, 4], actual_seq_kvlen=[2, 4], **kwargs)
    # documented: trailing zeros mark batches that do not take part
    npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[2, 5, 0], actual_seq_kvlen=[2, 5, 0], **kwargs)


def test_fusion_attention_layout_checks():
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)  # BSND
    with pytest.raises(npu.NpuKernelError, match="head_num"):
        npu.npu_fusion_attention(q, k, v, 2, "BSND")
    with pytest.raises(npu.NpuKernelError, match="BNSS/B1SS/11SS/SS"):
        npu.npu_fusion_attention(q, k, v, 4, "BSND", atten_mask=torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(npu.NpuKernelError, match="multiple"):
        npu.npu_fusion_attention(q[:, :, :3], k, v, 3, "BSND")
    q2, k2, v2 = (t.expand(2, -1, -1, -1) for t in (q, k, v))
    with pytest.raises(npu.NpuKernelError, match="BNSS/B1SS/11SS/SS"):  # 1NSS is not among the documented shapes
        npu.npu_fusion_attention(q2, k2, v2, 4, "BSND", atten_mask=torch.zeros(1, 4, 5, 5, dtype=torch.bool))
    for shape in ((2, 4, 5, 5), (2, 1, 5, 5), (1, 1, 5, 5), (5, 5)):
        npu.npu_fusion_attention(q2, k2, v2, 4, "BSND", atten_mask=torch.zeros(shape, dtype=torch.bool))
    bsh = npu.npu_fusion_attention(q.flatten(2), k.flatten(2), v.flatten(2), 4, "BSH")[0]
    bsnd = npu.npu_fusion_attention(q, k, v, 4, "BSND")[0]
    torch.testing.assert_close(bsh, bsnd.flatten(2))


def test_cross_entropy_loss_outputs_and_limits():
    x, t = torch.randn(6, 11, requires_grad=True), torch.randint(0, 11, (6,))
    loss, log_prob, zloss, lse = npu.npu_cross_entropy_loss(x, t, reduction="none")
    torch.testing.assert_close(loss, F.cross_entropy(x, t, reduction="none"))
    torch.testing.assert_close(log_prob, torch.log_softmax(x, -1))
    assert not log_prob.requires_grad and zloss.numel() == 0 and lse.numel() == 0
    mean = npu.npu_cross_entropy_loss(x, t)[0]
    assert mean.shape == (1,)
    torch.testing.assert_close(mean[0], F.cross_entropy(x, t))
    with pytest.raises(npu.NpuKernelError, match="int64"):
        npu.npu_cross_entropy_loss(x, t.int(), reduction="none")
    with pytest.raises(npu.NpuKernelError, match="defaults|default"):
        npu.npu_cross_entropy_loss(x, t, label_smoothing=0.1)
    with pytest.raises(npu.NpuKernelError, match="N=200001"):
        npu.npu_cross_entropy_loss(torch.zeros(200_001, 1), torch.zeros(200_001, dtype=torch.long), reduction="none")
