"""transformers rollout: batched ``model.generate`` on the actor's own module (``rollout.name=hf``).

The portable engine: it runs wherever the actor runs, needs nothing beyond transformers, and is the
reference the vLLM backend is tested against. The module IS the actor (possibly FSDP2-wrapped; its
normal forward gathers the shards), so ``update_weights`` has nothing to do and sleep/wake have no
memory of their own to release.

Sampling: prompts are repeated ``n`` times, interleaved (rows i*n .. i*n+n-1 belong to prompt i), and
sampled in one call with a KV cache: the static-cache decode loop of :mod:`grpo_npu.rollout.static_decode`
(fixed buffers, the step replayed as a CUDA graph on CUDA; on the actor's module inside its ``decoding``
block: layers gathered once, FSDP's hooks lifted), or transformers ``generate`` for models and attention
kernels that loop does not cover. Decoding steps attend through :mod:`grpo_npu.rollout.decode_attention`
(grouped-query attention without copying the cache). A seeded call forks the RNG and seeds it, so it is
reproducible and leaves the caller's RNG untouched; unlike vLLM, the seed is per call, not per sample.

Log-probs (``return_logprobs``): ``log_softmax`` of the scores ``generate`` sampled from, i.e. the
logits after the temperature, top-k and top-p processors (removed tokens at -inf). With top-k/top-p
off that is log_softmax(logits / temperature), the actor's own definition; greedy uses temperature 1.
vLLM's backend returns the same quantity (``logprobs_mode="processed_logprobs"``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from grpo_npu.device import get_device
from grpo_npu.rollout.base import GenerationOutput, Rollout, SamplingConfig, check_prompts, pack_responses
from grpo_npu.rollout.decode_attention import decode_attention
from grpo_npu.rollout.static_decode import static_generate, unsupported

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _seeded(seed: Optional[int], device: torch.device) -> Iterator[None]:
    """Run the block with the global RNG seeded (CPU and ``device``), restoring it afterwards."""
    if seed is None:
        yield
        return
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)
        yield


class HFRollout(Rollout):
    """Generation with the actor's transformers CausalLM."""

    def __init__(self, module: nn.Module, *, pad_token_id: int, eos_token_ids: Sequence[int]) -> None:
        if not hasattr(module, "generate"):
            raise ValueError(f"rollout.name=hf needs a transformers CausalLM with .generate(); got {type(module).__name__}")
        self.module = module
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._logged_path: object = ()  # the decode path last logged (logged again when it changes)

    def _generation_config(self, sampling: SamplingConfig):
        """Every sampling knob set explicitly, so the checkpoint's generation_config.json cannot add any."""
        greedy = sampling.greedy
        # Greedy runs no warpers: temperature/top-p/top-k stay unset (transformers warns if they are set).
        return GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else max(sampling.top_k, 0),  # 0: top-k off in transformers
            min_p=None,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            num_return_sequences=1,
            pad_token_id=self.pad_token_id,
            # An empty eos list never stops: that is ignore_eos. (None would be filled from the checkpoint.)
            eos_token_id=[] if sampling.ignore_eos else list(self.eos_token_ids),
            use_cache=True,
            output_scores=sampling.return_logprobs,
            return_dict_in_generate=True,
        )

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig) -> GenerationOutput:
        check_prompts(prompt_ids, prompt_mask)
        # Prompts arrive left-padded to data.max_prompt_length; the columns no row uses would only lengthen
        # every decoding step's attention and KV cache (positions come from the mask, so dropping them is exact).
        first = int(prompt_mask.bool().any(dim=0).nonzero()[0])
        prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]  # (B, P') with P' the longest prompt
        n = sampling.n
        device = next(self.module.parameters()).device
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        was_training = self.module.training
        self.module.eval()
        try:
            with _seeded(sampling.seed, device), decode_attention(self._hf_model()) as grouped:  # GQA without KV copies
                generated = logp = None
                if self._static(grouped):
                    with self._decoding() as model:
                        if model is not None:
                            generated, logp = static_generate(  # prefills each prompt once for its n rows
                                model, prompt_ids, prompt_mask, sampling, pad_token_id=self.pad_token_id,
                                eos_token_ids=self.eos_token_ids,
                                graphs=get_device("cuda") if device.type == "cuda" else None)
                if generated is None:  # prompt i -> rows i*n..i*n+n-1
                    generated, logp = self._generate(prompt_ids.repeat_interleave(n, dim=0),
                                                     prompt_mask.repeat_interleave(n, dim=0), sampling)
        finally:
            self.module.train(was_training)
        return self._pack(generated.cpu(), logp.cpu() if logp is not None else None, sampling.ignore_eos)

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig):
        """transformers ``generate``: (tokens (B*n, T'), log-probs (B*n, T') | None), on the model's device."""
        out = self.module.generate(input_ids=ids, attention_mask=mask, generation_config=self._generation_config(sampling))
        generated = out.sequences[:, ids.shape[1] :]  # (B*n, T'), pad after a finished row's eos
        if not sampling.return_logprobs:
            return generated, None
        # One step at a time: stacking T' x (B*n, V) scores would hold the whole vocabulary per token.
        logp = torch.stack([torch.log_softmax(s.float(), dim=-1).gather(-1, generated[:, t, None])[:, 0]
                            for t, s in enumerate(out.scores)], dim=1)  # (B*n, T')
        return generated, logp

    def _decoding(self):
        """A block yielding the model to decode with (the actor wrapper's ``decoding``), or None: use generate."""
        decoding = getattr(self.module, "decoding", None)
        return decoding() if decoding is not None else contextlib.nullcontext(self._hf_model())

    def _static(self, grouped: bool) -> bool:
        """Whether the static-cache loop decodes (sdpa attention, now the decode attention, and a model it covers)."""
        reason = "attention is not sdpa" if not grouped else unsupported(self._hf_model())
        if reason != self._logged_path:
            self._logged_path = reason
            log.info("hf rollout: %s", "static-cache decode loop" if reason is None
                     else f"transformers generate ({reason})")
        return reason is None

    def _hf_model(self) -> nn.Module:
        """The transformers model itself: the actor's module (``workers.response_model``) wraps it as ``.hf``."""
        return getattr(self.module, "hf", self.module)

    def _pack(self, generated: torch.Tensor, logp: Optional[torch.Tensor], ignore_eos: bool) -> GenerationOutput:
        """Cut each row after its first eos (kept, mask 1) and right-pad; stop_reason 'stop' or 'length'."""
        is_eos = torch.zeros_like(generated, dtype=torch.bool)  # (B*n, T')
        if not ignore_eos:
            for eos in self.eos_token_ids:
                is_eos |= generated == eos
        tokens, logps, reasons = [], [], []
        for i, row in enumerate(generated.tolist()):
            hits = is_eos[i].nonzero()
            length = int(hits[0]) + 1 if len(hits) else len(row)
            tokens.append(row[:length])
            reasons.append("stop" if len(hits) else "length")
            if logp is not None:
                logps.append(logp[i, :length].tolist())
        return pack_responses(tokens, reasons, self.pad_token_id, logps if logp is not None else None)

    @torch.no_grad()
    def prompt_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """log_softmax of the module's plain forward (``module.logits`` where the actor wrapper has it)."""
        device = next(self.module.parameters()).device
        ids = torch.full((len(sequences), max(map(len, sequences))), self.pad_token_id, dtype=torch.long)  # (B, L)
        mask = torch.zeros_like(ids)  # (B, L), right-padded
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[i, : len(seq)] = 1
        ids, mask = ids.to(device), mask.to(device)
        was_training = self.module.training
        self.module.eval()
        try:
            forward = getattr(self.module, "logits", None)
            logits = forward(ids, mask) if forward is not None else self.module(input_ids=ids, attention_mask=mask).logits
        finally:
            self.module.train(was_training)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, L-1)
        return [logp[i, : len(seq) - 1].cpu() for i, seq in enumerate(sequences)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """No-op: this rollout generates with the actor's module itself, so it always has the new weights.

        The iterator is not consumed (so a gathering generator runs no collectives, on any rank).
        """
        log.debug("hf rollout: update_weights is a no-op (generation uses the actor's module)")

    def sleep(self) -> None:
        """No-op: the actor's module is not the rollout's to release."""
        log.debug("hf rollout: sleep is a no-op (generation uses the actor's module)")

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """No-op: nothing was released."""
        log.debug("hf rollout: wake_up(%s) is a no-op", tags)
