"""The sleep-mode path for real: vLLM on a CUDA GPU (skipped without one, or without a CUDA vLLM).

On CPU the same sequence is checked call by call against fakes (test_step.py); here it runs against
the real cumem allocator: memory must come back on sleep, weights must survive level-2 sleep through
the per-step sync, and generations must still equal transformers'.
"""

from __future__ import annotations

import pytest
import torch

from grpo_npu.config import RolloutConfig
from grpo_npu.device import get_device
from grpo_npu.rollout import MemoryLedger, SamplingConfig, build_rollout, run_rollout_step
from grpo_npu.rollout.hf_rollout import HFRollout

pytestmark = [pytest.mark.cuda, pytest.mark.vllm]

# The KV cache alone at gpu_memory_utilization=0.3 is many GiB on any data-centre GPU; sleep must
# hand back at least this much (a generous floor: a sleep that frees nothing fails by GiBs).
MIN_FREED_GIB = 1.0


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_mode_cycle_on_gpu(level, tiny_model_path, tiny_tokenizer, prompt_batch):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    device = get_device("cuda")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).to(device.torch_device()).eval()
    cfg = RolloutConfig(name="vllm", dtype="float32", load_format="dummy", tensor_model_parallel_size=1,
                        gpu_memory_utilization=0.3, enable_sleep_mode=True, free_cache_engine=True, sleep_level=level,
                        max_num_seqs=64, max_num_batched_tokens=1024)
    engine = build_rollout(cfg, device=device, model_path=tiny_model_path, prompt_length=64, response_length=16,
                           pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    try:
        assert engine.sleeps and engine.asleep and engine.sleep_level == level
        hf = HFRollout(model, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
        ledger = MemoryLedger(device)
        sampling = SamplingConfig(do_sample=False, max_new_tokens=12, return_logprobs=True)
        expected = hf.generate(*prompt_batch, sampling)
        for _ in range(2):  # two full cycles in a row
            out = run_rollout_step(engine, device, iter(model.state_dict().items()), *prompt_batch, sampling,
                                   ledger=ledger)
            assert torch.equal(out.response_ids, expected.response_ids)
            torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-3, rtol=0)
            freed = out.metrics["rollout/mem_free_gb_after_sleep"] - out.metrics["rollout/mem_free_gb_before_sleep"]
            assert freed > MIN_FREED_GIB, out.metrics
            assert engine.asleep
    finally:
        engine.close()
