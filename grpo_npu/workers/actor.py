"""The FSDP2 policy: log-probs of response tokens (actor, old policy, reference) and the PPO update.

Shapes: B rows, P prompt tokens (left-padded), T response tokens (right-padded), L = P + T, H hidden,
V vocabulary, N = valid response tokens of a micro-batch. Response token j of a row is predicted by
the hidden state at position P + j - 1, so only those N hidden states ever meet the lm_head, and
:func:`grpo_npu.ops.linear_logprobs` forms their logits chunk by chunk: no (N, V) fp32 log-softmax
and no (B, L, V) logits exist.

``use_remove_padding`` packs the valid tokens of all rows of a micro-batch into one (1, sum of
lengths) sequence whose position ids restart at 0 per row; transformers then builds a block-diagonal
causal mask from the position ids (SDPA/eager), and flash-style kernels read the ``cu_seq_lens_*``
keyword arguments passed along. ``share_prompt_prefix`` packs each distinct prompt of a micro-batch
once, followed by all its responses, and attends through the ``grpo_npu`` attention with gathered
keys (see :func:`shared_prefix_inputs`): GRPO's n responses per prompt then cost one prompt pass.
All paths give the same log-probs.

Update (per rank, per training step): ``ppo_epochs`` x mini-batches x micro-batches. Each
micro-batch loss is aggregated with the GLOBAL token/sequence counts of its mini-batch (all
micro-batches on all ranks) and scaled by the world size, because FSDP averages gradients over
ranks; summing the micro-batch gradients then equals the gradient of the whole mini-batch loss,
whatever the micro-batching and the number of ranks.
"""

from __future__ import annotations

import logging
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from grpo_npu.algo import kl as kl_lib
from grpo_npu.algo import losses
from grpo_npu.batch import RolloutBatch
from grpo_npu.config import ActorConfig, Derived, FSDPConfig, ModelConfig
from grpo_npu.device import Device
from grpo_npu.ops import PATCHABLE_OPS, cu_seqlens_from_lengths, linear_logprobs, patch_model
from grpo_npu.rollout.metrics import logp_abs_diff
from grpo_npu.workers import fsdp
from grpo_npu.workers.micro_batch import fixed_groups, scatter_rows, token_budget_groups, trim_padding
from grpo_npu.workers.optim import build_optimizer, build_scheduler, optimizer_device

log = logging.getLogger(__name__)


# ================================================================================================
# Model inputs: padded or packed, and where the response tokens are predicted
# ================================================================================================
@dataclass
class ModelInputs:
    """What one forward pass needs. ``predict_index`` indexes the flattened (rows x width) hidden states."""

    input_ids: torch.Tensor  # (b, L) padded | (1, n_tokens) packed
    attention_mask: torch.Tensor | None  # (b, L) | None when packed (the mask comes from position_ids)
    position_ids: torch.Tensor  # like input_ids
    predict_index: torch.Tensor  # (N,) long: flat position whose hidden state predicts each response token
    labels: torch.Tensor  # (N,) long: the response tokens, row-major over the valid (b, T) positions
    response_valid: torch.Tensor  # (b, T) bool
    packed_kwargs: dict  # cu_seq_lens_q/k, max_length_q/k for packed batches (flash-style kernels)


