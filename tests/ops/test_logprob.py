"""Log-probs / entropy: chunked paths (reference and NPU emulator) == a full log_softmax written here."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.ops import dispatch
from grpo_npu.ops import linear as linear_op
from grpo_npu.ops import logprob as op


def _naive(logits, labels, temperature):
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


CASES = [  # (logits shape, temperature, chunk_size)
    ((7, 50), 1.0, None),
    ((7, 50), 0.7, 3),
    ((2, 5, 33), 1.3, 1),
    ((3, 4, 97), 1.0, 4),
    ((1, 1, 11), 0.5, 2),
]
BRANCHES = ["reference_backend", "fake_npu"]


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("shape,temperature,chunk", CASES)
def test_logprobs_and_entropy_match_naive_forward_backward(branch, shape, temperature, chunk, request):
    backend = request.getfixturevalue(branch)
    logits = (3 * torch.randn(shape)).requires_grad_()
    original = logits.detach().clone()
    labels = torch.randint(0, shape[-1], shape[:-1])
    logp, entropy = op.logprobs_from_logits(
        logits, labels, temperature=temperature, with_entropy=True, chunk_size=chunk
    )
    if branch == "fake_npu":
        assert backend.calls["npu_cross_entropy_loss"] >= 1
    assert logp.dtype == torch.float32 and logp.shape == labels.shape
    g_logp, g_ent = torch.randn_like(logp), torch.randn_like(entropy)
    (grad,) = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_ent).sum(), logits)
    assert torch.equal(logits.detach(), original)  # the in-place chunk arithmetic never touches the input

    x = logits.detach().double().requires_grad_()
    want_logp, want_ent = _naive(x, labels, temperature)
    (want_grad,) = torch.autograd.grad((want_logp * g_logp).sum() + (want_ent * g_ent).sum(), x)
    torch.testing.assert_close(logp, want_logp.float())
    torch.testing.assert_close(entropy, want_ent.float())
    torch.testing.assert_close(grad, want_grad.float())


@pytest.mark.parametrize("branch", BRANCHES)
def test_logp_only_and_strided_slice(branch, request):
    request.getfixturevalue(branch)
    full = torch.randn(3, 8, 40, requires_grad=True)
    logits = full[:, 2:-1]  # the actor's response slice: a strided view, read without a copy
    labels = torch.randint(0, 40, (3, 5))
    logp = op.logprobs_from_logits(logits, labels, chunk_size=2)
    (grad,) = torch.autograd.grad(logp.sum(), full)
    x = full.detach().double().requires_grad_()
    want = _naive(x[:, 2:-1], labels, 1.0)[0]
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(logp, want.float())
    torch.testing.assert_close(grad, want_grad.float())


def test_bf16_logits_give_fp32_logp(reference_backend):
    logits = torch.randn(6, 64).bfloat16()
    labels = torch.randint(0, 64, (6,))
    logp = op.logprobs_from_logits(logits, labels)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, _naive(logits.float(), labels, 1.0)[0].float())


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("hidden_shape,temperature,chunk", [((9, 16), 1.0, 4), ((2, 3, 16), 0.6, 1), ((5, 16), 1.0, None)])
@pytest.mark.parametrize("onednn", [False, True])
def test_linear_logprobs_match_naive_forward_backward(branch, with_entropy, hidden_shape, temperature, chunk, onednn,
                                                      request, monkeypatch):
    request.getfixturevalue(branch)
    if onednn and not linear_op.onednn_available():
        pytest.skip("torch has no usable oneDNN linear")
    products = []
    real_mm = linear_op._mm
    monkeypatch.setattr(linear_op, "_mm", lambda *a: products.append(1) or real_mm(*a))
    vocab = 37
    hidden = torch.randn(hidden_shape, requires_grad=True)
    weight = (0.5 * torch.randn(vocab, hidden_shape[-1])).requires_grad_()
    labels = torch.randint(0, vocab, hidden_shape[:-1])
    with dispatch.use_backend("onednn" if onednn else "reference", ops=("linear",)):
        out = op.linear_logprobs(hidden, weight, labels, chunk_size=chunk, with_entropy=with_entropy,
                                 temperature=temperature, onednn=onednn)
        logp, entropy = out if with_entropy else (out, None)
        g_logp = torch.randn_like(logp)
        loss = (logp * g_logp).sum()
        g_ent = torch.randn_like(logp)
        if with_entropy:
            loss = loss + (entropy * g_ent).sum()
        h_before, w_before = hidden.detach().clone(), weight.detach().clone()
        grads = torch.autograd.grad(loss, (hidden, weight))
    n, rows = logp.numel(), chunk or logp.numel()
    chunks = -(-n // rows)
    assert len(products) == (4 * chunks if onednn else 0)  # forward; backward: logits, grad hidden, grad weight
    assert torch.equal(hidden.detach(), h_before) and torch.equal(weight.detach(), w_before)

    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want_logp, want_ent = _naive(h @ w.t(), labels, temperature)
    want_loss = (want_logp * g_logp).sum() + ((want_ent * g_ent).sum() if with_entropy else 0)
    want_grads = torch.autograd.grad(want_loss, (h, w))
    torch.testing.assert_close(logp, want_logp.float())
    if with_entropy:
        torch.testing.assert_close(entropy, want_ent.float())
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want.float())


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("hidden_shape,temperature,chunk", [((9, 16), 1.0, 4), ((2, 3, 16), 0.6, 1), ((5, 16), 1.3, None)])
def test_linear_logprobs_sum_pi_squared_matches_the_full_softmax(branch, with_entropy, hidden_shape, temperature, chunk,
                                                                 request):
    """sum_v pi_v^2 of each row's tempered softmax (verl's calculate_sum_pi_squared) from the same chunks as logp and
    entropy, which it leaves unchanged; forward only."""
    request.getfixturevalue(branch)
    vocab = 37
    hidden, weight = torch.randn(hidden_shape), 2 * torch.randn(vocab, hidden_shape[-1])
    labels = torch.randint(0, vocab, hidden_shape[:-1])
    with torch.no_grad():
        out = op.linear_logprobs(hidden, weight, labels, chunk_size=chunk, with_entropy=with_entropy,
                                 temperature=temperature, with_sum_pi_squared=True)
    assert len(out) == (3 if with_entropy else 2)
    logits = hidden.double() @ weight.double().t()
    want_logp, want_ent = _naive(logits, labels, temperature)
    torch.testing.assert_close(out[0], want_logp.float())
    if with_entropy:
        torch.testing.assert_close(out[1], want_ent.float())
    want_sq = torch.softmax(logits / temperature, dim=-1).square().sum(-1)
    torch.testing.assert_close(out[-1], want_sq.float())
    assert out[-1].shape == labels.shape and bool((out[-1] > 0).all() and (out[-1] <= 1).all())
    with pytest.raises(ValueError, match=r"with_sum_pi_squared=True computes no gradient; call it under torch\.no_grad"):
        op.linear_logprobs(hidden.requires_grad_(), weight, labels, with_sum_pi_squared=True)


def test_linear_logprobs_bf16_and_frozen_weight(reference_backend):
    hidden = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(50, 32, dtype=torch.bfloat16)  # e.g. a reference model: no weight grad wanted
    labels = torch.randint(0, 50, (6,))
    logp = op.linear_logprobs(hidden, weight, labels, chunk_size=4)
    (grad,) = torch.autograd.grad(logp.sum(), hidden)
    h = hidden.detach().float().requires_grad_()
    want = _naive(h @ weight.float().t(), labels, 1.0)[0].float()
    (want_grad,) = torch.autograd.grad(want.sum(), h)
    torch.testing.assert_close(logp, want, atol=0.1, rtol=0.02)  # bf16 logits: ~3 significant digits
    torch.testing.assert_close(grad.float(), want_grad, atol=0.05, rtol=0.05)


def test_no_grad_forward_only(reference_backend):
    logits = torch.randn(4, 30)
    labels = torch.randint(0, 30, (4,))
    with torch.no_grad():
        logp = op.logprobs_from_logits(logits, labels, chunk_size=3)
    assert not logp.requires_grad
    torch.testing.assert_close(logp, _naive(logits, labels, 1.0)[0].float())


def test_default_chunk_rows_budget():
    assert op.default_chunk_rows(151_936) == op.CHUNK_BLOCK_BYTES // (4 * 151_936)
    assert op.default_chunk_rows(8) == op.NPU_CE_MAX_ROWS  # never above the NPU kernel's row limit
    assert op.default_chunk_rows(10**12) == 1


@pytest.mark.parametrize("total_gib, block_mib", [(64, 256), (8, 64), (1024, 1024)])
def test_chunks_are_sized_per_device(monkeypatch, total_gib, block_mib):
    """64 MiB blocks are the CPU's size; an accelerator gets 1/256 of its memory, within [64 MiB, 1 GiB]."""
    from types import SimpleNamespace

    from grpo_npu import device

    asked = []
    monkeypatch.setattr(device.Device, "total_memory", lambda self, index=None: asked.append((self.kind, index))
                        or total_gib * 1024**3)
    op._block_bytes.cache_clear()
    try:
        assert op.chunk_block_bytes(torch.device("cpu")) == op.CHUNK_BLOCK_BYTES
        npu = op.chunk_block_bytes(SimpleNamespace(type="npu", index=1))
        assert npu == block_mib * 1024**2 and asked == [("npu", 1)]
        assert op.chunk_block_bytes(SimpleNamespace(type="npu", index=1)) == npu and len(asked) == 1  # asked once
        rows = op.default_chunk_rows(151_936, npu)
        assert rows == npu // (4 * 151_936) and (rows > op.default_chunk_rows(151_936)) == (block_mib > 64)
    finally:
        op._block_bytes.cache_clear()


