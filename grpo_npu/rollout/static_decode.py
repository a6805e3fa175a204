"""Static-cache decoding for the transformers rollout: fixed shapes, one forward per token, CUDA graphs on CUDA.

transformers' ``generate`` grows a ``DynamicCache`` by concatenation (every layer's whole cache is copied at
every token), rebuilds the attention mask, and runs its logits processors and stopping criteria in Python
at every token; on an accelerator the decode step of a small model is then bound by that Python and by
kernel launches, not by the device. This loop keeps every shape fixed for the whole call instead:

- prefill once per prompt: the B prompts are prefilled, then their cache rows and last logits copied to
  their n samples' rows (``generate`` prefills all B*n rows, n copies of the same work);
- cache: per layer, (B*n, Nkv, P + T, D) key and value buffers allocated at the prefill and written in
  place (``index_copy_`` at a device-side position), :class:`StaticKV` -- the one method attention layers
  call, ``update``, is all transformers needs of a cache when positions and masks are given;
- masks: 4-D boolean masks made here and handed to the model, which transformers passes through as
  prepared masks. Prefill: (B, 1, P, P) causal and padding over the prompt's slots alone, each pad
  position seeing itself (no fully masked row).
  Decode: the (B, 1, 1, P + T) padding mask, the slot being written switched on inside the step;
- positions: as ``generate`` derives them (cumulative mask count - 1), so every token sees the same
  positions as there;
- sampling: ``generate``'s own processors in its order (temperature, top-k, top-p), then softmax and
  :func:`sample_tokens` (argmax when greedy) on fp32 logits; finished rows emit the pad token.
  :func:`sample_tokens` draws from the distribution ``torch.multinomial`` draws from, not its random
  numbers: with ``torch.multinomial`` swapped for it, a seeded ``generate`` draws the loop's tokens
  (tests/rollout/test_static_decode.py);
- CUDA: after one eager decode step, the step (mask update, forward, fp32 logits) is captured in a CUDA
  graph and replayed for every later token, so a token costs one graph launch plus the sampling ops.
- stopped rows leave (eager steps, i.e. without CUDA graphs): once at most half the rows in the batch
  still run, the others are dropped from the cache, mask and inputs (:class:`_Rows`), so a batch whose
  answers mostly stop early stops paying for them. The random draws stay those of the whole batch, so the
  tokens are the same as without it. On the eos step benchmark's batch (64 rows of the default job's
  model, answers of 14-32 tokens, 2 CPU threads) the two changes took the loop from 0.11-0.20 s to
  0.07-0.12 s, same tokens; 16-18% at fixed length (3M model, 64 x 64 tokens), from the prefill alone.

Rows stop at eos as in ``generate``; the loop ends when every row has stopped (checked every
``CHECK_EVERY`` tokens on an accelerator, where the check waits for the device) or at T tokens.
:func:`unsupported` says when the loop cannot stand in for ``generate`` (the rollout then calls
``generate``): attention other than sdpa, sliding-window layers, encoder-decoder models, or a model
transformers does not mark as full-graph compilable.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from grpo_npu.device import Device
from grpo_npu.rollout.base import SamplingConfig


# Tokens between "has every row stopped?" checks on an accelerator (each check waits for the device);
# on CPU every token is checked.
DEVICE_CHECK_EVERY = 8


class StaticKV:
    """A transformers-compatible cache with fixed (B, Nkv, S, D) buffers, written at ``positions``."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: Optional[torch.Tensor] = None  # (q,) long: the slots this forward writes
        self.visible = length  # slots attention sees: the prompt's during the prefill, all of them after

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write (B, Nkv, q, D) states at ``positions``; return the (B, Nkv, visible, D) views of the buffers."""
        if layer_idx == len(self.keys):  # first (prefill) call of this layer: allocate
            b, heads, _, dim = key_states.shape
            self.keys.append(key_states.new_zeros((b, heads, self.length, dim)))
            self.values.append(value_states.new_zeros((b, heads, self.length, value_states.shape[-1])))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.positions, key_states)
        values.index_copy_(2, self.positions, value_states)
        if self.visible < self.length:
            return keys[:, :, : self.visible], values[:, :, : self.visible]
        return keys, values

    def repeat_rows(self, n: int) -> None:
        """Row i of every buffer becomes rows i*n .. i*n+n-1 (one prefill serving n samples of a prompt)."""
        self.keys = [k.repeat_interleave(n, dim=0) for k in self.keys]
        self.values = [v.repeat_interleave(n, dim=0) for v in self.values]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (long, in order) of every buffer."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]


def unsupported(model: nn.Module) -> Optional[str]:
    """Why the static loop cannot run ``model`` (then ``generate`` does), or None."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} is not marked full-graph compilable by transformers"
    layer_types = getattr(config, "layer_types", None)  # where a config lists them, they decide
    sliding = (any(t != "full_attention" for t in layer_types) if layer_types is not None
               else getattr(config, "sliding_window", None) is not None)
    if sliding:
        return "sliding-window attention layers"
    return None


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """(B, V) fp32 logits -> the scores ``generate`` samples from: temperature, top-k, top-p, in its order."""
    if sampling.greedy:
        return logits
    scores = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    if sampling.top_k > 0:
        k = min(sampling.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove_sorted = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - sampling.top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove_sorted.scatter(1, order, remove_sorted), float("-inf"))
    return scores


