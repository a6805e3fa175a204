"""Decoded samples of a batch (prompt, response, score, ground truth) and their JSON-lines dumps."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_npu.batch import RolloutBatch
from grpo_npu.io import write_atomic


def decode_samples(tokenizer, batch: RolloutBatch, k: int) -> list[dict]:
    """The first ``k`` rows as text: prompt, response, score, ground_truth."""
    out = []
    for i in range(min(k, len(batch))):
        p = tokenizer.decode(batch.prompt_ids[i][batch.prompt_mask[i].bool()], skip_special_tokens=True)
        r = tokenizer.decode(batch.response_ids[i][batch.response_mask[i].bool()], skip_special_tokens=True)
        out.append({"prompt": p, "response": r, "score": float(batch.reward_extra[i]["score"]),
                    "ground_truth": batch.ground_truth[i]})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """``rows`` as one JSON object a line, written atomically (parent folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps(row, default=str) + "\n" for row in rows).encode())
