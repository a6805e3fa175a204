"""Swap the dispatching ops into a Hugging Face Qwen2 / Qwen3 / Llama model: one visible, reversible call.

    report = patch_model(model)          # ops=("rms_norm", "rotary", "mlp", "attention")
    print(report)                        # module class, count, backend per op
    unpatch_model(model)                 # everything back as it was

Nothing happens at import time. Mechanism, per op, and why:

- ``linear``: every plain ``nn.Linear`` instance's ``forward`` goes through :func:`grpo_npu.ops.linear.linear`
  (oneDNN for fp32 on CPU, F.linear elsewhere), by the same instance-attribute mechanism as below.
- ``rms_norm`` and ``mlp``: the ``forward`` of each matching module INSTANCE is replaced (an
  instance attribute shadows the class method; unpatch deletes it). The classes, other models and
  other modules are untouched, and FSDP/gradient-checkpointing hooks keep working because they
  wrap ``__call__``, not ``forward``.
- ``rotary``: transformers 5 calls the module-level ``apply_rotary_pos_emb`` from inside the
  attention ``forward``, so the only instance-level hook is that forward. Patched attention
  modules get a forward identical to HF's (q/k/v projections, Qwen3's per-head q/k norms, KV cache
  update, the attention-function registry, o_proj) except that rotary goes through
  :func:`grpo_npu.ops.rotary.apply_rotary`. Replacing the module-level function instead would
  change every model of that family in the process.
- ``attention``: transformers' own extension point. ``patch_model`` registers the name
  ``"grpo_npu"`` in ``AttentionInterface`` and switches this model's ``attn_implementation`` to it;
  unpatch switches back. Registering adds a new key and changes no existing one. Its mask builder
  (:func:`packing_aware_mask`) is ``sdpa_mask`` except for a batch with no padding mask and no cache
  history, where it builds nothing: such a batch is plain causal or packed, and the attention reads
  the packing itself, so no (T, T) mask is ever formed for a packed batch (the fused kernel would
  ignore it; at 16k tokens it is gigabytes). Packed (varlen) batches take the TND path, with the
  flash-attn style ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs when the caller passes them, else with
  the segments where ``position_ids`` restart. Padded batches get a bool (B, 1, Sq, Skv) mask with
  True = attend. A ``kv_index`` kwarg (shared-prompt packing) gathers each query segment's
  keys/values from the packed tokens, so a response can attend to a prompt stored once for all
  its siblings; a ``prefix_groups`` kwarg beside it lets the reference path attend a short group in one
  masked call (:mod:`grpo_npu.ops.attention_reference`). An ``sp_group`` kwarg (Ulysses sequence
  parallelism: this rank holds a slice of the packed tokens) wraps the packed call in
  :func:`grpo_npu.ops.sequence_parallel.ulysses_attention`. The workers patch this op alone into every model that runs packed rows
  (``use_remove_padding``) or shared prompts, unless the model uses an implementation in
  :data:`VARLEN_ATTN_IMPLEMENTATIONS`, so that packed memory stays linear in the token count.
"""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from grpo_npu.ops import attention as attention_op
from grpo_npu.ops import linear as linear_op
from grpo_npu.ops import rms_norm as rms_norm_op
from grpo_npu.ops import rotary as rotary_op
from grpo_npu.ops import sequence_parallel
from grpo_npu.ops import swiglu as swiglu_op

log = logging.getLogger(__name__)

PATCHABLE_OPS = ("linear", "rms_norm", "rotary", "mlp", "attention")
# What model.use_fused_kernels patches, per device kind: every op on Ascend (each has a torch_npu kernel) and on the
# host (their references: how CPU tests run a patched model); on CUDA the ops whose CUDA branch takes fewer kernel
# launches than transformers' own code, since the MLP and attention references would only add launches there.
FUSED_OPS = {"npu": PATCHABLE_OPS, "cpu": PATCHABLE_OPS, "cuda": ("rms_norm", "rotary")}
ATTN_IMPLEMENTATION = "grpo_npu"
# transformers attention implementations that read the packing (cu_seq_lens_q/k, else position ids) themselves
# and build no mask for a packed batch: flash-attn's varlen kernels. SDPA and eager attend through a dense
# block-diagonal (N, N) mask instead, so packed batches are switched to ATTN_IMPLEMENTATION (workers).
VARLEN_ATTN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
# transformers model families handled here -> their class-name prefix.
FAMILIES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}
_STATE_ATTR = "_grpo_npu_patch"
_OP_BACKEND = {
    "linear": linear_op.BACKEND,
    "rms_norm": rms_norm_op.BACKEND,
    "rotary": rotary_op.BACKEND,
    "mlp": swiglu_op.BACKEND,
    "attention": attention_op.BACKEND,
}
_MISSING = object()


