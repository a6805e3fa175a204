"""patch_model: a patched tiny Qwen2 / Qwen3 / Llama gives the unpatched logits and gradients; unpatch restores.

Every comparison runs twice: ops on their references, and ops on the NPU branch through the
torch_npu emulator (so the NPU glue -- layouts, masks, offsets, argument names -- runs inside a
real transformers model).
"""

from __future__ import annotations

import pytest
import torch

from grpo_npu.ops import linear as linear_op
from grpo_npu.ops import patch_model, unpatch_model
from grpo_npu.ops.attention import cu_seqlens_from_lengths
from grpo_npu.ops.patch import ATTN_IMPLEMENTATION, is_patched

LAYERS = 2
BRANCHES = ["reference_backend", "fake_npu"]


def _tiny(family: str, **overrides):
    import transformers

    common = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, hidden_act="silu",
    )  # fmt: skip
    common.update(overrides)
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    if family == "qwen3":
        common.setdefault("head_dim", 16)
    torch.manual_seed(0)
    model = model_cls(config_cls(**common))
    model.train()  # attention_dropout is 0.0: training mode exercises the dropout=0.0 branch
    return model


def _logits_and_grads(model, weights=None, **inputs):
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    g = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)) if weights is None else weights
    (logits * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_same(a, b, atol=2e-5, rtol=1e-4):
    """Logits and every parameter gradient equal; atol scales with each tensor's magnitude (fp32 rounding)."""
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=atol, rtol=rtol)
    assert ga.keys() == gb.keys()
    for name in ga:
        scale = max(1.0, gb[name].abs().max().item())
        torch.testing.assert_close(ga[name], gb[name], atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_patched_model_matches_unpatched(family, branch, request):
    request.getfixturevalue(branch)
    model = _tiny(family)
    ids = torch.randint(0, 97, (2, 11))
    before = _logits_and_grads(model, input_ids=ids)
    attn_before = model.config._attn_implementation

    report = patch_model(model)
    assert is_patched(model) and model.config._attn_implementation == ATTN_IMPLEMENTATION
    norms = 2 * LAYERS + 1 + (2 * LAYERS if family == "qwen3" else 0)  # + q_norm/k_norm per Qwen3 layer
    assert (report.count("rms_norm"), report.count("mlp"), report.count("rotary"), report.count("attention")) == (
        norms, LAYERS, LAYERS, LAYERS,
    )  # fmt: skip
    assert report.count("linear") == 7 * LAYERS + 1  # q, k, v, o, gate, up, down per layer + the LM head
    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}[family]
    assert {r.module_class for r in report.rows} == {"Linear", f"{prefix}RMSNorm", f"{prefix}MLP", f"{prefix}Attention"}
    want_backend = "npu" if branch == "fake_npu" else "reference"
    assert {r.backend for r in report.rows if r.op != "linear"} == {want_backend}
    # linear has no NPU kernel: forcing "npu" leaves it automatic (oneDNN on CPU where torch has it)
    want_linear = linear_op.BACKEND.get() if branch == "fake_npu" else "reference"
    assert {r.backend for r in report.rows if r.op == "linear"} == {want_linear}
    assert f"{prefix}MLP" in str(report)

    patched = _logits_and_grads(model, input_ids=ids)
    _assert_same(patched, before)
    if branch == "fake_npu":
        calls = request.getfixturevalue("fake_npu").calls
        assert calls["npu_fusion_attention"] == LAYERS and calls["npu_swiglu"] == LAYERS
        assert calls["npu_rms_norm"] == norms and calls["npu_rotary_mul"] == 2 * LAYERS

    unpatch_model(model)
    assert not is_patched(model) and model.config._attn_implementation == attn_before
    assert not any("forward" in m.__dict__ for m in model.modules())
    _assert_same(_logits_and_grads(model, input_ids=ids), before, atol=0, rtol=0)


