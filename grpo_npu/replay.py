"""Each step's scored rollouts: generated (and dumped with ``trainer.rollout_data_dir``) or replayed from a dump
(``trainer.replay_rollouts_from``), so that two runs can differ on the training side only.

A dump holds, per step ``s``, in generation order (before the trainer balances rows over ranks):

- ``{s}.jsonl``: the decoded rows (prompt, response, score, ground truth), for reading;
- ``{s}.safetensors``: everything the training side of the step consumes. Tensors: ``prompt_ids`` /
  ``prompt_mask`` (B, P), ``response_ids`` / ``response_mask`` (B, T), ``token_level_scores`` (B, T) float32
  (the reward manager's scores, overlong shaping included), ``group_index`` (B,) int64 (the prompt each row
  answers, 0..B/n-1), ``rollout_logp`` (B, T) float32 when the engine returned log-probs, ``reward_baselines``
  (B,) with ReMax (the score of each row's prompt's greedy response). Metadata (strings):
  the format, the step, the batch shape of the run that wrote it (:func:`dump_shape`) and the row lists as
  JSON (uid, data_source, ground_truth, extra_info, stop_reason, reward_extra).

safetensors holds tensors and strings only, so reading a dump from another machine runs no code (no pickle).
A replay takes the rows and their scores as they are: the reward function is not called, dynamic sampling
has already happened, and the rollout engine is not even built unless validation needs it
(:func:`engine_needed`). Recipe and limits: docs/parity.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from grpo_npu.batch import RolloutBatch
from grpo_npu.config import Config, Derived
from grpo_npu.errors import ConfigError
from grpo_npu.io import write_atomic
from grpo_npu.samples import decode_samples, write_jsonl

DUMP_FORMAT = "grpo_npu.rollouts/1"
DUMP_SUFFIX = ".safetensors"
_LIST_FIELDS = ("uid", "data_source", "ground_truth", "extra_info", "stop_reason", "reward_extra")
_TENSOR_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "token_level_scores", "rollout_logp",
                  "reward_baselines")


class ShapeValue(NamedTuple):
    """One value of the batch shape a dump must share with the run that replays it, and the key that set it."""

    key: str
    value: int


def dump_shape(cfg: Config, derived: Derived) -> dict[str, ShapeValue]:
    """This run's batch shape, by metadata name. The lengths name the key that set them: the rollout's
    prompt_length / response_length when given, else data.max_prompt_length / data.max_response_length."""
    rollout = cfg.actor_rollout_ref.rollout
    prompt_key = "actor_rollout_ref.rollout.prompt_length" if rollout.prompt_length else "data.max_prompt_length"
    response_key = ("actor_rollout_ref.rollout.response_length" if rollout.response_length
                    else "data.max_response_length")
    return {"train_batch_size": ShapeValue("data.train_batch_size", cfg.data.train_batch_size),
            "n": ShapeValue("actor_rollout_ref.rollout.n", derived.n),
            "prompt_length": ShapeValue(prompt_key, derived.prompt_length),
            "response_length": ShapeValue(response_key, derived.response_length)}


def engine_needed(cfg: Config) -> bool:
    """Whether the workers need a rollout engine: to generate, or (replaying) to validate."""
    t = cfg.trainer
    validates = bool(cfg.data.val_files) and (t.val_before_train or t.val_only or t.test_freq > 0)
    return not t.replay_rollouts_from or validates


class RolloutSource:
    """``source(step, timer) -> (batch, metrics)``: ``generate`` (the trainer's rollout and reward) then the dump,
    or the dump alone when replaying. Refuses, when built, a replay dump that lacks a step in
    ``first_step..last_step`` or was written with another batch shape."""

    def __init__(self, cfg: Config, derived: Derived, generate: Callable, tokenizer, *, first_step: int, last_step: int,
                 baselines: bool = False):
        t = cfg.trainer
        self.generate = generate
        self.tokenizer = tokenizer
        self.shape = dump_shape(cfg, derived)
        self.dump_dir = Path(t.rollout_data_dir) if t.rollout_data_dir else None
        self.replay_dir = Path(t.replay_rollouts_from) if t.replay_rollouts_from else None
        if self.replay_dir is not None:
            check_dump(self.replay_dir, range(first_step, last_step + 1), self.shape, baselines=baselines)

    def __call__(self, step: int, timer) -> tuple[RolloutBatch, dict[str, float]]:
        if self.replay_dir is not None:
            return read_rollouts(self.replay_dir, step, self.shape), {}
        batch, metrics = self.generate(step, timer)
        if self.dump_dir is not None:
            write_rollouts(self.dump_dir, step, batch, self.shape, self.tokenizer)
        return batch, metrics


# ------------------------------------------------------------------------------------------------
# Writing and reading one step
# ------------------------------------------------------------------------------------------------
def write_rollouts(out_dir: Path, step: int, batch: RolloutBatch, shape: dict[str, ShapeValue], tokenizer) -> None:
    """``{step}.safetensors`` (complete) and ``{step}.jsonl`` (decoded) in ``out_dir``, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(batch, name).contiguous() for name in _TENSOR_FIELDS if getattr(batch, name) is not None}
    groups = {uid: i for i, uid in enumerate(dict.fromkeys(batch.uid))}
    tensors["group_index"] = torch.tensor([groups[u] for u in batch.uid], dtype=torch.int64)
    metadata = {"format": DUMP_FORMAT, "step": str(step), **{k: str(v.value) for k, v in shape.items()},
                **{name: json.dumps(getattr(batch, name), default=str) for name in _LIST_FIELDS}}
    write_atomic(out_dir / f"{step}{DUMP_SUFFIX}", save(tensors, metadata=metadata))
    write_jsonl(out_dir / f"{step}.jsonl", decode_samples(tokenizer, batch, len(batch)))