def test_rejects_bad_inputs(reference_backend):
    logits, labels = torch.randn(4, 10), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="temperature"):
        op.logprobs_from_logits(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="matching labels"):
        op.logprobs_from_logits(logits, labels[:3])
    with pytest.raises(ValueError, match="integer"):
        op.logprobs_from_logits(logits, labels.float())
    with pytest.raises(ValueError, match="chunk_size"):
        op.logprobs_from_logits(logits, labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"\(V, H=10\)"):
        op.linear_logprobs(logits, torch.randn(5, 9), labels)
    with pytest.raises(ValueError, match="dtype"):
        op.linear_logprobs(logits, torch.randn(5, 10).double(), labels)


@pytest.mark.parametrize("linear", [False, True])
def test_entropy_kept_out_of_the_loss_takes_the_logp_only_backward(linear, reference_backend, monkeypatch):
    """Entropy for a metric only (detached): same gradients as a logp-only call, and no entropy term in backward."""
    seen = []
    real = op._chunk_grad
    monkeypatch.setattr(op, "_chunk_grad", lambda z, lab, lse, gl, ge, t: seen.append(ge) or real(z, lab, lse, gl, ge, t))
    hidden = torch.randn(7, 16, requires_grad=True)
    weight = 0.5 * torch.randn(29, 16)
    labels = torch.randint(0, 29, (7,))

    def run(with_entropy):
        if linear:
            out = op.linear_logprobs(hidden, weight, labels, chunk_size=3, with_entropy=with_entropy)
        else:
            out = op.logprobs_from_logits(hidden @ weight.t(), labels, chunk_size=3, with_entropy=with_entropy)
        logp = out[0] if with_entropy else out
        if with_entropy:
            assert out[1].requires_grad  # differentiable; simply not used below
        return torch.autograd.grad((logp * torch.arange(7.0)).sum(), hidden)[0]

    plain = run(False)
    seen.clear()
    with_metric = run(True)
    assert seen and all(g is None for g in seen)
    torch.testing.assert_close(with_metric, plain, rtol=0, atol=0)
