"""LoRA against full fine-tuning: the training state each keeps (actor, reference, gradients, AdamW) and
the bytes a weight sync would move, counted on the model built as the workers build it.

The models are built on the meta device (no memory, no time), LoRA injected by
:func:`grpo_npu.workers.lora.apply_lora` exactly as the actor is; the counts are exact byte totals of
the tensors that exist in a GRPO step with a KL loss: full fine-tuning keeps an fp32 actor, its fp32
gradients, AdamW's two fp32 moments and a reference copy (in the compute dtype); LoRA keeps the frozen
base once (no reference: the actor with adapters off), gradients and moments of the adapters only.
Sync bytes: the whole model in the engine dtype (what a full or merged sync moves) against the adapters
alone (what an adapter-only sync would move; grpo_npu syncs merged weights today).

Run: ``python -m bench.lora [--quick]`` (quick: the tiny model; default: Qwen2.5-0.5B's shape).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from bench.common import BenchResult, bench_main
from grpo_npu.models.tiny import QWEN2_5_0_5B_SHAPE, TINY, make_config
from grpo_npu.workers.lora import LoraSettings, apply_lora

RANK, ALPHA = 32, 64  # the LoRA learning test's settings (tests/test_lora_job_learns.py)
MASTER_BYTES, COMPUTE_BYTES = 4, 2  # fp32 master weights / moments; bf16 reference and engine on NPU/GPU


def _model(spec, lora: bool):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(spec), dtype=torch.float32)
    if lora:
        apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, target_modules="all-linear", exclude_modules=None))
    return model


def _state(spec, lora: bool) -> dict:
    model = _model(spec, lora)
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad or not lora)
    base = total - (trainable if lora else 0)
    actor = total * MASTER_BYTES
    ref = 0 if lora else total * COMPUTE_BYTES
    grads, adam = trainable * MASTER_BYTES, 2 * trainable * MASTER_BYTES
    return {"mode": f"lora r={RANK}" if lora else "full", "params_M": total / 1e6, "trainable_M": trainable / 1e6,
            "actor_GB": actor / 1e9, "ref_GB": ref / 1e9, "grads_GB": grads / 1e9, "adamw_GB": adam / 1e9,
            "total_GB": (actor + ref + grads + adam) / 1e9,
            "sync_MB": base * COMPUTE_BYTES / 1e6,  # the model the engine holds: full, or merged
            "adapter_sync_MB": (trainable * COMPUTE_BYTES / 1e6) if lora else None}


def run(quick: bool = False) -> BenchResult:
    """LoRA vs full fine-tuning: training-state bytes and weight-sync bytes at one model shape."""
    spec = TINY if quick else QWEN2_5_0_5B_SHAPE
    result = BenchResult("lora")
    full, lora = _state(spec, False), _state(spec, True)
    result.rows += [{"shape": spec.name, **full}, {"shape": spec.name, **lora}]
    result.add_target("state_full_over_lora", full["total_GB"] / lora["total_GB"], 2.0)
    result.add_target("sync_full_over_adapters", lora["sync_MB"] / lora["adapter_sync_MB"], 20.0)
    result.notes += [
        "exact byte counts of the tensors a GRPO step with a KL loss keeps, models built on the meta device",
        f"actor fp32 master ({MASTER_BYTES} B), reference and engine in bf16 ({COMPUTE_BYTES} B), AdamW 2 fp32 moments",
        "LoRA builds no reference: the reference log-probs are the actor's with its adapters disabled",
        "sync_MB: the merged model every step (what grpo_npu moves today); adapter_sync_MB: an adapter-only sync",
    ]
    return result


def main(argv=None):
    bench_main(run, argv)


if __name__ == "__main__":
    main()