def build_inputs(batch: RolloutBatch, remove_padding: bool, share_prefix: bool = False) -> ModelInputs:
    """Model inputs for a (trimmed) micro-batch.

    Every row needs at least one prompt token; prompts are left-padded and responses right-padded
    (each mask is one contiguous run of ones), which is what makes both paths agree.
    """
    prompt_len = batch.prompt_mask.sum(1)  # (b,)
    if bool((prompt_len == 0).any()):
        row = int((prompt_len == 0).nonzero()[0])
        raise ValueError(f"row {row} has no prompt tokens: the first response token would have no context")
    for name, mask, bad in (("prompt_mask", batch.prompt_mask, batch.prompt_mask[:, 1:] < batch.prompt_mask[:, :-1]),
                            ("response_mask", batch.response_mask,
                             batch.response_mask[:, 1:] > batch.response_mask[:, :-1])):
        if bool(bad.any()):
            row = int(bad.any(1).nonzero()[0])
            side = "left-padded (zeros then ones)" if name == "prompt_mask" else "right-padded (ones then zeros)"
            raise ValueError(f"row {row}: {name} must be {side}, got {mask[row].tolist()}")
    input_ids = batch.input_ids  # (b, L)
    attn = batch.attention_mask.bool()  # (b, L)
    position_ids = batch.position_ids  # (b, L)
    b, p = batch.prompt_ids.shape
    t = batch.response_ids.shape[1]
    valid = batch.response_mask.bool()  # (b, T)
    labels = batch.response_ids[valid]  # (N,)
    if share_prefix:
        return shared_prefix_inputs(batch, valid, labels)
    if not remove_padding:
        width = p + t
        rows, cols = valid.nonzero(as_tuple=True)
        predict = rows * width + (p - 1 + cols)  # flat index of position P + j - 1 in (b, L)
        return ModelInputs(input_ids, batch.attention_mask, position_ids, predict, labels, valid, {})
    packed_pos = torch.cumsum(attn.reshape(-1).long(), 0) - 1  # (b*L,) packed index of each kept token
    packed_pos = packed_pos.view(b, p + t)
    rows, cols = valid.nonzero(as_tuple=True)
    predict = packed_pos[rows, p + cols] - 1  # the kept token just before it, in the same row
    lengths = attn.sum(1)
    cu = cu_seqlens_from_lengths(lengths)
    max_len = int(lengths.max())
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    return ModelInputs(input_ids[attn][None], None, position_ids[attn][None], predict, labels, valid, kwargs)


def shared_prefix_inputs(batch: RolloutBatch, valid: torch.Tensor, labels: torch.Tensor) -> ModelInputs:
    """Each distinct prompt once, followed by the responses of every row that has it, in one packed row.

    Attention segments (``cu_seq_lens_q/k`` over keys gathered by ``kv_index``, bottom-right causal): a
    prompt attends causally to itself; a response attends to its whole prompt and causally to itself.
    Response positions continue from the prompt's length, so every row sees exactly the tokens and
    positions of its own padded row, while the linear layers process a prompt shared by k rows once
    instead of k times. Empty responses contribute no tokens. Needs the ``grpo_npu`` attention.
    """
    device = batch.prompt_ids.device
    prompt_valid = batch.prompt_mask.bool()  # (b, P)
    resp_len = batch.response_mask.sum(1).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}  # prompt tokens -> rows, in first-appearance order
    for row in range(len(batch)):
        groups.setdefault(tuple(batch.prompt_ids[row][prompt_valid[row]].tolist()), []).append(row)
    ids, pos, kv_index, q_lens, k_lens = [], [], [], [], []
    last_prompt_token = [0] * len(batch)  # packed index of each row's last prompt token
    response_start = [0] * len(batch)  # packed index of each row's first response token
    cursor = 0
    for prompt, rows in groups.items():
        pl = len(prompt)
        prompt_span = torch.arange(cursor, cursor + pl, device=device)
        ids.append(torch.tensor(prompt, dtype=batch.prompt_ids.dtype, device=device))
        pos.append(torch.arange(pl, device=device))
        kv_index.append(prompt_span)
        q_lens.append(pl)
        k_lens.append(pl)
        cursor += pl
        for row in rows:
            last_prompt_token[row], response_start[row] = int(prompt_span[-1]), cursor
            tl = resp_len[row]
            if tl == 0:
                continue
            ids.append(batch.response_ids[row, :tl])
            pos.append(torch.arange(pl, pl + tl, device=device))
            kv_index += [prompt_span, torch.arange(cursor, cursor + tl, device=device)]
            q_lens.append(tl)
            k_lens.append(pl + tl)
            cursor += tl
    rows, cols = valid.nonzero(as_tuple=True)
    first = torch.tensor(last_prompt_token, device=device)[rows]
    predict = torch.where(cols == 0, first, torch.tensor(response_start, device=device)[rows] + cols - 1)
    kwargs = {"cu_seq_lens_q": cu_seqlens_from_lengths(torch.tensor(q_lens, device=device)),
              "cu_seq_lens_k": cu_seqlens_from_lengths(torch.tensor(k_lens, device=device)),
              "max_length_q": max(q_lens), "max_length_k": max(k_lens), "kv_index": torch.cat(kv_index)}
    return ModelInputs(torch.cat(ids)[None], None, torch.cat(pos)[None], predict, labels, valid, kwargs)


