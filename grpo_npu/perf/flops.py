"""FLOPs and bytes of a dense decoder-only transformer (Qwen2, Qwen3, Llama), counted from its config.

What is counted (one multiply-add = 2 FLOPs; matrix products only, the work a GEMM unit does):
    linear     per token and layer: the q, k, v, o projections (k and v with ``kv_heads`` heads: GQA)
               and the SwiGLU MLP (gate, up, down)
    attention  per query/key pair and layer: the score product q.k and the value product p.v over all
               ``heads`` (GQA shares k/v between heads but every query head still does its products)
    head       per position it is applied to: the LM head (hidden x vocab), or a value head (hidden x 1)
Not counted: the embedding lookup (a gather, no FLOPs), norms, rotary, softmax, SwiGLU's elementwise
product, biases and the loss -- together well under 1% for any real model size.

Causal attention: a token at position i (1-based) attends to i keys, so a sequence of L tokens has
L(L+1)/2 query/key pairs (``causal=True``, the model's work). Dense kernels (eager or SDPA math) compute
the full L x L square and mask half of it; ``causal=False`` counts that square (what
``torch.utils.flop_counter.FlopCounterMode`` reports for them).

Training: backward is two products per forward product (gradient of the input and of the weight), so
forward + backward = 3 x forward. Gradient checkpointing recomputes each decoder layer's forward in
backward but the last layer's, whose tensors the trainer keeps (workers/response_model.py::
keep_last_layer_activations). The trainer checkpoints non-reentrantly (``use_reentrant=False``), and torch
then stops the recomputation once every tensor backward needs is back: the layer's last product, the MLP's
down projection, whose output nothing saves, is not redone. :func:`train_flops` counts that recompute only
when asked (``recompute=True``: the hardware FLOPs); MFU conventionally counts model FLOPs, without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

# transformers ``model_type`` values whose layers are exactly the blocks counted above.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}


def dtype_name(dtype: str | torch.dtype) -> str:
    """'fp32' | 'bf16' | 'fp16' for a torch dtype or any of its usual spellings."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(sorted(_DTYPE_ALIASES))} (or a torch dtype)")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a dense decoder-only model's FLOPs and bytes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    head_width: int  # output width of the head: vocab for an LM head, 1 for a value head
    tied_embeddings: bool  # the LM head is the embedding matrix (one copy of vocab x hidden)

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "head_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name}={getattr(self, name)} must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")

    @classmethod
    def from_hf_config(cls, config: Any, *, value_head: bool = False) -> "ModelShape":
        """From a transformers config; ``value_head``: the model ends in a hidden x 1 value head (a critic)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r}: FLOP counting knows {', '.join(SUPPORTED_MODEL_TYPES)} "
                             "(dense decoder-only with a SwiGLU MLP)")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        tied = bool(getattr(config, "tie_word_embeddings", False)) and not value_head
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   intermediate=config.intermediate_size, vocab=config.vocab_size,
                   head_width=1 if value_head else config.vocab_size, tied_embeddings=tied)

    @property
    def layer_weights(self) -> int:
        """Matmul weights of one decoder layer: q, o (heads), k, v (kv_heads) and gate, up, down."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_and_o + k_and_v + 3 * self.hidden * self.intermediate

    @property
    def recomputed_layer_weights(self) -> int:
        """Weights whose products a non-reentrant checkpointed layer redoes: all but the down projection."""
        return self.layer_weights - self.hidden * self.intermediate

    @property
    def read_weights(self) -> int:
        """Weights a decode step reads in full: every layer's and the head's (embedding rows are gathered)."""
        return self.layers * self.layer_weights + self.hidden * self.head_width

    @property
    def params(self) -> int:
        """Weights of the whole model (norms and biases aside): the read weights plus an untied embedding."""
        return self.read_weights + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def kv_bytes_per_token(self, dtype: str | torch.dtype) -> int:
        """Bytes of the K and V cache entries of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype_name(dtype)]

    # FLOPs per unit of work, the three terms of the module docstring.
    @property
    def linear_flops_per_token(self) -> int:
        return 2 * self.layers * self.layer_weights

    @property
    def attention_flops_per_pair(self) -> int:
        return 4 * self.layers * self.heads * self.head_dim  # q.k and p.v, 2 FLOPs per multiply-add each

    @property
    def head_flops_per_token(self) -> int:
        return 2 * self.hidden * self.head_width


@dataclass(frozen=True)
class Flops:
    """Matmul FLOPs split by where they go (module docstring); ``total`` is their sum."""

    linear: float = 0.0
    attention: float = 0.0
    head: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.head

    @property
    def layers(self) -> float:
        """The decoder layers' part (what gradient checkpointing recomputes)."""
        return self.linear + self.attention

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(self.linear + other.linear, self.attention + other.attention, self.head + other.head)

    def __mul__(self, k: float) -> "Flops":
        return Flops(self.linear * k, self.attention * k, self.head * k)

    __rmul__ = __mul__