@dataclass(frozen=True)
class PatchRow:
    """One replaced module class: which op, how many instances, which backend the op resolved to."""

    op: str
    module_class: str
    count: int
    backend: str


@dataclass
class PatchReport:
    """What :func:`patch_model` replaced, and what it left alone and why."""

    rows: list[PatchRow] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def count(self, op: str) -> int:
        return sum(r.count for r in self.rows if r.op == op)

    def __str__(self) -> str:
        lines = ["grpo_npu.ops patch report", f"{'op':<10} {'module class':<20} {'count':>5}  backend"]
        lines += [f"{r.op:<10} {r.module_class:<20} {r.count:>5}  {r.backend}" for r in self.rows]
        if not self.rows:
            lines.append("(nothing replaced)")
        lines += [f"skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


@dataclass
class _PatchState:
    forwards: list[tuple[nn.Module, object]]  # (module, its previous instance-level forward or _MISSING)
    attn_implementation: str | None  # the model's implementation before patching, None if untouched
    report: PatchReport


# ------------------------------------------------------------------------------------------------
# Replacement forwards (bound to module instances)
# ------------------------------------------------------------------------------------------------
def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    return linear_op.linear(x, self.weight, self.bias)


def _patch_linears(model: nn.Module, forwards: list, report: PatchReport) -> None:
    """Every plain nn.Linear (projections, LM head, value head); subclasses such as LoRA layers are left alone."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            _bind(module, _linear_forward, forwards)
            count += 1
    if count:
        report.rows.append(PatchRow("linear", "Linear", count, _OP_BACKEND["linear"].get()))


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm_op.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    return swiglu_op.gated_mlp(x, gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias)


def _attention_lookup() -> Callable[[str, Callable], Callable]:
    """(implementation name, eager function) -> attention function, as the installed transformers does it.

    ``AttentionInterface.get_interface`` exists from transformers 5.1; before it (the 4.56-4.57 of the
    older supported stacks) the models index ``ALL_ATTENTION_FUNCTIONS`` and keep eager for themselves.
    """
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface
    return lambda name, eager: eager if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]


def _make_attention_forward(eager_attention_forward: Callable) -> Callable:
    """HF's Qwen2/Qwen3/Llama attention forward with rotary through the dispatching op."""
    lookup = _attention_lookup()

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)  # (B, S, Nq, D)
        k = self.k_proj(hidden_states).view(hidden_shape)  # (B, S, Nkv, D)
        if getattr(self, "q_norm", None) is not None:  # Qwen3: RMSNorm over the head dim, before rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # BNSD
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = rotary_op.apply_rotary(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        interface = lookup(self.config._attn_implementation, eager_attention_forward)
        if hasattr(self, "sliding_window"):  # Qwen2/Qwen3 pass it, Llama has none
            kwargs["sliding_window"] = self.sliding_window
        out, weights = interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights

    return forward


def hf_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"grpo_npu"`` entry of transformers' AttentionInterface: BNSD in, (B, Sq, Nq, D) out."""
    if dropout:
        raise ValueError(f"grpo_npu attention has no dropout; got attention_dropout={dropout} in training mode")
    if sliding_window is not None:
        raise ValueError(f"grpo_npu attention has no sliding window; the model asks for {sliding_window}")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # BSND
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    kv_index = kwargs.get("kv_index")  # shared-prefix packing: the key/value tokens of each query segment
    if kv_index is not None and cu_q is None:
        raise ValueError("kv_index (shared-prefix packing) needs cu_seq_lens_q/cu_seq_lens_k")
    if cu_q is not None:
        if q.shape[0] != 1:
            raise ValueError(f"cu_seq_lens_q needs packed input with batch size 1, got batch {q.shape[0]}")
        def attend(q, k, v):
            return attention_op.attention(q, k, v, causal=causal, cu_seqlens=cu_q, cu_seqlens_k=cu_k, scale=scaling,
                                          kv_index=kv_index, prefix_groups=kwargs.get("prefix_groups"))

        sp_group = kwargs.get("sp_group")  # Ulysses: this rank holds a slice of the packed tokens
        if sp_group is not None:
            return sequence_parallel.ulysses_attention(q[0], k[0], v[0], sp_group, attend)[None], None
        return attend(q[0], k[0], v[0])[None], None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"grpo_npu attention expects sdpa-style bool masks, got {attention_mask.dtype}")
        return attention_op.attention(q, k, v, causal=False, attn_mask=attention_mask, scale=scaling), None
    sq, skv = q.shape[1], k.shape[1]
    cu = packed_segments(kwargs.get("position_ids"), q.shape[0], sq) if causal and sq == skv > 1 else None
    if cu is not None:  # packed rows without cu_seq_lens: the segments where position_ids restart
        b = q.shape[0]
        flat = [t.reshape(b * sq, *t.shape[2:]) for t in (q, k, v)]  # (B*S, N, D)
        out = attention_op.attention(*flat, causal=True, cu_seqlens=cu, scale=scaling)
        return out.view(q.shape), None
    if causal and 1 < sq < skv:
        # transformers only omits the mask here for a prefill into an empty static cache: the keys
        # past Sq are empty slots and the causal pattern is top-left, as sdpa_attention_forward does.
        k, v = k[:, :sq], v[:, :sq]
    return attention_op.attention(q, k, v, causal=causal and sq > 1, scale=scaling), None


