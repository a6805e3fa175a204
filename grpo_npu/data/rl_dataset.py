"""Prompts for RL: parquet rows -> chat-templated, left-padded token ids, and a resumable loader.

Shapes: B = prompts in a batch, L = ``max_prompt_length``. Every prompt is rendered with the
tokenizer's chat template (``add_generation_prompt=True``) and tokenized once, in a batch, when the
dataset is built; overlong prompts are then dropped (``filter_overlong_prompts``) or truncated
(``truncation``: left keeps the end, right keeps the start, middle keeps both ends, error refuses).

:class:`PromptLoader` walks a seeded permutation per epoch (numpy ``SeedSequence([seed, epoch])``),
so the order depends only on (seed, epoch, len(dataset)); its ``state_dict()`` is (epoch, position)
and a loader restored from it yields exactly the batches the original would have yielded next.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from grpo_npu.config.verl_keys import verl_keys
from grpo_npu.data.names import TRUNCATION_MODES

logger = logging.getLogger(__name__)
# verl's media columns (images, videos, audios): data.image_key etc. are accepted at these defaults only
VERL_MEDIA_COLUMNS = {k: verl_keys()[k].default for k in ("data.image_key", "data.video_key", "data.audio_key")}


@dataclass
class PromptItem:
    """One prompt, left-padded to L."""

    input_ids: torch.Tensor  # (L,) long
    attention_mask: torch.Tensor  # (L,) long, 0 on the left padding
    position_ids: torch.Tensor  # (L,) long, 0 on the padding, then 0, 1, 2, ...
    raw_prompt_ids: list[int]  # the unpadded (possibly truncated) prompt, for the rollout engine
    data_source: str
    ground_truth: Any  # reward_model.ground_truth, None when the data has no reward_model
    extra_info: dict
    index: int  # the row's position in the concatenated files, before filtering


@dataclass
class PromptBatch:
    """B prompts: (B, L) tensors and per-row metadata lists."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    position_ids: torch.Tensor  # (B, L)
    raw_prompt_ids: list[list[int]]
    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[dict]
    indices: list[int]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def _as_file_list(files: str | os.PathLike | Sequence, key: str) -> list[Path]:
    """One path or a list of them (an OmegaConf ListConfig is a Sequence) -> checked Paths; errors name ``key``."""
    items = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not items:
        raise ValueError(f"{key} is empty: expected a parquet file or a list of them")
    paths = [Path(os.fspath(f)).expanduser() for f in items]
    for path in paths:
        if path.is_dir():
            raise FileNotFoundError(f"{key}: {path} is a directory: expected a parquet file")
        if not path.is_file():
            raise FileNotFoundError(f"{key}: {path} does not exist")
    return paths


def _check_chat(prompt: Any, where: str, prompt_key: str) -> list[dict]:
    """The prompt as a list of {"role", "content"} dicts, or a clear error."""
    if isinstance(prompt, np.ndarray):  # parquet written through pandas
        prompt = prompt.tolist()
    ok = (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    )
    if not ok:
        raise ValueError(
            f"{where}: column {prompt_key!r} (data.prompt_key) must be a non-empty chat list "
            f"[{{'role': ..., 'content': ...}}, ...], got {type(prompt).__name__}: {str(prompt)[:80]!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _check_ground_truth(rows: list[dict], path: Path) -> None:
    """Every row carries ``reward_model.ground_truth``: without it every reward is 0 and the run learns nothing."""
    for k, row in enumerate(rows):
        spec = row.get("reward_model")
        if not isinstance(spec, dict) or spec.get("ground_truth") is None:
            what = ("no 'reward_model' column" if "reward_model" not in row else
                    f"reward_model={spec!r}, which lacks 'ground_truth'")
            raise ValueError(f"{path} row {k}: {what}; each row needs reward_model.ground_truth (the answer the "
                             "reward compares against), as data_preprocess/gsm8k.py writes it")


def _check_data_source(rows: list[dict], path: Path, column: str) -> None:
    """Every row names its data source (the reward function is chosen by it) as a non-empty string."""
    for k, row in enumerate(rows):
        value = row.get(column)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{path} row {k}: {column}={value!r}; each row's {column} column (data.reward_fn_key) "
                             "must name its data source, a non-empty string such as 'openai/gsm8k'")


def truncate(ids: list[int], max_len: int, mode: str) -> list[int]:
    """Cut ``ids`` to ``max_len`` tokens: left keeps the end, right the start, middle both halves."""
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    raise ValueError(f"truncation mode {mode!r} cannot cut; expected one of {TRUNCATION_MODES[1:]}")