def sample_tokens(probs: torch.Tensor, rows: Optional[torch.Tensor] = None, total: int = 0) -> torch.Tensor:
    """One token per row of (B, V) probabilities -> (B,) long, drawn from the global generator of their device.

    ``rows`` (B,) long: which of ``total`` rows these are (None: all of them). The noise is then drawn for
    all ``total`` rows and each row takes its own, so a row draws the same token whether or not the rows
    that stopped before it are still in the batch.

    The exponential race ``torch.multinomial(probs, 1)`` runs: argmax_i p_i / E_i with E_i ~ Exp(1) picks
    token i with probability p_i. The noise is drawn as -log(U), U uniform in [0, 1) raised to the smallest
    normal float, so every E is finite and positive: a token of probability 0 scores 0 and is never picked
    while another can be (a U of 0 would make E infinite and score a certain token 0).
    Why not ``torch.multinomial``: torch's CPU ``exponential_`` is a serial double-precision loop, about 14 ns
    per element on this project's CPU (0.95 ms for 64 rows of a 1,024-token vocabulary, 8.9 ms for 4 rows of
    151,936), against 0.2 / 1.6-2.2 ms for this: at 64 rows of the tiny model, sampling cost as much as a
    decoding step's forward.
    """
    shape = probs.shape if rows is None else (total, probs.shape[-1])
    noise = torch.rand(shape, dtype=probs.dtype, device=probs.device)
    noise = noise.clamp_min_(torch.finfo(probs.dtype).tiny).log_().neg_()  # Exp(1), > 0
    return (probs / (noise if rows is None else noise[rows])).argmax(dim=-1)


def _prefill_mask(keep: torch.Tensor) -> torch.Tensor:
    """(B, P) bool padding mask -> (B, 1, P, P) bool: causal and padding; a pad position sees itself."""
    p = keep.shape[1]
    causal = torch.ones(p, p, dtype=torch.bool, device=keep.device).tril()  # (P, P)
    allowed = causal[None] & keep[:, None, :]  # (B, P, P)
    allowed |= torch.eye(p, dtype=torch.bool, device=keep.device)[None]  # no fully masked rows
    return allowed[:, None]  # (B, 1, P, P), as large as generate's own prefill mask


class _DecodeStep:
    """The per-token forward on fixed buffers; on CUDA captured once and replayed."""

    def __init__(self, model: nn.Module, cache: StaticKV, keep: torch.Tensor, length: int) -> None:
        b, p = keep.shape
        self.model, self.cache = model, cache
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=keep.device)  # (B, 1) the token fed
        self.position_ids = torch.zeros(b, 1, dtype=torch.long, device=keep.device)  # (B, 1)
        self.slot = torch.zeros(1, dtype=torch.long, device=keep.device)  # (1,) cache slot written
        self.mask = torch.zeros(b, 1, 1, length, dtype=torch.bool, device=keep.device)  # (B, 1, 1, S)
        self.mask[:, 0, 0, :p] = keep
        self.replay: Optional[Callable[[], torch.Tensor]] = None  # the captured step (CUDA), once captured
        self.capture_failed = False

    def _forward(self) -> torch.Tensor:
        self.mask.index_fill_(-1, self.slot, True)
        self.cache.positions = self.slot
        out = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.position_ids,
                         past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1].float()  # (B, V)

    def __call__(self, graphs: Optional[Device]) -> torch.Tensor:
        """This token's (B, V) fp32 logits: a graph replay once captured, else the step itself (the first
        call with ``graphs`` runs it and captures it through :meth:`Device.capture_graph`)."""
        if self.replay is not None:
            return self.replay()
        if graphs is None or self.capture_failed:
            return self._forward()
        logits, self.replay = graphs.capture_graph(self._forward)
        self.capture_failed = self.replay is None
        return logits

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of the step's inputs (eager steps only: a captured graph holds the old buffers)."""
        assert self.replay is None, "a captured decode step cannot change its batch"
        self.ids, self.position_ids, self.mask = self.ids[rows], self.position_ids[rows], self.mask[rows]

    def release(self) -> None:
        self.replay = None


