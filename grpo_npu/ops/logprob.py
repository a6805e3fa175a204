"""Token log-probabilities (and entropy) without a full fp32 (tokens x vocab) log-softmax.

Two entry points, both returning fp32 values shaped like ``labels``:
- :func:`logprobs_from_logits` -- logits (N, V) or (B, T, V) already exist;
- :func:`linear_logprobs` -- hidden states (N, H) or (B, T, H) and the lm_head weight (V, H): the
  logits are formed chunk by chunk and never exist in full, which is what makes the actor's
  8 x 1024 x 151,936 log-prob pass fit.

Both run a custom autograd Function over row chunks: forward keeps only the per-token log-sum-exp,
backward recomputes each chunk's softmax (and, for the linear form, its logits), so neither pass
holds more than one chunk of fp32 (rows, V) tensors. Logits are divided by ``temperature`` before
the softmax, as verl does with the rollout temperature.

Per-chunk statistics come from the backend chosen once for the op:
- ``npu``: ``torch_npu.npu_cross_entropy_loss(reduction="none")`` on the fp32 chunk (N <= 200,000
  rows per call); logp = -loss, lse = z[label] + loss, entropy from its log_prob output. The
  kernel's own backward is not used: it would keep its (N, V) log_prob for every chunk.
- ``cuda``: with flash-attn installed, logp-only calls on CUDA tensors go to flash-attn's Triton
  cross-entropy over the whole logits (fp32 inside, saves only logits and lse, backward writes
  the gradient in the logits' dtype). Entropy and the linear form use the chunked path.
- ``reference``: logsumexp / gather / softmax in plain torch.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator

import torch

from grpo_npu import device
from grpo_npu.ops import dispatch
from grpo_npu.ops.linear import mm_nt

# npu_cross_entropy_loss accepts N in (0, 200000] rows per call (op-plugin docs).
NPU_CE_MAX_ROWS = 200_000
# Rows per chunk are chosen so one fp32 (rows, V) block is about this size. A chunk holds at most
# ~3 such blocks (tempered logits, softmax, one product; the logp-only backward works in place in
# one), so a few hundred MiB of transient memory whatever the token count. This is the CPU size
# (blocks that stay near the caches); an accelerator gets ACCELERATOR_BLOCK_FRACTION of its memory,
# within [CHUNK_BLOCK_BYTES, ACCELERATOR_BLOCK_MAX_BYTES]: fewer, larger kernel calls (one
# npu_cross_entropy_loss / matmul per chunk) for ~1% of the device held transiently.
CHUNK_BLOCK_BYTES = 64 * 1024**2
ACCELERATOR_BLOCK_FRACTION = 1 / 256  # 256 MiB blocks on a 64 GiB Ascend 910B, 320 MB on an 80 GB H100
ACCELERATOR_BLOCK_MAX_BYTES = 1024**3
_FLASH_ATTN_CE = "flash_attn.ops.triton.cross_entropy"


def _flash_attn_ce_installed() -> bool:
    try:
        importlib.import_module(_FLASH_ATTN_CE)
        return True
    except ImportError:
        return False


BACKEND = dispatch.register(dispatch.OpBackend("logprob", ("npu", "cuda", "reference"),
                                               dispatch.auto_npu_cuda_or_reference(_flash_attn_ce_installed)))

# (z (n, V) fp32 tempered logits, labels (n,), with_entropy) -> (logp (n,), lse (n,), entropy (n,) | None)
ChunkStats = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def set_backend(name: str | None) -> None:
    """Force 'npu' | 'cuda' | 'reference' for log-probs (None: automatic)."""
    BACKEND.set(name)


def default_chunk_rows(vocab_size: int, block_bytes: int = CHUNK_BLOCK_BYTES) -> int:
    """Rows per chunk so that one fp32 (rows, vocab) block is about ``block_bytes``."""
    return max(1, min(NPU_CE_MAX_ROWS, block_bytes // (4 * vocab_size)))


@functools.lru_cache(maxsize=None)
def _block_bytes(kind: str, index: int | None) -> int:
    if kind not in ("npu", "cuda"):
        return CHUNK_BLOCK_BYTES
    total = device.Device(kind).total_memory(index)
    return int(min(ACCELERATOR_BLOCK_MAX_BYTES, max(CHUNK_BLOCK_BYTES, total * ACCELERATOR_BLOCK_FRACTION)))


def chunk_block_bytes(where: torch.device) -> int:
    """The fp32 block size for tensors on ``where``: CHUNK_BLOCK_BYTES on CPU, a share of an accelerator's memory."""
    return _block_bytes(where.type, where.index)