def scatter_valid(flat: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N,) values at the valid positions of a (b, T) mask -> (b, T), zeros elsewhere (differentiable)."""
    return torch.zeros(valid.shape, dtype=flat.dtype, device=flat.device).masked_scatter(valid, flat)


class ResponseModel(nn.Module):
    """An HF model whose forward returns per-response-token outputs; the FSDP2 root wraps this module.

    Calling the backbone and the head from ONE forward keeps FSDP's root hooks in charge: the root
    parameters (embeddings, final norm, lm_head / value head, tied or not) are gathered for the pass
    and their gradients reduce-scattered in backward.
    """

    onednn_linear = False  # build_sharded: the linear op is patched in, so the LM head's products go through it too

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def hidden_at_predictions(self, inputs: ModelInputs) -> torch.Tensor:
        """(N, H) hidden states at the positions that predict each valid response token."""
        out = self.hf.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=False,
            **inputs.packed_kwargs,
        )
        hidden = out.last_hidden_state  # (b, L, H) | (1, n_tokens, H)
        return hidden.reshape(-1, hidden.shape[-1])[inputs.predict_index]


class CausalLMLogProbs(ResponseModel):
    """forward -> (logp (b, T) fp32, entropy (b, T) fp32 or None) of the response tokens."""

    def forward(self, inputs: ModelInputs, temperature: float, with_entropy: bool):
        h = self.hidden_at_predictions(inputs)  # (N, H)
        weight = self.hf.get_output_embeddings().weight  # (V, H), gathered by the root's FSDP hook
        out = linear_logprobs(h, weight.to(h.dtype), inputs.labels, temperature=temperature, with_entropy=with_entropy,
                              onednn=self.onednn_linear)
        logp, entropy = out if with_entropy else (out, None)
        valid = inputs.response_valid
        return scatter_valid(logp, valid), (scatter_valid(entropy, valid) if with_entropy else None)

    def generate(self, *args, **kwargs):
        """transformers ``generate`` of the wrapped model (an FSDP forward method: the root is gathered).

        With several ranks every decoding step is a collective (each layer gathers its shards), so all
        ranks keep stepping until the last one is done (``synced_gpus``). The layers are gathered once for
        the whole call rather than once per token.
        """
        kwargs.setdefault("synced_gpus", dist.is_initialized() and dist.get_world_size() > 1)
        with fsdp.gathered(self):
            return self.hf.generate(*args, **kwargs)


# ================================================================================================
# Building
# ================================================================================================
def build_sharded(
    wrapper_cls: type[ResponseModel],
    *,
    path: str,
    override_config: dict,
    trust_remote_code: bool,
    fsdp_cfg: FSDPConfig,
    dev: Device,
    compute_dtype: torch.dtype,
    trainable: bool,
    gradient_checkpointing: bool,
    fused_kernels: bool,
    value_head: bool = False,
    seed: int = 0,
    shared_prefix: bool = False,
    onednn_linear: bool = False,
) -> ResponseModel:
    """Load (rank 0 reads, others meta), patch, checkpoint, wrap and shard an HF model; weights from rank 0."""
    master_dtype = fsdp.resolve_dtype(fsdp_cfg.model_dtype, dev) if trainable else compute_dtype
    config = fsdp.load_hf_config(path, override_config, trust_remote_code=trust_remote_code,
                                 num_labels=1 if value_head else None)
    torch.manual_seed(seed)  # a freshly initialised value head is the same wherever it is built
    hf_model = fsdp.load_hf_model(path, config, dtype=master_dtype, value_head=value_head,
                                  trust_remote_code=trust_remote_code)
    # Shared-prompt packing needs the grpo_npu attention (kv_index) even without the other fused ops;
    # model.use_onednn_linear routes the linear layers alone through grpo_npu.ops.linear.
    wanted = {"linear": onednn_linear, "attention": shared_prefix}
    patch_ops = PATCHABLE_OPS if fused_kernels else tuple(op for op in PATCHABLE_OPS if wanted.get(op))
    if patch_ops:
        log.info("patched ops: %s", patch_model(hf_model, ops=patch_ops))
    if gradient_checkpointing:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_model.requires_grad_(trainable)
    full_state = hf_model.state_dict() if dist.get_rank() == 0 and dist.get_world_size() > 1 else {}
    wrapper = wrapper_cls(hf_model)
    wrapper.onednn_linear = "linear" in patch_ops
    mesh = fsdp.build_mesh(dev, fsdp_cfg.fsdp_size)
    cpu_offload = fsdp_cfg.offload_policy and dev.is_accelerator
    fsdp.shard_model(
        wrapper, fsdp.decoder_layers(hf_model), mesh,
        param_dtype=compute_dtype, master_dtype=master_dtype,
        reduce_dtype=fsdp.resolve_dtype(fsdp_cfg.mixed_precision.reduce_dtype, dev),
        cpu_offload=cpu_offload, reshard_after_forward=fsdp_cfg.reshard_after_forward,
        forward_prefetch=fsdp_cfg.forward_prefetch,
    )
    if hasattr(wrapper, "generate"):
        register_fsdp_forward_method(wrapper, "generate")
    fsdp.load_full_state_dict(wrapper, {"hf." + k: v for k, v in full_state.items()}, dev.torch_device(),
                              cpu_offload=cpu_offload)
    del full_state
    return wrapper


def compute_dtype_of(model_cfg: ModelConfig, fsdp_cfg: FSDPConfig, dev: Device) -> torch.dtype:
    """FSDP compute dtype: mixed_precision.param_dtype, else model.dtype, else the device default."""
    name = fsdp_cfg.mixed_precision.param_dtype
    if name == "auto":
        name = model_cfg.dtype
    return fsdp.resolve_dtype(name, dev)


def fused_kernels_on(model_cfg: ModelConfig, dev: Device) -> bool:
    """model.use_fused_kernels, where None means on for NPU and off elsewhere."""
    return model_cfg.use_fused_kernels if model_cfg.use_fused_kernels is not None else dev.kind == "npu"


# ================================================================================================
# Micro-batching shared by actor, reference and critic
# ================================================================================================
def plan_micro_batches(batch: RolloutBatch, *, size: int | None, max_tokens: int | None, dev: Device) -> list[list[int]]:
    """Row groups for one pass: fixed ``size`` rows, or (``max_tokens`` set) balanced token-budget packing.

    Token-budget packing is collective: every rank gets the same number of groups (the maximum over
    ranks), because each FSDP forward gathers parameters with all ranks. Ranks hold equal row counts.
    """
    n = len(batch)
    if max_tokens is None:
        if size is None:
            raise ValueError("a micro-batch size or a token budget (use_dynamic_bsz) is required")
        return fixed_groups(n, size)
    lengths = batch.attention_mask.sum(1).tolist()
    count = len(token_budget_groups(lengths, max_tokens))
    while True:  # rarely more than one round: a larger count can need one more group somewhere
        agreed = int(fsdp.all_reduce(torch.tensor([count], device=dev.torch_device()), "max").item())
        if agreed > n:
            raise RuntimeError(f"ranks hold different row counts: {agreed} micro-batches for {n} rows on this rank")
        groups = token_budget_groups(lengths, max_tokens, min_groups=agreed)
        count = len(groups)
        done = fsdp.all_reduce(torch.tensor([int(count == agreed)], device=dev.torch_device()), "min")
        if int(done.item()) == 1:
            return groups


@torch.no_grad()
def forward_in_micro_batches(
    fn: Callable[[RolloutBatch], torch.Tensor | tuple], batch: RolloutBatch, groups: list[list[int]], width: int
) -> list[torch.Tensor]:
    """Run ``fn`` on each trimmed micro-batch; returns per-output (B, width) tensors in original row order."""
    if not groups:
        raise ValueError("an empty batch: every rank needs at least one row")
    parts: list[list[torch.Tensor]] = []
    for rows in groups:
        out = fn(trim_padding(batch.select(rows)))
        out = out if isinstance(out, tuple) else (out,)
        parts.append([o.float().cpu() for o in out])
    return [scatter_rows([p[k] for p in parts], groups, len(batch), width) for k in range(len(parts[0]))]


def clip_and_step(
    params: list[nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float
) -> tuple[float, bool]:
    """Global grad norm (collective), clip to ``max_norm``, step; a non-finite norm skips the step.

    Returns (grad norm before clipping, whether the optimizer stepped). Gradients are cleared either way.
    """
    norm = float(fsdp.grad_norm(params).item())  # one host sync per mini-batch, never per micro-batch
    stepped = math.isfinite(norm)
    if stepped:
        if max_norm > 0 and norm > max_norm:
            fsdp.scale_grads(params, max_norm / (norm + 1e-6))
        optimizer.step()
    else:
        log.warning("non-finite gradient norm %s: optimizer step skipped", norm)
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One schedule step per training step, also when every optimizer step was skipped (no torch warning)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()


def mini_batches(num_rows: int, size: int, shuffle: torch.Generator | None) -> Iterator[list[int]]:
    """Row groups of ``size`` (the last may be smaller), optionally in a shuffled order."""
    order = torch.randperm(num_rows, generator=shuffle).tolist() if shuffle is not None else list(range(num_rows))
    for s in range(0, num_rows, size):
        yield order[s : s + size]


@contextmanager
def params_on(module: nn.Module, dev: Device, offload: bool):
    """Parameters on the device for the duration of a phase, back on the host after it (param_offload)."""
    if offload and dev.is_accelerator:
        fsdp.move_model(module, dev.torch_device())
    try:
        yield
    finally:
        if offload and dev.is_accelerator:
            fsdp.move_model(module, "cpu")
            dev.empty_cache()


# ================================================================================================
# Policy (log-probs) and Actor (update)
# ================================================================================================
class Policy:
    """A sharded causal LM that computes response log-probs (the actor's forward and the reference)."""

    def __init__(self, module: CausalLMLogProbs, dev: Device, *, remove_padding: bool, temperature: float,
                 param_offload: bool, share_prefix: bool = False):
        if not temperature > 0:
            raise ValueError(
                f"actor_rollout_ref.rollout.temperature={temperature}: log-probs for training need a temperature > 0"
            )
        self.module = module
        self.dev = dev
        self.remove_padding = remove_padding
        self.share_prefix = share_prefix
        self.temperature = temperature
        self.param_offload = param_offload
        if param_offload and dev.is_accelerator:
            fsdp.move_model(module, "cpu")

    def forward(self, micro: RolloutBatch, with_entropy: bool):
        """(logp (b, T), entropy (b, T) | None) for one trimmed micro-batch on the device."""
        inputs = build_inputs(micro.to(self.dev.torch_device()), self.remove_padding, self.share_prefix)
        return self.module(inputs, self.temperature, with_entropy)

    def log_probs(self, batch: RolloutBatch, *, micro_size: int | None, max_tokens: int | None,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) float32 log-probs (and entropies) of this rank's rows, on the host. Collective."""
        self.module.eval()
        groups = plan_micro_batches(batch, size=micro_size, max_tokens=max_tokens, dev=self.dev)
        with params_on(self.module, self.dev, self.param_offload):
            def run(micro: RolloutBatch):
                logp, entropy = self.forward(micro, with_entropy)
                return (logp, entropy) if with_entropy else logp

            outs = forward_in_micro_batches(run, batch, groups, batch.response_ids.shape[1])
            fsdp.reshard_all(self.module)  # the root stays gathered after a forward without backward
        return outs[0], (outs[1] if with_entropy else None)


class Actor(Policy):
    """The trained policy: Policy + AdamW + schedule + the PPO/GRPO update."""

    def __init__(self, module: CausalLMLogProbs, dev: Device, cfg: ActorConfig, derived: Derived, *,
                 remove_padding: bool, temperature: float, total_steps: int, seed: int, share_prefix: bool = False):
        super().__init__(module, dev, remove_padding=remove_padding, temperature=temperature,
                         param_offload=cfg.fsdp_config.param_offload, share_prefix=share_prefix)
        self.cfg = cfg
        self.derived = derived
        self.policy_loss_fn = losses.get_policy_loss_fn(cfg.policy_loss.loss_mode)
        if cfg.loss_agg_mode not in losses.AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode={cfg.loss_agg_mode!r}; known: {', '.join(losses.AGG_MODES)}")
        self.params = [p for p in module.parameters() if p.requires_grad]
        o = cfg.optim
        steps = o.total_training_steps if o.total_training_steps > 0 else total_steps
        self.optimizer = build_optimizer(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                         impl=o.impl, device_type=optimizer_device(dev, cfg.fsdp_config))
        self.scheduler = build_scheduler(
            self.optimizer, total_steps=steps, lr_warmup_steps=o.lr_warmup_steps,
            lr_warmup_steps_ratio=o.lr_warmup_steps_ratio, warmup_style=o.warmup_style,
            min_lr_ratio=o.min_lr_ratio, num_cycles=o.num_cycles,
        )
        shuffle_seed = cfg.data_loader_seed if cfg.data_loader_seed is not None else seed
        self.shuffle = torch.Generator().manual_seed(shuffle_seed) if cfg.shuffle else None

    # -- old log-probs -------------------------------------------------------------------------
    def compute_log_prob(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Old-policy log-probs (B, T) and ``actor/entropy`` (loss_agg_mode over all ranks' rows). Collective."""
        d = self.derived
        logp, entropy = self.log_probs(
            batch, micro_size=d.log_prob_micro_batch_per_rank,
            max_tokens=d.log_prob_max_token_len if d.log_prob_use_dynamic_bsz else None, with_entropy=True,
        )
        return logp, {"actor/entropy": self._global_agg(entropy, batch.response_mask)}

    def _global_agg(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        """agg_loss of (B, T) values over all ranks' rows (this rank's share, normalised globally, summed)."""
        device = self.dev.torch_device()
        num_tokens, num_seqs = losses.agg_counts(mask)
        counts = fsdp.all_reduce(torch.stack([num_tokens, num_seqs]).to(device)).cpu()
        part = losses.agg_loss(values, mask, self.cfg.loss_agg_mode, num_tokens=counts[0], num_seqs=counts[1],
                               horizon=self.derived.response_length)
        return float(fsdp.all_reduce(part.reshape(1).to(device)).item())

    # -- update ---------------------------------------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """ppo_epochs over mini-batches of this rank's rows; one scheduler step. Collective.

        Needs advantages (and ref_logp when use_kl_loss) and old_logp, except on-policy: a batch without
        old_logp when the config reuses the update's forward (``Derived.old_logp_from_update``: one
        epoch, one mini-batch), where old = the detached log-probs of that forward, which is where the
        separate pass would have been computed, and ``actor/entropy`` and ``rollout/logp_diff_*`` come
        from it too. Returns verl-named metrics, reduced over ranks, micro-batches and mini-batches.
        """
        cfg, dev = self.cfg, self.dev
        old_logp_from_update = batch.old_logp is None
        if batch.advantages is None:
            raise ValueError("update_actor: the batch needs advantages")
        if old_logp_from_update and not self.derived.old_logp_from_update:
            raise ValueError("update_actor: the batch needs old_logp (the update's forward is reused only with "
                             "actor.old_log_prob=auto, ppo_epochs=1 and ppo_mini_batch_size=train_batch_size)")
        if old_logp_from_update and len(batch) != self.derived.mini_batch_responses_per_rank:
            raise ValueError(f"update_actor: on-policy reuse needs the whole batch as one mini-batch: {len(batch)} "
                             f"rows on this rank, mini-batch {self.derived.mini_batch_responses_per_rank}")
        if cfg.use_kl_loss and batch.ref_logp is None:
            raise ValueError("update_actor: actor.use_kl_loss=True needs ref_logp in the batch")
        self.module.train()
        lr = self.optimizer.param_groups[0]["lr"]
        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=dev.torch_device())
        diff_max = torch.zeros(1, dtype=torch.float64, device=dev.torch_device())
        grad_norms, skipped = [], 0
        with params_on(self.module, dev, self.param_offload), optimizer_on(self.optimizer, dev, cfg.fsdp_config.optimizer_offload):
            for _ in range(cfg.ppo_epochs):
                for rows in mini_batches(len(batch), self.derived.mini_batch_responses_per_rank, self.shuffle):
                    mini_sums, mini_max = self.backward_mini_batch(batch.select(rows), old_logp_from_update)
                    sums += mini_sums
                    diff_max = torch.maximum(diff_max, mini_max)
                    norm, stepped = clip_and_step(self.params, self.optimizer, cfg.grad_clip)
                    grad_norms.append(norm)
                    skipped += int(not stepped)
        step_scheduler(self.scheduler)
        fsdp.all_reduce(sums)
        fsdp.all_reduce(diff_max, "max")
        total = dict(zip(_SUM_KEYS, sums.tolist()))
        steps = max(len(grad_norms), 1)
        tokens = max(total["tokens"], 1.0)
        metrics = {
            "actor/pg_loss": total["pg_loss"] / steps,
            "actor/pg_clipfrac": total["pg_clipfrac"] / tokens,
            "actor/pg_clipfrac_lower": total["pg_clipfrac_lower"] / tokens,
            "actor/ppo_kl": total["ppo_kl"] / tokens,
            "actor/grad_norm": sum(grad_norms) / steps,
            "actor/lr": lr,
            "actor/skipped_steps": float(skipped),
        }
        if cfg.use_kl_loss:
            metrics["actor/kl_loss"] = total["kl_loss"] / steps
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        if cfg.entropy_coeff != 0 or old_logp_from_update:
            metrics["actor/entropy"] = total["entropy"] / steps
        if old_logp_from_update and batch.rollout_logp is not None:
            metrics["rollout/logp_diff_mean"] = total["logp_diff"] / tokens
            metrics["rollout/logp_diff_max"] = float(diff_max.item())
        return metrics

    def backward_mini_batch(self, mini: RolloutBatch, old_logp_from_update: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward every micro-batch of one mini-batch, accumulating gradients (no step).

        Returns this rank's metric sums (see _SUM_KEYS) and the max |rollout - old log-prob| (on-policy
        with rollout log-probs; else 0). Collective.
        """
        cfg, d, dev = self.cfg, self.derived, self.dev
        num_tokens, num_seqs = losses.agg_counts(mini.response_mask)
        counts = fsdp.all_reduce(torch.stack([num_tokens, num_seqs]).to(dev.torch_device()))
        agg = dict(num_tokens=counts[0], num_seqs=counts[1], horizon=d.response_length)
        groups = plan_micro_batches(mini, size=d.micro_batch_per_rank,
                                    max_tokens=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None, dev=dev)
        scale = dist.get_world_size()  # FSDP averages gradients over ranks; the losses are global sums
        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=dev.torch_device())
        diff_max = torch.zeros(1, dtype=torch.float64, device=dev.torch_device())
        with_entropy = cfg.entropy_coeff != 0 or old_logp_from_update  # on-policy: actor/entropy comes from this forward
        for rows in groups:
            micro = trim_padding(mini.select(rows)).to(dev.torch_device())
            mask = micro.response_mask
            logp, entropy = self.forward(micro, with_entropy)
            old_logp = logp.detach() if old_logp_from_update else micro.old_logp  # (b, T): ratio exactly 1 on-policy
            pg_loss, m = self.policy_loss_fn(
                logp, old_logp, micro.advantages, mask, clip_low=d.clip_low, clip_high=d.clip_high,
                clip_c=cfg.clip_ratio_c, agg_mode=cfg.loss_agg_mode, **agg,
            )
            loss = pg_loss
            kl_loss = ent_loss = diff_sum = torch.zeros((), device=logp.device)
            if cfg.use_kl_loss:
                kl = kl_lib.kl_penalty(logp, micro.ref_logp, cfg.kl_loss_type)
                kl_loss = losses.agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
                loss = loss + cfg.kl_loss_coef * kl_loss
            if with_entropy:
                ent = entropy if cfg.entropy_coeff != 0 else entropy.detach()
                ent_loss = losses.agg_loss(ent, mask, cfg.loss_agg_mode, **agg)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * ent_loss
            if old_logp_from_update and micro.rollout_logp is not None:
                diff = logp_abs_diff(micro.rollout_logp, old_logp, mask)  # (n,) valid tokens
                if diff.numel():
                    diff_sum = diff.sum()
                    diff_max = torch.maximum(diff_max, diff.max().double().reshape(1))
            (loss * scale).backward()
            n = mask.bool().sum()
            sums += torch.stack([
                pg_loss.detach().double(), m["pg_clipfrac"].double() * n, m["pg_clipfrac_lower"].double() * n,
                m["ppo_kl"].double() * n, kl_loss.detach().double(), ent_loss.detach().double(), n.double(),
                diff_sum.double(),
            ])
        return sums, diff_max

    # -- state ------------------------------------------------------------------------------------
    def state_extra(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(),
                "shuffle": self.shuffle.get_state() if self.shuffle is not None else None}

    def load_extra(self, extra: dict) -> None:
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.shuffle is not None and extra.get("shuffle") is not None:
            self.shuffle.set_state(extra["shuffle"])


# Local per-step sums reduced across ranks once per update: losses are already globally normalised
# per mini-batch (sum over micro-batches and ranks = the mini-batch loss); token-mean metrics are
# weighted by each micro-batch's token count.
_SUM_KEYS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy", "tokens", "logp_diff")


@contextmanager
def optimizer_on(optimizer: torch.optim.Optimizer, dev: Device, offload: bool):
    """Optimizer state on the device for an update, on the host after it (optimizer_offload)."""
    if offload and dev.is_accelerator:
        fsdp.move_optimizer_state(optimizer, dev.torch_device())
    try:
        yield
    finally:
        if offload and dev.is_accelerator:
            fsdp.move_optimizer_state(optimizer, "cpu")
            dev.empty_cache()
