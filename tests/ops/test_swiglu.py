"""swiglu / gated_mlp: reference == HF Qwen2MLP / Llama MLP; NPU branch == reference, fwd + bwd."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.ops import swiglu as op


@pytest.mark.parametrize("shape", [(2, 5, 24), (1, 2), (7, 3, 64)])
def test_reference_gates_first_half(shape, reference_backend):
    x = torch.randn(shape)
    half = shape[-1] // 2
    want = x[..., :half] * torch.sigmoid(x[..., :half]) * x[..., half:]
    torch.testing.assert_close(op.swiglu(x), want)


@pytest.mark.parametrize("shape", [(2, 5, 24), (3, 64), (2, 3, 3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_branch_matches_reference_forward_backward(shape, dtype, fake_npu):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    y = op.swiglu(x)
    assert fake_npu.calls["npu_swiglu"] == 1
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    x2 = x.detach().requires_grad_()
    y2 = op.swiglu_reference(x2)
    (gx2,) = torch.autograd.grad(y2, x2, g)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(gx, gx2, **tol)


def test_npu_branch_makes_input_contiguous(fake_npu):
    x = torch.randn(8, 6).t()  # (6, 8) non-contiguous: the kernel would reject it as is
    torch.testing.assert_close(op.swiglu(x), op.swiglu_reference(x))


@pytest.mark.parametrize("family", ["qwen2", "llama_bias"])
@pytest.mark.parametrize("backend", ["reference", "npu"])
def test_gated_mlp_matches_hf_mlp(family, backend, request):
    request.getfixturevalue("fake_npu" if backend == "npu" else "reference_backend")
    if family == "qwen2":
        from transformers import Qwen2Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

        mlp = Qwen2MLP(Qwen2Config(hidden_size=32, intermediate_size=48, hidden_act="silu"))
    else:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu", mlp_bias=True))
    x = torch.randn(2, 5, 32, requires_grad=True)
    want = mlp(x)
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], g)
    got = op.gated_mlp(
        x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
        mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias,
    )  # fmt: skip
    got_grads = torch.autograd.grad(got, [x, *mlp.parameters()], g)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


def test_swiglu_rejects_odd_width(reference_backend):
    with pytest.raises(ValueError, match="even"):
        op.swiglu(torch.randn(2, 5))
    with pytest.raises(ValueError, match="differ"):
        op.gated_mlp(torch.randn(2, 4), torch.randn(6, 4), torch.randn(5, 4), torch.randn(4, 6))