def left_pad(ids: list[int], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each (length,), with ``ids`` right-aligned."""
    n_pad = length - len(ids)
    input_ids = torch.tensor([pad_id] * n_pad + ids, dtype=torch.long)
    attention_mask = torch.cat([torch.zeros(n_pad, dtype=torch.long), torch.ones(len(ids), dtype=torch.long)])
    position_ids = (attention_mask.cumsum(0) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


class RLDataset:
    """Chat prompts from parquet files, tokenized once; items are left-padded to max_prompt_length."""

    def __init__(
        self,
        files: str | os.PathLike | Sequence,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        reward_fn_key: str = "data_source",
        apply_chat_template_kwargs: dict | None = None,
        media_columns: Sequence[str] = (),
        tokenize_workers: int = 1,
        files_key: str = "the data files",
        max_samples: int = -1,
        sample_seed: int | None = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r}; expected one of {TRUNCATION_MODES}")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={max_prompt_length} must be >= 1")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; left padding needs one (set tokenizer.pad_token)")
        self.files = _as_file_list(files, files_key)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.reward_fn_key = reward_fn_key
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.media_columns = tuple(media_columns)
        self.tokenize_workers = max(1, tokenize_workers)

        rows, origins = self._read_rows()
        row_numbers = np.arange(len(rows))  # each row's number in the files (an item's index)
        if 0 < max_samples < len(rows):  # verl's data.train_max_samples / val_max_samples, before any filtering
            total = len(rows)
            picked = (np.random.default_rng(sample_seed).choice(total, size=max_samples, replace=False)
                      if sample_seed is not None else np.arange(max_samples))  # verl's draw, in its order
            rows, origins, row_numbers = [rows[i] for i in picked], [origins[i] for i in picked], picked
            logger.info("%s: %d of %d rows (data.*_max_samples)", files_key, max_samples, total)
        messages = [_check_chat(row[prompt_key], where, prompt_key) for row, where in zip(rows, origins)]
        token_ids = self._tokenize(messages)

        lengths = np.array([len(ids) for ids in token_ids])
        overlong = np.flatnonzero(lengths > max_prompt_length)
        keep = np.arange(len(rows))
        if filter_overlong_prompts:
            keep = np.flatnonzero(lengths <= max_prompt_length)
            if len(overlong):
                logger.warning(
                    "filtered %d of %d prompts longer than data.max_prompt_length=%d tokens (data.filter_overlong_prompts)",
                    len(overlong), len(rows), max_prompt_length,
                )
            if len(keep) == 0:
                raise ValueError(
                    f"every one of the {len(rows)} prompts in {[str(f) for f in self.files]} is longer than "
                    f"data.max_prompt_length={max_prompt_length} tokens"
                )
        elif truncation == "error" and len(overlong):
            i = int(overlong[0])
            raise ValueError(
                f"{origins[i]}: the prompt is {lengths[i]} tokens, longer than data.max_prompt_length="
                f"{max_prompt_length} ({len(overlong)} such rows); set data.truncation=left|right|middle or "
                "data.filter_overlong_prompts=True"
            )
        self.num_filtered = len(rows) - len(keep)
        self.prompt_lengths = lengths[keep]  # (N,) before truncation

        self._indices = [int(row_numbers[i]) for i in keep]
        self._token_ids = [truncate(token_ids[i], max_prompt_length, truncation) for i in keep]
        self._data_sources = [rows[i][reward_fn_key] for i in keep]
        self._ground_truths = [(rows[i].get("reward_model") or {}).get("ground_truth") for i in keep]
        self._extra_infos = [rows[i].get("extra_info") or {} for i in keep]

    @classmethod
    def from_config(cls, files_key: str, tokenizer, data: Any) -> "RLDataset":
        """The dataset of ``data.<files_key>`` as the config's ``data`` section describes it (verl's key names)."""
        return cls(getattr(data, files_key), tokenizer, files_key=f"data.{files_key}", prompt_key=data.prompt_key,
                   max_prompt_length=data.max_prompt_length,
                   truncation=data.truncation, filter_overlong_prompts=data.filter_overlong_prompts,
                   reward_fn_key=data.reward_fn_key, apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs),
                   media_columns=[VERL_MEDIA_COLUMNS[k] for k in sorted(VERL_MEDIA_COLUMNS)],
                   tokenize_workers=data.filter_overlong_prompts_workers,
                   max_samples=data.train_max_samples if files_key == "train_files" else data.val_max_samples,
                   sample_seed=data.seed if data.shuffle else None)

    def _read_rows(self) -> tuple[list[dict], list[str]]:
        """All rows of all files, and a "file row k" label for each (for error messages)."""
        rows, origins = [], []
        for path in self.files:
            try:
                table = pq.read_table(path)
            except Exception as err:
                raise ValueError(f"cannot read {path} as parquet: {err}") from err
            for column, key in ((self.prompt_key, "data.prompt_key"), (self.reward_fn_key, "data.reward_fn_key")):
                if column not in table.column_names:
                    raise ValueError(f"{path} has no {column!r} column ({key}); its columns are {table.column_names}")
            for column in self.media_columns:  # verl's image/video/audio columns (data.image_key, ...)
                if column in table.column_names and table.column(column).null_count < table.num_rows:
                    raise ValueError(f"{path} holds {column!r} media (data.{column[:-1]}_key): vision-language data is "
                                     "not supported by grpo_npu; use text-only prompts")
            file_rows = table.to_pylist()
            _check_ground_truth(file_rows, path)
            _check_data_source(file_rows, path, self.reward_fn_key)
            rows += file_rows
            origins += [f"{path} row {k}" for k in range(len(file_rows))]
        if not rows:
            raise ValueError(f"the data files {[str(f) for f in self.files]} hold no rows")
        return rows, origins

    def _tokenize(self, messages: list[list[dict]]) -> list[list[int]]:
        """Render every conversation with the chat template and tokenize them in one batch."""
        if not getattr(self.tokenizer, "chat_template", None):
            where = getattr(self.tokenizer, "name_or_path", "") or "?"
            raise ValueError(f"the tokenizer of {where} has no chat_template; RL prompts are chat lists and need one "
                             "(actor_rollout_ref.model.tokenizer_path or data.tokenizer can name one that has)")
        texts = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                   **self.apply_chat_template_kwargs)
        n = min(self.tokenize_workers, len(texts))
        if n <= 1:
            return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        # data.filter_overlong_prompts_workers: chunks tokenized on threads (fast tokenizers release the GIL)
        bounds = np.linspace(0, len(texts), n + 1).astype(int)
        chunks = [texts[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        with ThreadPoolExecutor(n) as pool:
            parts = pool.map(lambda c: self.tokenizer(c, add_special_tokens=False, return_attention_mask=False)["input_ids"],
                             chunks)
            return [ids for part in parts for ids in part]

    def __len__(self) -> int:
        return len(self._token_ids)

    @property
    def data_sources(self) -> list[str]:
        """The distinct data sources of the kept rows (the reward is chosen by them), sorted."""
        return sorted(set(self._data_sources))

    def __getitem__(self, i: int) -> PromptItem:
        ids = self._token_ids[i]
        input_ids, attention_mask, position_ids = left_pad(ids, self.max_prompt_length, self.tokenizer.pad_token_id)
        return PromptItem(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            raw_prompt_ids=list(ids),
            data_source=self._data_sources[i],
            ground_truth=self._ground_truths[i],
            extra_info=self._extra_infos[i],
            index=self._indices[i],
        )


def collate(items: Sequence[PromptItem]) -> PromptBatch:
    """Stack items (already left-padded to the same L) into a PromptBatch."""
    if not items:
        raise ValueError("cannot collate an empty list of prompts")
    return PromptBatch(
        input_ids=torch.stack([it.input_ids for it in items]),
        attention_mask=torch.stack([it.attention_mask for it in items]),
        position_ids=torch.stack([it.position_ids for it in items]),
        raw_prompt_ids=[it.raw_prompt_ids for it in items],
        data_sources=[it.data_source for it in items],
        ground_truths=[it.ground_truth for it in items],
        extra_infos=[it.extra_info for it in items],
        indices=[it.index for it in items],
    )


class PromptLoader:
    """Batches of a dataset in a seeded per-epoch order, resumable from ``state_dict()``.

    Iterating yields the remaining batches of the current epoch, so ``for epoch in ...: for batch in
    loader:`` walks the data as a DataLoader would; ``next_batch()`` serves loops that count steps
    (DAPO's generation rounds) and crosses epochs by itself. ``batch_size=None`` gives the whole
    dataset as one batch (validation).
    """

    def __init__(
        self,
        dataset: RLDataset,
        batch_size: int | None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.dataset = dataset
        self.batch_size = len(dataset) if batch_size is None else int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch size {batch_size} must be >= 1")
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if len(self) == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} prompts, fewer than one batch of {self.batch_size} "
                "(drop_last): lower data.train_batch_size or add data"
            )
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out
        self._order, self._order_epoch = None, None  # the permutation of the epoch in progress

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The dataset indices of ``epoch`` in visiting order, (N,)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self) -> PromptBatch:
        """The next batch, moving on to the next epoch when this one is spent."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.order(self.epoch), self.epoch
        start = self.position * self.batch_size
        idx = self._order[start:start + self.batch_size]
        self.position += 1  # counted before returning: a checkpoint taken now resumes after this batch
        return collate([self.dataset[int(i)] for i in idx])

    def __iter__(self) -> Iterator[PromptBatch]:
        """The rest of the current epoch (a whole new one if the current one is spent)."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        while self.position < len(self):
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at (epoch, position); the data and batching must be the ones the state came from."""
        for key in ("seed", "shuffle", "batch_size", "dataset_len"):
            ours = self.state_dict()[key]
            if state.get(key) != ours:
                raise ValueError(
                    f"cannot resume the prompt loader: its saved {key}={state.get(key)!r} differs from the "
                    f"current {key}={ours!r}; resuming would yield different batches"
                )
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"saved loader position {state['position']} is outside [0, {len(self)}]")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