def packed_segments(position_ids: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """Cumulative offsets (n+1,) over the flattened (batch * length) tokens of the sequences packed in the
    rows, split where position ids do not step by one; None when every row is one sequence (or no ids)."""
    if position_ids is None:
        return None
    pos = position_ids.expand(batch, length)  # (B, S); transformers may pass (1, S) for every row
    starts = torch.ones(batch, length, dtype=torch.bool, device=pos.device)  # (B, S): a row starts a sequence
    starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    if int(starts.sum()) == batch:
        return None
    first = starts.reshape(-1).nonzero()[:, 0].to(torch.int32)  # (n,) flat index of each sequence's first token
    return torch.cat([first, torch.tensor([batch * length], dtype=torch.int32, device=first.device)])


def packing_aware_mask(**kwargs) -> torch.Tensor | None:
    """The "grpo_npu" mask builder: nothing for a batch without padding mask and cache history (plain causal,
    or packed: the attention reads the packing from position_ids or cu_seq_lens), else ``sdpa_mask``.

    transformers 4.56-4.57 pass ``cache_position`` (the query positions), 5.x ``q_length``."""
    from transformers.masking_utils import sdpa_mask  # exists from transformers 4.53 on (pyproject asks >= 4.56)

    q_length = kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]
    if kwargs.get("attention_mask") is None and q_length == kwargs["kv_length"]:
        return None
    return sdpa_mask(**kwargs)


def _register_attention() -> None:
    # Imported here, where it is needed: transformers.masking_utils exists from transformers 4.53 on
    # (pyproject asks >= 4.56, docs/npu.md section 1).
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, packing_aware_mask)


# ------------------------------------------------------------------------------------------------
# Matching modules
# ------------------------------------------------------------------------------------------------
def _family_classes(kind: str) -> dict[type, types.ModuleType]:
    """{RMSNorm|MLP|Attention class of each family: its modeling module}."""
    found = {}
    for family, prefix in FAMILIES.items():
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        found[getattr(modeling, f"{prefix}{kind}")] = modeling
    return found


def _bind(module: nn.Module, fn: Callable, forwards: list) -> None:
    forwards.append((module, module.__dict__.get("forward", _MISSING)))
    module.forward = types.MethodType(fn, module)