# ------------------------------------------------------------------------------------------------
# Per-chunk statistics
# ------------------------------------------------------------------------------------------------
def _stats_reference(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    return logp, lse, entropy


def _stats_npu(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
    loss, log_prob, _, _ = dispatch.torch_npu().npu_cross_entropy_loss(z, labels, reduction="none")
    lse = z.gather(-1, labels[:, None]).squeeze(-1) + loss  # loss = lse - z[label]
    entropy = -(log_prob.exp() * log_prob).sum(-1) if with_entropy else None
    return -loss, lse, entropy


def _tempered(x: torch.Tensor, temperature: float, *, writable: bool, owned: bool = False) -> torch.Tensor:
    """fp32 (n, V) logits / temperature, copying only when needed.

    writable: the caller will overwrite the result, so it must not alias the input.
    owned: x is already a temporary of ours (a matmul output) whose storage may be reused.
    """
    if x.dtype != torch.float32 or owned:
        z = x.float()  # a fresh block (or our own temporary)
        return z.div_(temperature) if temperature != 1.0 else z
    if temperature != 1.0:
        return x / temperature
    return x.clone() if writable else x


def _chunk_grad(
    z: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    g_logp: torch.Tensor,
    g_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d(loss)/d(logits) for one chunk, fp32 (n, V), computed in place of the tempered logits z.

    d logp / dz = onehot - p and d H / dz_j = -p_j (z_j - E_p[z]), so the gradient is
    onehot * g_logp - p * (g_logp + g_entropy * (z - E_p[z])).
    """
    if g_entropy is None:
        grad = z.sub_(lse[:, None]).exp_().mul_(-g_logp[:, None])  # -p * g_logp, in z's storage
    else:
        p = torch.exp(z - lse[:, None])
        mean_z = (p * z).sum(-1, keepdim=True)
        weight = z.sub_(mean_z).mul_(g_entropy[:, None]).add_(g_logp[:, None])
        grad = p.mul_(weight).neg_()
    grad.scatter_add_(1, labels[:, None], g_logp[:, None])
    return grad.div_(temperature) if temperature != 1.0 else grad


def _defined_grads(g_logp, g_entropy, lse: torch.Tensor, with_entropy: bool):
    """Incoming gradients with materialisation off: a None logp gradient becomes zeros; a None entropy
    gradient (entropy computed for a metric, not in the loss) stays None so the chunk takes the cheaper
    logp-only formula."""
    if g_logp is None:
        g_logp = torch.zeros_like(lse)
    return g_logp, (g_entropy if with_entropy else None)


def _row_blocks(shape: torch.Size, rows: int) -> Iterator[tuple]:
    """Index tuples covering a (N, ...) or (B, T, ...) tensor in row chunks of at most ``rows``."""
    if len(shape) == 1:
        for s in range(0, shape[0], rows):
            yield (slice(s, s + rows),)
    else:
        for b in range(shape[0]):
            for s in range(0, shape[1], rows):
                yield (b, slice(s, s + rows))


def _rows_view(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V) and labels (...) as (N, V) and (N,) when that is a view, else left (B, T, V) / (B, T)."""
    try:
        return x.view(-1, x.shape[-1]), labels.reshape(-1)
    except RuntimeError:  # a strided slice such as logits[:, a:b]: walk it per batch row, no copy
        if x.dim() != 3:
            raise ValueError(f"non-contiguous logits must be (B, T, V), got {tuple(x.shape)}") from None
        return x, labels


# ------------------------------------------------------------------------------------------------
# Autograd Functions
# ------------------------------------------------------------------------------------------------
class _ChunkedLogprobs(torch.autograd.Function):
    """logits (N, V) | (B, T, V) -> (logp, entropy) fp32 shaped like labels; recomputes per chunk."""

    @staticmethod
    def forward(ctx, logits, labels, temperature: float, rows: int, with_entropy: bool, stats: ChunkStats):
        logp = logits.new_empty(labels.shape, dtype=torch.float32)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for idx in _row_blocks(labels.shape, rows):
            lp, ls, ent = stats(_tempered(logits[idx], temperature, writable=False), labels[idx], with_entropy)
            logp[idx], lse[idx] = lp, ls
            if with_entropy:
                entropy[idx] = ent
        ctx.save_for_backward(logits, labels, lse)
        ctx.set_materialize_grads(False)  # an entropy kept out of the loss arrives as None: cheaper backward
        ctx.temperature, ctx.rows, ctx.with_entropy = temperature, rows, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, labels, lse = ctx.saved_tensors
        g_logp, g_entropy = _defined_grads(g_logp, g_entropy, lse, ctx.with_entropy)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for idx in _row_blocks(labels.shape, ctx.rows):
            z = _tempered(logits[idx], ctx.temperature, writable=True)
            g_ent = g_entropy[idx] if g_entropy is not None else None
            grad[idx] = _chunk_grad(z, labels[idx], lse[idx], g_logp[idx], g_ent, ctx.temperature)
        return grad, None, None, None, None, None


def _linear_forward(hidden, weight, labels, temperature: float, rows: int, with_entropy: bool, stats: ChunkStats,
                    onednn: bool, with_sum_pi_squared: bool = False):
    """(logp, lse, entropy or an empty tensor, sum_v pi_v^2 or an empty tensor), each (N,) fp32, over the chunks of
    logits = hidden @ weight.T / temperature. sum_v pi_v^2 = exp(logsumexp(2 z) - 2 lse), from the same chunk."""
    n = hidden.shape[0]
    logp = hidden.new_empty(n, dtype=torch.float32)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
    sum_sq = torch.empty_like(logp) if with_sum_pi_squared else logp.new_empty(0)
    for s in range(0, n, rows):
        z = _tempered(mm_nt(hidden[s : s + rows], weight, onednn=onednn), temperature, writable=False,
                      owned=True)  # (rows, V)
        lp, ls, ent = stats(z, labels[s : s + rows], with_entropy)
        logp[s : s + rows], lse[s : s + rows] = lp, ls
        if with_entropy:
            entropy[s : s + rows] = ent
        if with_sum_pi_squared:
            sum_sq[s : s + rows] = torch.exp(torch.logsumexp(z.mul_(2.0), dim=-1) - 2.0 * ls)  # z is ours: doubled in place
    return logp, lse, entropy, sum_sq


class _LinearLogprobs(torch.autograd.Function):
    """hidden (N, H), weight (V, H) -> (logp, entropy) over logits = hidden @ weight.T, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, rows: int, with_entropy: bool, stats: ChunkStats,
                onednn: bool):
        logp, lse, entropy, _ = _linear_forward(hidden, weight, labels, temperature, rows, with_entropy, stats, onednn)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.set_materialize_grads(False)  # an entropy kept out of the loss arrives as None: cheaper backward
        ctx.temperature, ctx.rows, ctx.with_entropy, ctx.onednn = temperature, rows, with_entropy, onednn
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, labels, lse = ctx.saved_tensors
        g_logp, g_entropy = _defined_grads(g_logp, g_entropy, lse, ctx.with_entropy)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        onednn = ctx.onednn and hidden.dtype == torch.float32
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None  # fp32, accumulated across chunks
        for s in range(0, hidden.shape[0], ctx.rows):
            block = slice(s, s + ctx.rows)
            h = hidden[block]
            z = _tempered(mm_nt(h, weight, onednn=onednn), ctx.temperature, writable=True, owned=True)  # (rows, V)
            g_ent = g_entropy[block] if g_entropy is not None else None
            g = _chunk_grad(z, labels[block], lse[block], g_logp[block], g_ent, ctx.temperature).to(hidden.dtype)
            if need_hidden:
                grad_hidden[block] = mm_nt(g, weight.t(), onednn=onednn)  # g @ weight
            if need_weight and onednn:  # g.T @ h as one oneDNN product per chunk, no zero-filled start
                part = mm_nt(g.t(), h.t(), onednn=True)
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            elif need_weight:
                if grad_weight is None:
                    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                if g.dtype == torch.float32:
                    grad_weight.addmm_(g.t(), h)
                else:
                    grad_weight += (g.t() @ h).float()
        if need_weight:
            if grad_weight is None:  # no rows
                grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------
def _check_common(labels: torch.Tensor, temperature: float, chunk_size: int | None) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 rows, got {chunk_size}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    return labels.long()


def _stats_for(x: torch.Tensor) -> ChunkStats:
    return _stats_npu if BACKEND.pick(x) == "npu" else _stats_reference


def _flash_attn_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    ce = importlib.import_module(_FLASH_ATTN_CE)
    flat = logits.reshape(-1, logits.shape[-1]).contiguous()
    losses, _ = ce.cross_entropy_loss(flat, labels.reshape(-1), logit_scale=1.0 / temperature)
    return (-losses).view(labels.shape)


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[labels], fp32 shaped like labels; (logp, entropy) if asked.

    logits (N, V) or (B, T, V) in any float dtype (strided slices such as ``logits[:, a:b]`` are
    read in place), labels (N,) or (B, T) valid token ids (there is no ignore_index: mask padded
    positions afterwards). chunk_size: rows per chunk (default: :func:`chunk_block_bytes` of fp32).
    """
    labels = _check_common(labels, temperature, chunk_size)
    if not logits.dtype.is_floating_point or logits.shape[:-1] != labels.shape or logits.dim() not in (2, 3):
        raise ValueError(
            f"logprobs_from_logits: logits {tuple(logits.shape)} {logits.dtype} must be float (N, V) or (B, T, V) "
            f"matching labels {tuple(labels.shape)}"
        )
    backend = BACKEND.pick(logits)
    if backend == "cuda" and not with_entropy:
        return _flash_attn_logprobs(logits, labels, temperature)
    rows = chunk_size or default_chunk_rows(logits.shape[-1], chunk_block_bytes(logits.device))
    if backend == "npu":
        rows = min(rows, NPU_CE_MAX_ROWS)
    logits_rows, labels_rows = _rows_view(logits, labels)
    stats = _stats_for(logits)
    logp, entropy = _ChunkedLogprobs.apply(logits_rows, labels_rows, temperature, rows, with_entropy, stats)
    logp = logp.view(labels.shape)
    return (logp, entropy.view(labels.shape)) if with_entropy else logp


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    temperature: float = 1.0,
    onednn: bool = False,
    with_sum_pi_squared: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Log-probs of labels under logits = hidden @ weight.T, never forming all logits at once.

    hidden (N, H) or (B, T, H), weight (V, H) (the lm_head weight, no bias), labels (N,) or (B, T).
    Returns fp32 logp shaped like labels, or (logp, entropy) with ``with_entropy``. Gradients flow
    to hidden and weight; backward recomputes each chunk's logits. ``onednn``: the chunk products go
    through :func:`grpo_npu.ops.linear.mm_nt` (oneDNN for fp32 CPU tensors, the same products otherwise).
    ``with_sum_pi_squared`` (forward only: no gradient may be needed) appends sum_v pi_v^2 of each row's
    tempered softmax, shaped like labels (verl's calculate_sum_pi_squared, for the optimal token baseline).
    """
    labels = _check_common(labels, temperature, chunk_size)
    if hidden.shape[:-1] != labels.shape or hidden.dim() not in (2, 3):
        raise ValueError(
            f"linear_logprobs: hidden {tuple(hidden.shape)} must be (N, H) or (B, T, H) matching labels "
            f"{tuple(labels.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_logprobs: weight must be (V, H={hidden.shape[-1]}), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"linear_logprobs: hidden {hidden.dtype} and weight {weight.dtype} must share a dtype")
    rows = min(chunk_size or default_chunk_rows(weight.shape[0], chunk_block_bytes(hidden.device)), NPU_CE_MAX_ROWS)
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    stats = _stats_for(hidden)
    labels_rows = labels.reshape(-1)
    if with_sum_pi_squared:
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            raise ValueError("linear_logprobs: with_sum_pi_squared=True computes no gradient; call it under torch.no_grad()")
        logp, _, entropy, sum_sq = _linear_forward(hidden_rows, weight, labels_rows, temperature, rows, with_entropy,
                                                   stats, onednn, with_sum_pi_squared=True)
        return (logp.view(labels.shape), *((entropy.view(labels.shape),) if with_entropy else ()),
                sum_sq.view(labels.shape))
    logp, entropy = _LinearLogprobs.apply(hidden_rows, weight, labels_rows, temperature, rows, with_entropy, stats,
                                          onednn)
    logp = logp.view(labels.shape)
    return (logp, entropy.view(labels.shape)) if with_entropy else logp
