"""The sleep-mode path for real: vLLM on a CUDA GPU (skipped without one, or without a CUDA vLLM).

On CPU the same sequence is checked call by call against fakes (test_step.py); here it runs against
the real cumem allocator: memory must come back on sleep, weights must survive level-2 sleep through
the per-step sync, and generations must still equal transformers'.

Each sleep level runs in its own Python process. vLLM's cumem allocator serves one sleep-mode engine
per process: a second engine built after the first was closed fails to map memory (seen on an H100
with vllm 0.26: "CUDA Error: invalid argument at cumem_allocator.cpp:235", then an OOM with 78 GiB
free). The trainer builds one engine per process, so that is the case worth testing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.vllm]

REPO_ROOT = Path(__file__).resolve().parents[2]
# The KV cache alone at gpu_memory_utilization=0.3 is many GiB on any data-centre GPU; sleep must
# hand back at least this much (a generous floor: a sleep that frees nothing fails by GiBs).
MIN_FREED_GIB = 1.0
CYCLES = 2  # two full sleep/wake/sync/generate cycles in a row


def sleep_mode_cycles(level: int, model_path: str) -> None:
    """Build a sleep-mode engine at ``level`` and run CYCLES rollout steps against transformers' greedy output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_npu.config import RolloutConfig
    from grpo_npu.device import get_device
    from grpo_npu.rollout import MemoryLedger, SamplingConfig, build_rollout, run_rollout_step
    from grpo_npu.rollout.hf_rollout import HFRollout
    from tests.rollout.conftest import PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    prompt_batch = enc["input_ids"], enc["attention_mask"]
    device = get_device("cuda")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device.torch_device()).eval()
    cfg = RolloutConfig(name="vllm", dtype="float32", load_format="dummy", tensor_model_parallel_size=1,
                        gpu_memory_utilization=0.3, enable_sleep_mode=True, free_cache_engine=True, sleep_level=level,
                        max_num_seqs=64, max_num_batched_tokens=1024)
    engine = build_rollout(cfg, device=device, model_path=model_path, prompt_length=64, response_length=16,
                           pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    try:
        assert engine.sleeps and engine.asleep and engine.sleep_level == level
        hf = HFRollout(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
        ledger = MemoryLedger(device)
        sampling = SamplingConfig(do_sample=False, max_new_tokens=12, return_logprobs=True)
        expected = hf.generate(*prompt_batch, sampling)
        for cycle in range(CYCLES):
            out = run_rollout_step(engine, device, iter(model.state_dict().items()), *prompt_batch, sampling,
                                   ledger=ledger)
            assert torch.equal(out.response_ids, expected.response_ids), f"cycle {cycle}: tokens differ"
            torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-3, rtol=0)
            freed = out.metrics["rollout/mem_free_gb_after_sleep"] - out.metrics["rollout/mem_free_gb_before_sleep"]
            assert freed > MIN_FREED_GIB, f"cycle {cycle}: sleep freed {freed:.2f} GiB; metrics {out.metrics}"
            assert engine.asleep
    finally:
        engine.close()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_mode_cycle_on_gpu(level, tiny_model_path):
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, "-m", "tests.rollout.test_vllm_cuda", str(level), tiny_model_path],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
    assert proc.returncode == 0, f"sleep level {level} failed (exit {proc.returncode}):\n{tail}"
    assert "SLEEP-MODE CYCLES OK" in proc.stdout, tail


if __name__ == "__main__":
    sleep_mode_cycles(int(sys.argv[1]), sys.argv[2])
    print("SLEEP-MODE CYCLES OK")