class _Rows:
    """Which output rows the decode batch's rows are, and when the stopped ones leave it.

    Rows that stopped at eos still cost a full row of every later step's forward. Without graphs
    (``shrink``), once at most half the rows in the batch are still running, the stopped ones leave: the
    cache, mask and inputs keep the running rows only. Each shrink copies the cache once, and halving bounds
    the copies at log2 of the rows. With graphs the batch keeps its shape (the graph holds its buffers).
    """

    def __init__(self, shrink: bool) -> None:
        self.shrink = shrink
        self.index: Optional[torch.Tensor] = None  # (R',) long: batch row -> output row; None: the identity

    def should_shrink(self, running_rows: int, batch_rows: int) -> bool:
        return self.shrink and running_rows <= batch_rows // 2

    def select(self, kept: torch.Tensor) -> None:
        self.index = kept if self.index is None else self.index[kept]

    def write(self, out: torch.Tensor, t: int, values: torch.Tensor) -> None:
        """``out[:, t]`` (output rows) <- ``values`` (batch rows)."""
        if self.index is None:
            out[:, t] = values
        else:
            out[self.index, t] = values


@torch.no_grad()
def static_generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig, *,
                    pad_token_id: int, eos_token_ids: Sequence[int], graphs: Optional[Device] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sample ``sampling.n`` responses of up to T tokens to each left-padded (B, P) prompt.

    Returns (tokens (B*n, T'), log-probs (B*n, T') | None), prompt i -> rows i*n .. i*n+n-1. Tokens after a
    row's eos are ``pad_token_id``; log-probs are those of the processed scores (see :func:`process_logits`),
    as ``generate`` with ``output_scores`` gives them. ``graphs``: the device whose graphs replay the decode
    step (None: every step eager). The B prompts are prefilled once and their cache copied to their n rows.
    Without graphs, rows that have stopped leave the batch (see :class:`_Rows`); the random draws are those
    of the whole batch every step, so the tokens do not depend on when rows leave.
    """
    n = sampling.n
    b, p = ids.shape
    rows = b * n
    steps = sampling.max_new_tokens
    length = p + steps
    device = ids.device
    keep = mask.bool()  # (B, P)
    position_ids = mask.long().cumsum(-1) - 1  # (B, P), generate's convention
    position_ids.masked_fill_(~keep, 1)
    cache = StaticKV(length)
    cache.positions, cache.visible = torch.arange(p, device=device), p  # the prefill sees the prompt's slots
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=ids, attention_mask=_prefill_mask(keep), position_ids=position_ids,
                past_key_values=cache, use_cache=True, **last_only)
    logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)  # (B*n, V)
    del out
    if n > 1:
        cache.repeat_rows(n)
        keep, position_ids = keep.repeat_interleave(n, dim=0), position_ids.repeat_interleave(n, dim=0)
    cache.visible = length
    step = _DecodeStep(model, cache, keep, length)
    next_position = position_ids[:, -1:] + 1  # (B*n, 1): prompts are left-padded, so the last column is real
    eos = torch.tensor(list(eos_token_ids) if not sampling.ignore_eos else [], dtype=torch.long, device=device)
    tokens = torch.full((rows, steps), pad_token_id, dtype=torch.long, device=device)  # (B*n, T)
    logp = torch.zeros(rows, steps, dtype=torch.float32, device=device) if sampling.return_logprobs else None
    live = _Rows(shrink=graphs is None)  # which output rows the batch's rows are
    running = torch.ones(rows, dtype=torch.bool, device=device)  # (R,) over the rows in the batch
    check_every = 1 if device.type == "cpu" else DEVICE_CHECK_EVERY
    done = steps
    try:
        for t in range(steps):
            scores = process_logits(logits, sampling)  # (R, V)
            if sampling.greedy:
                token = torch.argmax(scores, dim=-1)
            else:
                token = sample_tokens(torch.softmax(scores, dim=-1), live.index, rows)
            token = torch.where(running, token, pad_token_id)  # (R,)
            live.write(tokens, t, token)
            if logp is not None:
                live.write(logp, t, torch.log_softmax(scores, dim=-1).gather(-1, token[:, None])[:, 0])
            if eos.numel():
                running &= ~torch.isin(token, eos)
            running_rows = int(running.sum()) if (t + 1) % check_every == 0 else -1  # -1: not checked now
            if t + 1 == steps or running_rows == 0:
                done = t + 1
                break
            if running_rows > 0 and live.should_shrink(running_rows, running.shape[0]):
                kept = running.nonzero()[:, 0]  # (R',) the running rows, in batch order
                live.select(kept)
                cache.select_rows(kept)
                step.select_rows(kept)
                next_position, running, token = next_position[kept], running[kept], token[kept]
            step.ids.copy_(token[:, None])
            step.position_ids.copy_(next_position + t)
            step.slot.fill_(p + t)
            logits = step(graphs)
    finally:
        step.release()
    return tokens[:, :done], (logp[:, :done] if logp is not None else None)
