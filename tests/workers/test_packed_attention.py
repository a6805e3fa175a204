"""Packed (remove-padding) micro-batches attend per packed sequence: no (N, N) tensor on any device (issue 20, 5).

With SDPA or eager attention transformers turns the packed position ids into one block-diagonal (1, 1, N, N)
mask over all N tokens of the micro-batch, so memory grew with (B x T)^2. The workers now switch packed models
to the grpo_npu attention, whose varlen path forms no mask; flash-attn (``flash_attention_2``) reads the
packing itself and is kept.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from grpo_npu.workers.model_inputs import build_inputs
from grpo_npu.workers.response_model import ops_to_patch

from .helpers import make_batch, make_cfg, make_worker

pytestmark = pytest.mark.usefixtures("process_group")

ROWS, PROMPT, RESPONSE = 4, 8, 512  # N = 4 x (8 + 512) packed tokens: an N x N mask is 4.3M elements


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and, on CPU, backward: same thread)."""

    def __init__(self):
        super().__init__()
        self.numel, self.where = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.where = t.numel(), f"{func} -> {tuple(t.shape)}"
        return out


def _largest(fn) -> LargestTensor:
    seen = LargestTensor()
    with seen:
        fn()
    return seen


@pytest.mark.parametrize("impl,patched", [("sdpa", True), ("eager", True), ("flash_attention_2", False),
                                          ("flash_attention_3", False)])
def test_packed_rows_take_a_varlen_attention(impl, patched):
    def ops(**kw):
        base = dict(fused_kernels=False, onednn_linear=False, shared_prefix=False, remove_padding=True,
                    attn_implementation=impl, device_kind="cpu")
        return ops_to_patch(**(base | kw))

    assert ("attention" in ops()) == patched
    assert ops(remove_padding=False) == ()
    assert ops(remove_padding=False, shared_prefix=True) == ("attention",)  # kv_index: grpo_npu's attention only
    assert ops(onednn_linear=True) == (("linear", "attention") if patched else ("linear",))
    assert ops(fused_kernels=True, remove_padding=False) == ("linear", "rms_norm", "rotary", "mlp", "attention")
    assert ops(fused_kernels=True, remove_padding=False, device_kind="npu") == ops(fused_kernels=True)
    # CUDA: only the ops with a CUDA branch, plus what packing asks for
    assert ops(fused_kernels=True, remove_padding=False, device_kind="cuda") == ("rms_norm", "rotary")
    assert ops(fused_kernels=True, device_kind="cuda") == (("rms_norm", "rotary", "attention") if patched
                                                            else ("rms_norm", "rotary"))


def test_packed_batches_allocate_no_n_by_n_tensor(tiny_model_path):
    """Forward + backward of the actor, forward of the reference and critic, over 4 rows x 520 tokens packed:
    the largest tensor any op makes stays below N x N and no larger than the padded path's (a logits chunk)."""
    batch = make_batch(seed=0, rows=ROWS, prompt_len=PROMPT, response_len=RESPONSE, empty_row=None)
    batch = batch.replace(response_mask=torch.ones_like(batch.response_mask))  # every row full length
    n_tokens = int(batch.attention_mask.sum())
    largest = {}
    for packed in (False, True):
        cfg = make_cfg(tiny_model_path, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=True",
                       f"actor_rollout_ref.model.use_remove_padding={packed}",
                       f"critic.model.use_remove_padding={packed}",
                       f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}")
        worker = make_worker(cfg)
        inputs = build_inputs(batch, packed)
        if packed:
            assert inputs.input_ids.shape == (1, n_tokens)

        def actor_step(module=worker.actor.module):
            logp, _ = module(inputs, 1.0, False)
            logp.sum().backward()

        for role, fn in {"actor": actor_step,
                         "ref": lambda: worker.ref.module(inputs, 1.0, False),
                         "critic": lambda: worker.critic.module(inputs)}.items():
            with torch.set_grad_enabled(role == "actor"):
                largest[(role, packed)] = _largest(fn)
    for role in ("actor", "ref", "critic"):
        got, padded = largest[(role, True)], largest[(role, False)]
        assert got.numel < n_tokens * n_tokens, f"{role}: {got.where} (N = {n_tokens})"
        assert got.numel <= padded.numel, f"{role}: packed {got.where} vs padded {padded.where}"


@pytest.mark.cuda
def test_cuda_flash_attention_2_packed_equals_padded(tiny_model_path):
    """transformers' flash-attn path takes the packed kwargs build_inputs passes (cu_seq_lens_q/k, max_length_q/k)."""
    pytest.importorskip("flash_attn")
    from transformers import AutoModelForCausalLM

    from grpo_npu import device

    dev = device.get_device("cuda").torch_device()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2").to(dev)
    batch = make_batch(seed=1, empty_row=None).to(dev)
    outs = {}
    for packed in (False, True):
        inputs = build_inputs(batch, packed)
        with torch.no_grad():
            hidden = model.model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                                 position_ids=inputs.position_ids, use_cache=False, **inputs.packed_kwargs)
        outs[packed] = hidden.last_hidden_state.reshape(-1, hidden.last_hidden_state.shape[-1])[inputs.predict_index]
    torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("share_prefix", [False, True])
def test_cuda_grpo_npu_attention_packed_equals_padded(tiny_model_path, share_prefix):
    """The grpo_npu attention on CUDA: packed and shared-prompt micro-batches go through torch's flash varlen kernel
    (one call per layer, ops/attention.py) and give the padded path's hidden states and gradients."""
    from transformers import AutoModelForCausalLM

    from grpo_npu import device
    from grpo_npu.ops import attention as attention_op
    from grpo_npu.ops import patch_model

    if attention_op.varlen_kernel() is None:
        pytest.skip("this torch has no varlen_attn with scale/window_size (torch >= 2.11)")
    dev = device.get_device("cuda").torch_device()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).to(dev)
    patch_model(model, ops=("attention",))
    base = make_batch(seed=1, empty_row=None)
    half = len(base) // 2  # half the prompts, each twice: shared-prompt packing has prompts to share
    batch = base.replace(prompt_ids=base.prompt_ids[:half].repeat(2, 1), prompt_mask=base.prompt_mask[:half].repeat(2, 1))
    batch = batch.to(dev)
    outs, grads = {}, {}
    for mode in ("padded", "packed"):
        inputs = build_inputs(batch, mode == "packed", share_prefix and mode == "packed")
        model.zero_grad()
        hidden = model.model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                             position_ids=inputs.position_ids, use_cache=False, **inputs.packed_kwargs)
        flat = hidden.last_hidden_state.reshape(-1, hidden.last_hidden_state.shape[-1])[inputs.predict_index]
        flat.float().square().mean().backward()
        outs[mode] = flat.detach().float()
        grads[mode] = model.model.layers[0].self_attn.q_proj.weight.grad.float().clone()
    torch.testing.assert_close(outs["packed"], outs["padded"], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(grads["packed"], grads["padded"], atol=3e-2, rtol=5e-2)
    assert attention_op._cuda_varlen_probed.get((outs["packed"].device, torch.bfloat16)) is True
