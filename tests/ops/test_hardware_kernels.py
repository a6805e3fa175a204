"""The real kernels against the references, where the hardware exists (skipped elsewhere by tests/conftest.py).

NPU: every op forced to backend "npu" on npu tensors, compared with the reference run on the same
inputs; the emulator's schemas are checked against the installed torch_npu's op schemas.
CUDA: the flash-attn cross-entropy path of logprobs_from_logits, when flash-attn is installed.
Numerics of the NPU kernels are unverified here: compare with tolerances (the references run in
fp32 on CPU copies of the same bf16 inputs), never bitwise.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from grpo_npu import device
from grpo_npu.ops import dispatch, patch_model
from grpo_npu.ops import attention as attention_op
from grpo_npu.ops import logprob as logprob_op
from grpo_npu.ops import rms_norm as rms_norm_op
from grpo_npu.ops import rotary as rotary_op
from grpo_npu.ops import swiglu as swiglu_op

from . import fake_torch_npu
from .test_emulator import _parse_schema

BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


def _npu() -> torch.device:
    return device.get_device("npu").torch_device()


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().float() if t.is_floating_point() else t.cpu()


def _both(fn, *tensors):
    """fn on the NPU kernels, and on the references over fp32 CPU copies; both results as fp32 CPU."""
    with dispatch.use_backend("npu"):
        got = fn(*tensors)
    with dispatch.use_backend("reference"):
        want = fn(*(_cpu(t) for t in tensors))
    as_cpu = lambda x: tuple(_cpu(t) for t in x) if isinstance(x, tuple) else _cpu(x)  # noqa: E731
    return as_cpu(got), as_cpu(want)


@pytest.mark.npu
@pytest.mark.parametrize("op", sorted(fake_torch_npu.SCHEMAS))
def test_emulator_schema_is_a_prefix_of_the_installed_one(op):
    real = str(getattr(torch.ops.npu, op).default._schema).split("::", 1)[-1]
    _, want = _parse_schema(fake_torch_npu.SCHEMAS[op])
    _, have = _parse_schema(real.replace(", *,", ","))
    assert [n for n, _ in have[: len(want)]] == [n for n, _ in want], real


@pytest.mark.npu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_rms_norm_rotary_swiglu(dtype):
    dev = _npu()
    x = torch.randn(2, 33, 896, device=dev, dtype=dtype)
    w = torch.randn(896, device=dev, dtype=dtype)
    got, want = _both(lambda a, b: rms_norm_op.rms_norm(a, b, 1e-6), x, w)
    torch.testing.assert_close(got, want, **BF16_TOL)

    q = torch.randn(2, 14, 33, 64, device=dev, dtype=dtype)
    k = torch.randn(2, 2, 33, 64, device=dev, dtype=dtype)
    angles = torch.rand(2, 33, 32, device=dev) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    got, want = _both(rotary_op.apply_rotary, q, k, cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **BF16_TOL)

    gate_up = torch.randn(2, 33, 2 * 4864, device=dev, dtype=dtype)
    got, want = _both(swiglu_op.swiglu, gate_up)
    torch.testing.assert_close(got, want, **BF16_TOL)


@pytest.mark.npu
@pytest.mark.parametrize("case", ["causal", "gqa_decode", "padding", "varlen"])
def test_npu_fusion_attention(case):
    dev, dtype = _npu(), torch.bfloat16
    q = torch.randn(2, 37, 8, 64, device=dev, dtype=dtype)
    k = torch.randn(2, 37, 2, 64, device=dev, dtype=dtype)
    v = torch.randn(2, 37, 2, 64, device=dev, dtype=dtype)
    if case == "causal":
        got, want = _both(lambda a, b, c: attention_op.attention(a, b, c, causal=True), q, k, v)
    elif case == "gqa_decode":
        got, want = _both(lambda a, b, c: attention_op.attention(a, b, c, causal=True), q[:, -1:], k, v)
    elif case == "padding":
        keep = torch.ones(2, 1, 37, 37, dtype=torch.bool, device=dev).tril()
        keep[1, :, :, :5] = False
        keep[1, :, :5, :5] = torch.eye(5, dtype=torch.bool, device=dev)  # no fully masked rows
        got, want = _both(lambda a, b, c, m: attention_op.attention(a, b, c, causal=False, attn_mask=m), q, k, v, keep)
    else:
        cu = attention_op.cu_seqlens_from_lengths([30, 1, 43])
        got, want = _both(
            lambda a, b, c: attention_op.attention(a, b, c, causal=True, cu_seqlens=cu),
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
        )  # fmt: skip
    torch.testing.assert_close(got, want, **BF16_TOL)


@pytest.mark.npu
def test_npu_logprobs_and_linear_logprobs():
    dev = _npu()
    logits = torch.randn(3, 50, 151_936, device=dev, dtype=torch.bfloat16)
    labels = torch.randint(0, 151_936, (3, 50), device=dev)
    got, want = _both(lambda a, b: logprob_op.logprobs_from_logits(a, b, temperature=0.7, with_entropy=True), logits, labels)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    hidden = torch.randn(150, 896, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(151_936, 896, device=dev, dtype=torch.bfloat16) * 0.02
    got, want = _both(lambda a, b, c: logprob_op.linear_logprobs(a, b, c), hidden, weight, labels.flatten())
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.npu
def test_npu_patched_tiny_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    dev = _npu()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).to(dev)
    ids = torch.randint(0, 1000, (2, 40), device=dev)
    with torch.no_grad():
        want = model(input_ids=ids).logits.float().cpu()
        with dispatch.use_backend("npu"):
            report = patch_model(model)
            assert {r.backend for r in report.rows} == {"npu"}
            got = model(input_ids=ids).logits.float().cpu()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.cuda
def test_cuda_flash_attn_logprobs():
    try:
        importlib.import_module(logprob_op._FLASH_ATTN_CE)
    except ImportError:
        pytest.skip("flash-attn is not installed")
    dev = device.get_device("cuda").torch_device()
    logits = torch.randn(4, 30, 32_000, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32_000, (4, 30), device=dev)
    with dispatch.use_backend("cuda", ("logprob",)):
        got = logprob_op.logprobs_from_logits(logits, labels, temperature=0.8)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    with dispatch.use_backend("reference", ("logprob",)):
        want = logprob_op.logprobs_from_logits(logits, labels, temperature=0.8)
    (want_grad,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(grad.float(), want_grad.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
def test_cuda_fused_rms_norm_and_rotary_in_a_patched_model(tiny_model_path):
    """model.use_fused_kernels on CUDA (its default): RMSNorm and rotary on their CUDA branches give the HF model's
    logits and gradients in bf16, and the forward + backward launches fewer kernels (the reason for the branches)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from grpo_npu.ops import FUSED_OPS

    dev = device.get_device("cuda").torch_device()
    ids = torch.randint(0, 1000, (4, 48), device=dev)

    def run(patched: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).to(dev)
        if patched:
            report = patch_model(model, ops=FUSED_OPS["cuda"])
            assert {r.backend for r in report.rows} == {"cuda"}
        logits = model(input_ids=ids).logits
        grads = torch.autograd.grad(logits.float().logsumexp(-1).sum(), list(model.parameters()))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = model(input_ids=ids).logits
            torch.autograd.grad(out.float().logsumexp(-1).sum(), list(model.parameters()))
            torch.cuda.synchronize()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        return logits.float().cpu(), [g.float().cpu() for g in grads], kernels

    want, want_grads, hf_kernels = run(False)
    got, got_grads, our_kernels = run(True)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    for a, b in zip(got_grads, want_grads):  # bf16 roundings differ: relative error of each whole gradient
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-6
    assert our_kernels < 0.85 * hf_kernels, (our_kernels, hf_kernels)
