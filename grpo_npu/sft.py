"""Supervised fine-tuning on the RL workers: the warm start a tiny or base model needs before RL.

Data: parquet rows with a chat ``prompt`` (data.prompt_key) and a target ``response`` string
(data.response_key), or a ``messages`` conversation whose last message is the assistant's answer.
Loss: token-mean negative log-likelihood of the response tokens only (prompt tokens carry no loss),
computed by the actor's update loop (:mod:`grpo_npu.workers.update_loop`: FSDP2, micro-batches with
global token counts, gradient clipping, AdamW and its schedule) with this NLL as its loss.
``python -m grpo_npu.main_sft`` runs it.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from grpo_npu import config as C
from grpo_npu.algo import losses
from grpo_npu.batch import RolloutBatch
from grpo_npu.cluster import Workers
from grpo_npu.data.rl_dataset import left_pad
from grpo_npu.data.tokenizer import load_tokenizer
from grpo_npu.tracking import Tracker
from grpo_npu.workers.actor import Actor
from grpo_npu.workers.hybrid import HybridWorker
from grpo_npu.workers.update_loop import MicroLoss

log = logging.getLogger(__name__)


class SFTDataset:
    """Tokenized (prompt, response) pairs: prompt left-padded to P, response right-padded to T (+ eos)."""

    def __init__(self, files, tokenizer, *, prompt_key: str, response_key: str, max_prompt_length: int,
                 max_response_length: int) -> None:
        rows = []
        for f in files:
            path = Path(f).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"SFT data file {str(path)!r} does not exist")
            rows += pq.read_table(path).to_pylist()
        if not rows:
            raise ValueError(f"SFT data {list(map(str, files))} has no rows")
        self.prompts: list[list[int]] = []
        self.responses: list[list[int]] = []
        eos = tokenizer.eos_token_id
        for i, row in enumerate(rows):
            if response_key in row and prompt_key in row:
                messages, answer = list(row[prompt_key]), row[response_key]
            elif "messages" in row:
                messages, answer = list(row["messages"][:-1]), row["messages"][-1]["content"]
            else:
                raise ValueError(f"SFT row {i}: needs columns {prompt_key!r} + {response_key!r}, or 'messages'")
            if not isinstance(answer, str):
                raise ValueError(f"SFT row {i}: the response must be a string, got {type(answer).__name__}")
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(prompt, "input_ids"):
                prompt = prompt["input_ids"]
            response = tokenizer(answer, add_special_tokens=False).input_ids + [eos]
            if len(prompt) > max_prompt_length:
                raise ValueError(f"SFT row {i}: prompt of {len(prompt)} tokens exceeds data.max_prompt_length="
                                 f"{max_prompt_length}")
            self.prompts.append(list(prompt))
            self.responses.append(response[:max_response_length])
        self.pad_id = tokenizer.pad_token_id
        self.P, self.T = max_prompt_length, max_response_length

    def __len__(self) -> int:
        return len(self.prompts)

    def batch(self, idx: list[int]) -> RolloutBatch:
        p = [left_pad(self.prompts[i], self.P, self.pad_id) for i in idx]
        resp = torch.full((len(idx), self.T), self.pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros(len(idx), self.T, dtype=torch.long)
        for row, i in enumerate(idx):
            r = self.responses[i]
            resp[row, : len(r)] = torch.tensor(r)
            mask[row, : len(r)] = 1
        return RolloutBatch(prompt_ids=torch.stack([x[0] for x in p]), prompt_mask=torch.stack([x[1] for x in p]),
                            response_ids=resp, response_mask=mask)


def run_sft(cfg: C.Config, group=None, *, export_dir: str | None = None) -> list[dict]:
    """Train cfg.trainer.total_epochs over the SFT data; returns per-step metrics; exports HF if asked."""
    t, d = cfg.trainer, cfg.data
    if cfg.actor_rollout_ref.rollout.temperature != 1.0:
        raise ValueError("main_sft: actor_rollout_ref.rollout.temperature must be 1.0 (log-probs are divided by it)")
    derived = C.derive(cfg)
    if derived.use_critic or derived.use_reference:
        raise ValueError("main_sft trains the policy only: set critic.enable=False and no KL term")
    tokenizer = load_tokenizer(cfg)
    data = SFTDataset(d.train_files, tokenizer, prompt_key=d.prompt_key, response_key=d.response_key,
                      max_prompt_length=d.max_prompt_length, max_response_length=d.max_response_length)
    world = t.nnodes * t.n_gpus_per_node
    steps_per_epoch = len(data) // d.train_batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(data)} SFT rows is fewer than one batch of data.train_batch_size={d.train_batch_size}")
    total = t.total_training_steps or steps_per_epoch * t.total_epochs
    group = group if group is not None else Workers.build(cfg, total_training_steps=total,
                                                         worker_cls=SFTWorker, with_rollout=False)
    tracker = Tracker(Path(t.default_local_dir), tuple(t.logger), project=t.project_name, experiment=t.experiment_name,
                      config_dict=C.to_dict(cfg), total_steps=total)
    history = []
    try:
        step = 0
        for epoch in range(math.ceil(total / steps_per_epoch)):
            order = np.random.default_rng([d.seed, epoch]).permutation(len(data)) if d.shuffle else np.arange(len(data))
            for b in range(steps_per_epoch):
                if step >= total:
                    break
                step += 1
                start = time.perf_counter()
                batch = data.batch(order[b * d.train_batch_size:(b + 1) * d.train_batch_size].tolist())
                metrics = group.sft_update(batch)
                metrics["timing_s/step"] = time.perf_counter() - start
                metrics["perf/throughput"] = batch.num_tokens() / (metrics["timing_s/step"] * world)
                tracker.log(metrics, step=step)
                history.append(metrics)
        if export_dir:
            group.export_hf(export_dir)
    finally:
        tracker.close()
        group.close()
    return history


# ================================================================================================
# The SFT step, run inside each rank (same FSDP2 actor, optimizer and schedule as the RL update)
# ================================================================================================
def sft_step(actor: Actor, batch: RolloutBatch) -> dict[str, float]:
    """One optimizer step of token-mean NLL on this rank's rows (global token count). Collective."""
    stats = actor.loop.run(batch, functools.partial(nll_loss, actor), epochs=1, mini_batch_size=len(batch),
                           shuffle=False)
    return {"train/loss": stats.per_step("loss"), **stats.optimizer_metrics("train")}


def nll_loss(actor: Actor, micro: RolloutBatch, agg: dict) -> MicroLoss:
    """Token-mean negative log-likelihood of one micro-batch's response tokens over the global token count."""
    logp, _ = actor.forward(micro, False)  # (b, T)
    loss = losses.agg_loss(-logp, micro.response_mask, "token-mean", **agg)
    return MicroLoss(loss, {"loss": loss})


class SFTWorker(HybridWorker):
    """The hybrid worker (built without a rollout) plus the SFT step."""

    def sft_update(self, batch: RolloutBatch) -> dict[str, float]:
        return sft_step(self._need("actor"), batch)