def _patch_instances(model: nn.Module, op: str, forwards: list, report: PatchReport) -> None:
    kind = {"rms_norm": "RMSNorm", "mlp": "MLP", "rotary": "Attention"}[op]
    classes = _family_classes(kind)
    counts: dict[str, int] = {}
    for module in model.modules():
        cls = next((c for c in classes if isinstance(module, c)), None)
        if cls is None:
            continue
        if op == "rms_norm":
            fn = _rms_norm_forward
        elif op == "mlp":
            act = getattr(module.config, "hidden_act", None)
            if act not in ("silu", "swish"):
                report.skipped.append(f"mlp: {cls.__name__} uses hidden_act={act!r}, not SiLU")
                continue
            if not all(type(getattr(module, p)) is nn.Linear for p in ("gate_proj", "up_proj", "down_proj")):
                report.skipped.append(f"mlp: {cls.__name__} has wrapped projections (e.g. LoRA); left as is")
                continue
            fn = _mlp_forward
        else:
            fn = _make_attention_forward(classes[cls].eager_attention_forward)
        _bind(module, fn, forwards)
        counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
    backend = _OP_BACKEND[op].get()
    report.rows += [PatchRow(op, name, n, backend) for name, n in counts.items()]


def _patch_attention(model: nn.Module, report: PatchReport) -> str | None:
    """Switch the model to the "grpo_npu" attention implementation; returns the previous one."""
    set_impl = getattr(model, "set_attn_implementation", None)
    config = getattr(model, "config", None)
    if set_impl is None or config is None:
        report.skipped.append(f"attention: {type(model).__name__} is not a transformers PreTrainedModel")
        return None
    attention_classes = tuple(_family_classes("Attention"))
    count = sum(isinstance(m, attention_classes) for m in model.modules())
    if count == 0:
        report.skipped.append(f"attention: no Qwen2/Qwen3/Llama attention modules in {type(model).__name__}")
        return None
    previous = config._attn_implementation
    _register_attention()
    set_impl(ATTN_IMPLEMENTATION)
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        report.skipped.append(f"attention: {type(model).__name__} refused attn_implementation={ATTN_IMPLEMENTATION!r}")
        return None
    names = sorted({type(m).__name__ for m in model.modules() if isinstance(m, attention_classes)})
    report.rows.append(PatchRow("attention", "+".join(names), count, _OP_BACKEND["attention"].get()))
    return previous


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------
def is_patched(model: nn.Module) -> bool:
    return hasattr(model, _STATE_ATTR)


def patch_model(model: nn.Module, ops: tuple[str, ...] = PATCHABLE_OPS) -> PatchReport:
    """Route the model's linear layers / RMSNorm / rotary / MLP / attention through grpo_npu.ops; returns the report."""
    unknown = [op for op in ops if op not in PATCHABLE_OPS]
    if unknown:
        raise ValueError(f"patch_model: unknown ops {unknown}; known: {', '.join(PATCHABLE_OPS)}")
    if is_patched(model):
        raise ValueError("patch_model: model is already patched; call unpatch_model(model) first")
    report = PatchReport()
    forwards: list[tuple[nn.Module, object]] = []
    previous_attn = None
    for op in PATCHABLE_OPS:  # fixed order, whatever order ops came in
        if op not in ops:
            continue
        if op == "attention":
            previous_attn = _patch_attention(model, report)
        elif op == "linear":
            _patch_linears(model, forwards, report)
        else:
            _patch_instances(model, op, forwards, report)
    setattr(model, _STATE_ATTR, _PatchState(forwards, previous_attn, report))
    log.info("%s", report)
    return report


def unpatch_model(model: nn.Module) -> None:
    """Undo :func:`patch_model`: original forwards and attention implementation come back."""
    state: _PatchState | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError("unpatch_model: model is not patched")
    for module, previous in reversed(state.forwards):
        if previous is _MISSING:
            del module.forward
        else:
            module.forward = previous
    if state.attn_implementation is not None:
        model.set_attn_implementation(state.attn_implementation)
    delattr(model, _STATE_ATTR)
    log.info("grpo_npu.ops: unpatched %d module forwards", len(state.forwards))