def read_rollouts(dump_dir: Path, step: int, shape: dict[str, ShapeValue]) -> RolloutBatch:
    """Step ``step``'s batch from a dump, checked against this run's batch shape."""
    path = dump_dir / f"{step}{DUMP_SUFFIX}"
    meta = _metadata(path, step, shape)
    tensors = load_file(str(path))
    rows = {name: json.loads(meta[name]) for name in _LIST_FIELDS}
    batch = RolloutBatch(**{name: tensors.get(name) for name in _TENSOR_FIELDS}, **rows)
    want_rows = shape["train_batch_size"].value * shape["n"].value
    prompt_length, response_length = shape["prompt_length"].value, shape["response_length"].value
    if len(batch) != want_rows or batch.response_ids.shape[1] > response_length \
            or batch.prompt_ids.shape[1] > prompt_length:
        raise ConfigError(f"trainer.replay_rollouts_from: {path} holds a ({len(batch)}, {batch.prompt_ids.shape[1]} + "
                          f"{batch.response_ids.shape[1]}) batch; this run needs {want_rows} rows of at most "
                          f"{prompt_length} + {response_length} tokens")
    return batch


def check_dump(dump_dir: Path, steps: range, shape: dict[str, ShapeValue], baselines: bool = False) -> None:
    """Refuse (one line) a dump directory that lacks one of ``steps``, holds another batch shape or, when this run
    needs ``baselines`` (ReMax), lacks them."""
    if not dump_dir.is_dir():
        raise ConfigError(f"trainer.replay_rollouts_from={dump_dir}: not a directory (expected a "
                          "trainer.rollout_data_dir of an earlier run)")
    held = sorted(int(p.name[: -len(DUMP_SUFFIX)]) for p in dump_dir.glob(f"*{DUMP_SUFFIX}")
                  if p.name[: -len(DUMP_SUFFIX)].isdigit())
    missing = [s for s in steps if not (dump_dir / f"{s}{DUMP_SUFFIX}").is_file()]
    if missing:
        has = f"steps {held[0]}..{held[-1]}" if held else f"no *{DUMP_SUFFIX} step files"
        raise ConfigError(f"trainer.replay_rollouts_from={dump_dir} has no rollouts for step(s) "
                          f"{_steps(missing)} of this run (it holds {has}); lower trainer.total_training_steps or "
                          "dump those steps with trainer.rollout_data_dir")
    for s in steps:
        _metadata(dump_dir / f"{s}{DUMP_SUFFIX}", s, shape, baselines=baselines)


def _metadata(path: Path, step: int, shape: dict[str, ShapeValue], baselines: bool = False) -> dict[str, str]:
    """The file's metadata, after checking its format, step and batch shape against this run's (and, with
    ``baselines``, that it holds ReMax's reward_baselines)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, names = f.metadata() or {}, set(f.keys())
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise ConfigError(f"trainer.replay_rollouts_from: {path} is not a readable rollout dump ({exc})") from None
    if meta.get("format") != DUMP_FORMAT or meta.get("step") != str(step):
        raise ConfigError(f"trainer.replay_rollouts_from: {path} is not step {step} of a {DUMP_FORMAT} dump "
                          f"(format {meta.get('format')!r}, step {meta.get('step')!r})")
    for name, (key, value) in shape.items():
        if meta.get(name) != str(value):
            raise ConfigError(f"trainer.replay_rollouts_from: {path} was dumped with {key}={meta.get(name)}, this "
                              f"run has {key}={value}; replay with the dumping run's batch shape")
    if baselines and "reward_baselines" not in names:
        raise ConfigError(f"trainer.replay_rollouts_from: {path} has no reward_baselines, which "
                          "algorithm.adv_estimator=remax needs: replay a remax run's dump")
    return meta


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f", ... ({len(steps)} in all)" if len(steps) > 5 else "")