@pytest.mark.parametrize("branch", BRANCHES)
def test_left_padded_batch(branch, request):
    request.getfixturevalue(branch)
    model = _tiny("qwen2")
    ids = torch.randint(0, 97, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :8] = 0
    weights = torch.randn(3, 9, 97) * mask[..., None]  # padded positions do not enter the loss
    before = _logits_and_grads(model, weights, input_ids=ids, attention_mask=mask)
    patch_model(model)
    logits, grads = _logits_and_grads(model, weights, input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    _assert_same((logits[keep], grads), (before[0][keep], before[1]))


@pytest.mark.parametrize("branch", BRANCHES)
def test_packed_varlen_matches_separate_sequences(branch, request):
    request.getfixturevalue(branch)
    model = _tiny("qwen3")
    lengths = [5, 1, 7]
    seqs = [torch.randint(0, 97, (1, n)) for n in lengths]
    separate = torch.cat([model(input_ids=s).logits for s in seqs], dim=1).detach()

    patch_model(model)
    cu = cu_seqlens_from_lengths(lengths)
    packed = model(
        input_ids=torch.cat(seqs, dim=1),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
    ).logits  # fmt: skip
    torch.testing.assert_close(packed.detach(), separate, atol=2e-5, rtol=1e-4)
    if branch == "fake_npu":
        assert request.getfixturevalue("fake_npu").calls["npu_fusion_attention"] == LAYERS


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("padded", [False, True])
def test_kv_cache_decode_matches(branch, padded, request):
    from transformers import DynamicCache

    request.getfixturevalue(branch)
    model = _tiny("llama").eval()
    ids = torch.randint(0, 97, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    if padded:
        mask[0, :2] = 0

    def prefill_and_step():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        step_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        step = model(input_ids=step_ids, attention_mask=step_mask, past_key_values=out.past_key_values, use_cache=True)
        return out.logits[mask.bool()], step.logits

    with torch.no_grad():
        want = prefill_and_step()
        patch_model(model)
        got = prefill_and_step()
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("branch", BRANCHES)
def test_static_cache_prefill_matches(branch, request):
    from transformers import StaticCache

    request.getfixturevalue(branch)
    model = _tiny("qwen2").eval()
    ids = torch.randint(0, 97, (2, 5))

    def prefill():  # an empty static cache: keys past the prompt are empty slots, mask is None
        cache = StaticCache(config=model.config, max_cache_len=16)
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits

    with torch.no_grad():
        want = prefill()
        patch_model(model)
        got = prefill()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_tiny_kit_model(tiny_model_path, fake_npu):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = torch.randint(0, 1000, (2, 10))
    before = _logits_and_grads(model, input_ids=ids)
    report = patch_model(model)
    assert report.count("attention") == model.config.num_hidden_layers
    _assert_same(_logits_and_grads(model, input_ids=ids), before)


def test_op_subset_and_guards(reference_backend):
    model = _tiny("qwen2")
    attn = model.config._attn_implementation
    report = patch_model(model, ops=("rms_norm",))
    assert {r.op for r in report.rows} == {"rms_norm"}
    assert model.config._attn_implementation == attn
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model)
    unpatch_model(model)
    with pytest.raises(ValueError, match="not patched"):
        unpatch_model(model)
    with pytest.raises(ValueError, match="unknown ops"):
        patch_model(model, ops=("rms_norm", "layernorm"))


def test_rotary_without_attention_core(fake_npu):
    model = _tiny("qwen2")
    ids = torch.randint(0, 97, (1, 7))
    before = _logits_and_grads(model, input_ids=ids)
    patch_model(model, ops=("rotary",))
    assert model.config._attn_implementation != ATTN_IMPLEMENTATION  # core stays on sdpa
    _assert_same(_logits_and_grads(model, input_ids=ids), before)
    assert fake_npu.calls["npu_rotary_mul"] == 2 * LAYERS and fake_npu.calls["npu_fusion_attention"] == 0


def test_non_silu_mlp_is_skipped_with_reason(reference_backend):
    model = _tiny("llama", hidden_act="gelu")
    report = patch_model(model, ops=("mlp",))
    assert report.count("mlp") == 0
    assert any("gelu" in s for s in report.skipped)
    assert "skipped" in str(report)


@pytest.mark.parametrize("branch", BRANCHES)
def test_transformers_without_get_interface(branch, request, monkeypatch):
    """transformers 4.56-5.0 (the quickstart and seed-era stacks) have no AttentionInterface.get_interface."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    request.getfixturevalue(branch)
    model = _tiny("qwen2")
    ids = torch.randint(0, 97, (2, 7))
    before = _logits_and_grads(model, input_ids=ids)  # the installed transformers' own forward needs it
    monkeypatch.delattr(type(ALL_ATTENTION_FUNCTIONS), "get_interface")
    patch_model(model)
    _assert_same(_logits_and_grads(model, input_ids=ids), before)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_cuda_fused_ops_patch_matches_unpatched(family, cuda_branch):
    """What use_fused_kernels patches on CUDA (RMSNorm and rotary, on their CUDA branches), run on CPU tensors:
    the model's logits and every gradient stay HF's, with and without gradient checkpointing."""
    from grpo_npu.ops import FUSED_OPS

    model = _tiny(family)
    ids = torch.randint(0, 97, (2, 11))
    before = _logits_and_grads(model, input_ids=ids)
    report = patch_model(model, ops=FUSED_OPS["cuda"])
    assert {r.op for r in report.rows} == {"rms_norm", "rotary"} and {r.backend for r in report.rows} == {"cuda"}
    assert model.config._attn_implementation != ATTN_IMPLEMENTATION  # HF's attention kernel stays
    _assert_same(_logits_and_grads(model, input_ids=ids), before)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _assert_same(_logits_and_grads(model, input_ids=ids), before)


def test_cuda_fused_ops_trace_without_graph_breaks(cuda_branch):
    """model.compile_layers compiles each decoder layer: the CUDA branches must not break its graph (the fused norm
    is called as an ATen OpOverload, which dynamo traces; its Python binding would break the graph)."""
    from grpo_npu.ops import FUSED_OPS

    model = _tiny("qwen2")
    patch_model(model, ops=FUSED_OPS["cuda"])
    layer = model.model.layers[0]
    hidden = torch.randn(2, 7, 64, requires_grad=True)
    position_ids = torch.arange(7)[None]
    cos_sin = model.model.rotary_emb(hidden, position_ids)
    explained = torch._dynamo.explain(layer)(hidden, position_embeddings=cos_sin, position_ids=position_ids)
    assert explained.graph_break_count == 0, explained.break_reasons
