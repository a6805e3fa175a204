"""NPU-native kernels (and a oneDNN CPU linear) with plain-PyTorch references, each op choosing its backend once.

Ops (module -> NPU kernel):
    rms_norm.rms_norm            torch_npu.npu_rms_norm (torch's fused rms_norm on CUDA)
    rotary.apply_rotary          torch_npu.npu_rotary_mul (a roll + addcmul form on CUDA: fewer launches)
    swiglu.swiglu / gated_mlp    torch_npu.npu_swiglu
    attention.attention          torch_npu.npu_fusion_attention (torch's flash varlen kernel for packed batches on CUDA)
    logprob.logprobs_from_logits torch_npu.npu_cross_entropy_loss (chunked; flash-attn CE on CUDA)
    logprob.linear_logprobs      chunked lm_head + log-softmax, logits never materialised in full
    linear.linear                (CPU) oneDNN's fp32 matmul with a hand-written backward; F.linear elsewhere
:func:`patch_model` swaps them into a transformers Qwen2/Qwen3/Llama model (reversible; see patch.py). Its
attention's varlen path is also what packed (remove-padding) batches take on every device, so that no
(N, N) mask over a packed micro-batch is formed.
Importing this package never imports torch_npu and never patches anything. The functions named
like their module (``rms_norm``, ``swiglu``, ``attention``) are imported from the module
(``from grpo_npu.ops.attention import attention``) so that ``grpo_npu.ops.attention`` stays the module.
"""

from grpo_npu.ops.attention import cu_seqlens_from_lengths
from grpo_npu.ops.dispatch import BACKENDS, backends, set_backend, use_backend
from grpo_npu.ops.logprob import linear_logprobs, logprobs_from_logits
from grpo_npu.ops.patch import (
    FUSED_OPS,
    PATCHABLE_OPS,
    VARLEN_ATTN_IMPLEMENTATIONS,
    PatchReport,
    PatchRow,
    is_patched,
    patch_model,
    unpatch_model,
)
from grpo_npu.ops.rotary import apply_rotary
from grpo_npu.ops.swiglu import gated_mlp

__all__ = [
    "BACKENDS",
    "FUSED_OPS",
    "PATCHABLE_OPS",
    "PatchReport",
    "PatchRow",
    "VARLEN_ATTN_IMPLEMENTATIONS",
    "apply_rotary",
    "backends",
    "cu_seqlens_from_lengths",
    "gated_mlp",
    "is_patched",
    "linear_logprobs",
    "logprobs_from_logits",
    "patch_model",
    "set_backend",
    "unpatch_model",
    "use_backend",
]