def attention_pairs(length: int, *, causal: bool = True) -> int:
    """Query/key pairs of one sequence: L(L+1)/2 causal, L*L for the full square."""
    return length * (length + 1) // 2 if causal else length * length


def _check_lengths(name: str, lengths: Sequence[int]) -> list[int]:
    out = [int(x) for x in lengths]
    bad = [i for i, x in enumerate(out) if x < 0]
    if bad:
        raise ValueError(f"{name}[{bad[0]}]={out[bad[0]]}: lengths must be >= 0")
    return out


def forward_flops(shape: ModelShape, lengths: Sequence[int], *, head_tokens: int | None = None,
                  causal: bool = True) -> Flops:
    """One forward over packed sequences of these lengths (each attends only within itself).

    ``head_tokens``: positions the head is applied to (default every token; the actor's log-prob pass
    applies it only to the response tokens it scores).
    """
    lengths = _check_lengths("lengths", lengths)
    tokens = sum(lengths)
    head_tokens = tokens if head_tokens is None else head_tokens
    if not 0 <= head_tokens <= tokens:
        raise ValueError(f"head_tokens={head_tokens} must be in [0, {tokens}] (the tokens of the forward)")
    pairs = sum(attention_pairs(n, causal=causal) for n in lengths)
    return Flops(linear=float(shape.linear_flops_per_token * tokens),
                 attention=float(shape.attention_flops_per_pair * pairs),
                 head=float(shape.head_flops_per_token * head_tokens))


def train_flops(shape: ModelShape, lengths: Sequence[int], *, head_tokens: int | None = None,
                recompute: bool = False, causal: bool = True) -> Flops:
    """Forward + backward (3 x forward); ``recompute`` adds the checkpointed layers' second forward
    (every layer but the last, all of each but its down projection: module docstring)."""
    fwd = forward_flops(shape, lengths, head_tokens=head_tokens, causal=causal)
    if not recompute:
        return 3 * fwd
    checkpointed = (shape.layers - 1) / shape.layers
    redone = fwd.linear * checkpointed * shape.recomputed_layer_weights / shape.layer_weights
    return 3 * fwd + Flops(linear=redone, attention=fwd.attention * checkpointed)


def decode_flops(shape: ModelShape, contexts: Sequence[int]) -> Flops:
    """Generating one token per row, rows decoded together; ``contexts[i]``: keys row i's new token
    attends to (its cached tokens plus itself)."""
    contexts = _check_lengths("contexts", contexts)
    return decode_step_flops(shape, rows=len(contexts), keys=sum(contexts))


def decode_step_flops(shape: ModelShape, *, rows: int, keys: int) -> Flops:
    """:func:`decode_flops` from the totals: ``rows`` new tokens attending to ``keys`` keys in all."""
    return Flops(linear=float(shape.linear_flops_per_token * rows),
                 attention=float(shape.attention_flops_per_pair * keys),
                 head=float(shape.head_flops_per_token * rows))


def decode_step_bytes(shape: ModelShape, *, keys: int, dtype: str | torch.dtype) -> float:
    """Memory read by one decode step of a batch: every weight once (however many rows) plus the KV
    cache of every key attended to (the new token's entry, written, counted with them)."""
    size = DTYPE_BYTES[dtype_name(dtype)]
    return float(shape.read_weights * size + shape.kv_bytes_per_token(dtype) * keys)
