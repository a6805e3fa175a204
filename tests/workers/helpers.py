"""Helpers for the worker tests: configs on the tiny model and synthetic batches."""

from __future__ import annotations

import torch

from grpo_npu.batch import RolloutBatch
from grpo_npu.config import load_config

# Real-token ids stay clear of the tiny tokenizer's special tokens (0..2) and below its vocabulary.
TOKEN_LOW, TOKEN_HIGH = 3, 1000
PAD_ID = 0

# Shapes every test batch uses: 8 responses of up to 9 tokens after prompts of up to 7.
PROMPT_LEN, RESPONSE_LEN, ROWS = 7, 9, 8


def start_process_group() -> bool:
    """A world-size-1 gloo process group for in-process workers; False if one is already up."""
    from grpo_npu.device import get_device
    from grpo_npu.workers import fsdp

    return fsdp.init_distributed(get_device("cpu"), rank=0, world_size=1, master_addr="127.0.0.1",
                                 master_port=fsdp.free_port())


def make_cfg(model_path: str, *overrides: str, world_size: int = 1):
    """A GRPO config on the tiny model: 4 prompts x 2 responses, one mini-batch per step, fp32 on CPU."""
    base = [
        f"actor_rollout_ref.model.path={model_path}",
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={world_size}",
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={ROWS // world_size}",
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={RESPONSE_LEN}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.optim.lr=0.01",
        # eps = 1 makes AdamW's first step ~ lr * g (an SGD-like step) instead of lr * sign(g):
        # weights then differ by ~lr x (gradient rounding), which a tight tolerance can check.
        "actor_rollout_ref.actor.optim.eps=1.0",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        # the plain padded path with torch's own linear layers, which these tests compare others against
        # (both switches default to on for CPU: tests/workers/test_model_switches.py covers that)
        "actor_rollout_ref.model.share_prompt_prefix=False",
        "actor_rollout_ref.model.use_onednn_linear=False",
    ]
    return load_config(base + list(overrides))


def make_batch(seed: int = 0, rows: int = ROWS, prompt_len: int = PROMPT_LEN, response_len: int = RESPONSE_LEN,
               empty_row: int | None = 3) -> RolloutBatch:
    """Left-padded prompts and right-padded responses of varied lengths (one response may be empty)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(TOKEN_LOW, TOKEN_HIGH, (rows, prompt_len), generator=g)
    response_ids = torch.randint(TOKEN_LOW, TOKEN_HIGH, (rows, response_len), generator=g)
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.long)
    response_mask = torch.ones(rows, response_len, dtype=torch.long)
    for i in range(rows):
        prompt_mask[i, : int(torch.randint(0, prompt_len, (1,), generator=g))] = 0  # >= 1 prompt token
        response_mask[i, int(torch.randint(1, response_len + 1, (1,), generator=g)):] = 0
    if empty_row is not None:
        response_mask[empty_row] = 0
    prompt_ids = torch.where(prompt_mask.bool(), prompt_ids, PAD_ID)
    response_ids = torch.where(response_mask.bool(), response_ids, PAD_ID)
    batch = RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, response_len) * response_mask
    return batch.replace(advantages=advantages.contiguous())


def make_worker(cfg, total_steps: int = 10, with_rollout: bool = False):
    """An in-process HybridWorker with its models built (needs an initialised process group)."""
    from grpo_npu.workers.hybrid import HybridWorker

    worker = HybridWorker(cfg, with_rollout=with_rollout)
    worker.init_model(total_steps)
    return worker


def full_weights(module) -> dict[str, torch.Tensor]:
    """Every state-dict tensor of a (sharded) module, gathered, as fp32 host copies."""
    from grpo_npu.workers import fsdp

    return {k: v.float().clone() for k, v in fsdp.iter_full_state_dict(module, device="cpu")}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
