"""RLDataset and PromptLoader: chat template, left padding, filtering, truncation, errors, resume."""

from __future__ import annotations

import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import numpy as np
import pytest
import torch

from grpo_npu.data.rl_dataset import PromptLoader, RLDataset, collate, truncate
from grpo_npu.data.parquet import write_parquet_atomic
from grpo_npu.data.schema import make_row

QUESTIONS = [
    "What is 2 + 3?",
    "Tom has 5 apples and buys 7 more. How many apples does Tom have now?",
    "What is 12 - 4?",
    "There are " + "many many " * 30 + "coins. How many?",  # long: overlong at small max lengths
    "What is 9 + 9?",
    "Ana has 3 books. How many books does Ana have?",
]


def _rows(n: int, data_source: str = "openai/gsm8k") -> list[dict]:
    return [make_row(QUESTIONS[i % len(QUESTIONS)] + f" ({i})", f"x #### {i}", str(i), "train", i, data_source)
            for i in range(n)]


@pytest.fixture
def parquet(tmp_path):
    def write(rows, name="data.parquet"):
        return str(write_parquet_atomic(rows, tmp_path / name))

    return write


def _template_ids(tok, messages) -> list[int]:
    """Reference: one conversation through the chat template, tokenized alone."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chat_template_and_left_padding(tiny_tokenizer, parquet):
    rows = _rows(6)
    ds = RLDataset(parquet(rows), tiny_tokenizer, max_prompt_length=256)
    assert len(ds) == 6 and ds.num_filtered == 0
    pad = tiny_tokenizer.pad_token_id
    for i, row in enumerate(rows):
        item = ds[i]
        ref = _template_ids(tiny_tokenizer, row["prompt"])
        n = len(ref)
        assert item.raw_prompt_ids == ref
        assert item.input_ids.shape == (256,)
        assert item.input_ids[256 - n:].tolist() == ref
        assert item.input_ids[: 256 - n].tolist() == [pad] * (256 - n)
        assert item.attention_mask.tolist() == [0] * (256 - n) + [1] * n
        assert item.position_ids.tolist() == [0] * (256 - n) + list(range(n))
        text = tiny_tokenizer.decode(item.raw_prompt_ids)
        assert text.startswith("<|im_start|>user\n" + row["prompt"][0]["content"])
        assert text.endswith("<|im_start|>assistant\n")
        assert item.data_source == "openai/gsm8k"
        assert item.ground_truth == str(i)
        assert item.extra_info == row["extra_info"]
        assert item.index == i


def test_collate_stacks_and_keeps_metadata(tiny_tokenizer, parquet):
    ds = RLDataset(parquet(_rows(4)), tiny_tokenizer, max_prompt_length=128)
    batch = collate([ds[i] for i in (2, 0)])
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.position_ids.shape == (2, 128)
    assert torch.equal(batch.input_ids[0], ds[2].input_ids)
    assert batch.ground_truths == ["2", "0"] and batch.indices == [2, 0]
    assert batch.data_sources == ["openai/gsm8k"] * 2
    with pytest.raises(ValueError, match="empty"):
        collate([])


def test_several_files_and_custom_keys(tiny_tokenizer, tmp_path):
    rows = _rows(5)
    for r in rows:
        r["question_chat"] = r.pop("prompt")
        r["source"] = "src-" + r["extra_info"]["split"]
    a = write_parquet_atomic(rows[:2], tmp_path / "a.parquet")
    b = write_parquet_atomic(rows[2:], tmp_path / "b.parquet")
    ds = RLDataset([str(a), b], tiny_tokenizer, prompt_key="question_chat", max_prompt_length=256,
                   reward_fn_key="source")
    assert [ds[i].ground_truth for i in range(len(ds))] == ["0", "1", "2", "3", "4"]
    assert ds[0].data_source == "src-train"
    assert ds[0].raw_prompt_ids == _template_ids(tiny_tokenizer, rows[0]["question_chat"])
    assert [ds[i].index for i in range(len(ds))] == [0, 1, 2, 3, 4]


def test_max_samples_takes_the_first_rows_or_verls_seeded_draw(tiny_tokenizer, parquet):
    """verl's data.train_max_samples / val_max_samples: without shuffling the first N rows, with it
    numpy.random.default_rng(seed).choice(total, N, replace=False) in that order; an item keeps its row number."""
    path = parquet(_rows(10))
    first = RLDataset(path, tiny_tokenizer, max_prompt_length=256, max_samples=4)
    assert [first[i].index for i in range(len(first))] == [0, 1, 2, 3]
    drawn = RLDataset(path, tiny_tokenizer, max_prompt_length=256, max_samples=4, sample_seed=7)
    want = np.random.default_rng(7).choice(10, size=4, replace=False).tolist()
    assert [drawn[i].index for i in range(len(drawn))] == want and want != [0, 1, 2, 3]
    assert [drawn[i].ground_truth for i in range(len(drawn))] == [str(i) for i in want]
    assert len(RLDataset(path, tiny_tokenizer, max_prompt_length=256, max_samples=50)) == 10  # more than there are


def test_filter_overlong_counts_and_reports(tiny_tokenizer, parquet, caplog):
    rows = _rows(12)
    max_len = 40
    lengths = [len(_template_ids(tiny_tokenizer, r["prompt"])) for r in rows]
    expected_keep = [i for i, n in enumerate(lengths) if n <= max_len]
    assert 0 < len(expected_keep) < len(rows)  # the fixture has both kinds
    with caplog.at_level(logging.WARNING, logger="grpo_npu.data.rl_dataset"):
        ds = RLDataset(parquet(rows), tiny_tokenizer, max_prompt_length=max_len, filter_overlong_prompts=True)
    assert ds.num_filtered == len(rows) - len(expected_keep)
    assert [ds[i].index for i in range(len(ds))] == expected_keep
    assert f"filtered {ds.num_filtered} of {len(rows)} prompts" in caplog.text
    assert all(int(ds[i].attention_mask.sum()) <= max_len for i in range(len(ds)))


def test_filter_everything_is_an_error(tiny_tokenizer, parquet):
    with pytest.raises(ValueError, match="every one of the 3 prompts .* longer than data.max_prompt_length=5"):
        RLDataset(parquet(_rows(3)), tiny_tokenizer, max_prompt_length=5, filter_overlong_prompts=True)


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tiny_tokenizer, parquet, mode):
    rows = _rows(6)
    max_len = 21  # odd: middle keeps 10 + 11
    ds = RLDataset(parquet(rows), tiny_tokenizer, max_prompt_length=max_len, truncation=mode,
                   filter_overlong_prompts=False)
    assert len(ds) == 6 and ds.num_filtered == 0
    for i, row in enumerate(rows):
        full = _template_ids(tiny_tokenizer, row["prompt"])
        assert len(full) > max_len
        expected = {"left": full[-max_len:], "right": full[:max_len], "middle": full[:10] + full[-11:]}[mode]
        assert ds[i].raw_prompt_ids == expected
        assert ds[i].input_ids.tolist() == expected and int(ds[i].attention_mask.sum()) == max_len


def test_truncate_leaves_short_prompts_alone():
    assert truncate([1, 2, 3], 3, "left") == [1, 2, 3]
    assert truncate([1, 2, 3, 4, 5], 4, "middle") == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="cannot cut"):
        truncate([1, 2, 3], 2, "error")


def test_truncation_error_names_the_row_and_length(tiny_tokenizer, parquet):
    rows = _rows(6)
    path = parquet(rows)
    n3 = len(_template_ids(tiny_tokenizer, rows[3]["prompt"]))
    max_len = max(len(_template_ids(tiny_tokenizer, r["prompt"])) for i, r in enumerate(rows) if i != 3)
    assert n3 > max_len
    with pytest.raises(ValueError, match=rf"data\.parquet row 3: the prompt is {n3} tokens, longer than "
                                         rf"data\.max_prompt_length={max_len}"):
        RLDataset(path, tiny_tokenizer, max_prompt_length=max_len, truncation="error", filter_overlong_prompts=False)


def test_bad_inputs_give_clear_errors(tiny_tokenizer, parquet, tmp_path):
    good = parquet(_rows(2))
    with pytest.raises(FileNotFoundError, match=r"^data\.val_files: .*nope\.parquet does not exist$"):
        RLDataset([good, str(tmp_path / "nope.parquet")], tiny_tokenizer, files_key="data.val_files")
    (tmp_path / "dir.parquet").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^data\.train_files: .*dir\.parquet is a directory: expected a parquet file$"):
        RLDataset([good, str(tmp_path / "dir.parquet")], tiny_tokenizer, files_key="data.train_files")
    with pytest.raises(ValueError, match=r"^data\.train_files is empty: expected a parquet file or a list of them$"):
        RLDataset([], tiny_tokenizer, files_key="data.train_files")
    with pytest.raises(ValueError, match=r"data.truncation='sideways'"):
        RLDataset(good, tiny_tokenizer, truncation="sideways")

    no_prompt = [{k: v for k, v in r.items() if k != "prompt"} for r in _rows(2)]
    with pytest.raises(ValueError, match=r"no 'prompt' column \(data.prompt_key\); its columns are"):
        RLDataset(parquet(no_prompt, "np.parquet"), tiny_tokenizer)
    with pytest.raises(ValueError, match=r"no 'messages' column \(data.prompt_key\)"):
        RLDataset(good, tiny_tokenizer, prompt_key="messages")

    no_source = [{k: v for k, v in r.items() if k != "data_source"} for r in _rows(2)]
    with pytest.raises(ValueError, match=r"no 'data_source' column \(data.reward_fn_key\)"):
        RLDataset(parquet(no_source, "ns.parquet"), tiny_tokenizer)

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(1)).slice(0, 0), empty)
    with pytest.raises(ValueError, match="hold no rows"):
        RLDataset(str(empty), tiny_tokenizer)

    plain = [{**r, "prompt": r["extra_info"]["question"]} for r in _rows(3)]  # a string, not a chat
    with pytest.raises(ValueError, match=r"plain\.parquet row 0: column 'prompt' \(data.prompt_key\) must be a "
                                         r"non-empty chat list .*got str"):
        RLDataset(parquet(plain, "plain.parquet"), tiny_tokenizer)

    no_content = _rows(2)
    no_content[1]["prompt"] = [{"role": "user", "text": "hi"}]
    with pytest.raises(ValueError, match=r"row 1: column 'prompt'"):
        RLDataset(parquet(no_content, "nc.parquet"), tiny_tokenizer)

    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("not parquet")
    with pytest.raises(ValueError, match="cannot read .*x.parquet as parquet"):
        RLDataset(str(not_parquet), tiny_tokenizer)


# ---------------------------------------------------------------------------------------------
# PromptLoader
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def small_ds(tiny_tokenizer, parquet):
    return RLDataset(parquet(_rows(10)), tiny_tokenizer, max_prompt_length=64, truncation="left",
                     filter_overlong_prompts=False)


def _walk(loader, n_batches):
    """The index lists of the next n batches, crossing epochs."""
    out = []
    while len(out) < n_batches:
        for batch in loader:
            out.append(batch.indices)
            if len(out) == n_batches:
                break
    return out


def test_loader_epochs_are_seeded_permutations(small_ds):
    loader = PromptLoader(small_ds, 3, shuffle=True, seed=7, drop_last=True)
    assert len(loader) == 3
    epoch0 = [b.indices for b in loader]
    epoch1 = [b.indices for b in loader]
    assert (loader.epoch, loader.position) == (1, 3)  # epoch 1 is spent; the next walk starts epoch 2
    for epoch in (epoch0, epoch1):
        flat = [i for b in epoch for i in b]
        assert len(flat) == 9 and len(set(flat)) == 9  # drop_last: one prompt left out
    assert epoch0 != epoch1
    again = PromptLoader(small_ds, 3, shuffle=True, seed=7)
    assert [b.indices for b in again] == epoch0
    other = PromptLoader(small_ds, 3, shuffle=True, seed=8)
    assert [b.indices for b in other] != epoch0


def test_loader_without_shuffle_and_drop_last(small_ds):
    loader = PromptLoader(small_ds, 4, shuffle=False, drop_last=False)
    assert [b.indices for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    val = PromptLoader(small_ds, None, shuffle=False, drop_last=False)
    batches = list(val)
    assert len(batches) == 1 and batches[0].indices == list(range(10))
    assert batches[0].input_ids.shape == (10, 64)


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 4, 7])
def test_resume_gives_the_same_batches(small_ds, stop_after):
    reference = _walk(PromptLoader(small_ds, 3, seed=3), 10)
    first = PromptLoader(small_ds, 3, seed=3)
    seen = _walk(first, stop_after) if stop_after else []
    state = first.state_dict()
    resumed = PromptLoader(small_ds, 3, seed=3)
    resumed.load_state_dict(state)
    assert seen + _walk(resumed, 10 - stop_after) == reference


def test_stopping_at_an_epoch_end_and_next_batch(small_ds):
    reference = _walk(PromptLoader(small_ds, 3, seed=5), 9)
    loader = PromptLoader(small_ds, 3, seed=5)
    first = []
    for batch in loader:
        first.append(batch.indices)
        if len(first) == 3:
            break  # stopped right after the epoch's last batch, before the generator finished
    assert [b.indices for b in loader] == reference[3:6]  # a whole next epoch, not an empty one
    stepper = PromptLoader(small_ds, 3, seed=5)
    assert [stepper.next_batch().indices for _ in range(9)] == reference


def test_state_from_another_setup_is_refused(small_ds):
    state = PromptLoader(small_ds, 3, seed=3).state_dict()
    with pytest.raises(ValueError, match="saved batch_size=3 differs from the current batch_size=2"):
        PromptLoader(small_ds, 2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="saved seed=3 differs"):
        PromptLoader(small_ds, 3, seed=4).load_state_dict(state)


def test_loader_too_small_for_one_batch(small_ds):
    with pytest.raises(ValueError, match="10 prompts, fewer than one batch of 16"):
        PromptLoader(small_ds, 16, drop_last=True)


@pytest.mark.parametrize("damage", ["drop_column", "no_ground_truth"])
def test_data_without_ground_truth_is_refused_naming_file_and_row(tiny_tokenizer, parquet, damage):
    rows = _rows(4)
    if damage == "drop_column":
        rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in rows]
    else:
        rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = parquet(rows)
    with pytest.raises(ValueError) as err:
        RLDataset(path, tiny_tokenizer, max_prompt_length=256)
    msg = str(err.value)
    row = 0 if damage == "drop_column" else 2
    assert "\n" not in msg and f"{path} row {row}" in msg and "reward_model.ground_truth" in msg


def test_reward_fn_key_names_the_data_source_column(tiny_tokenizer, parquet):
    rows = _rows(3)
    for r in rows:
        r["task"] = "my/source"
    ds = RLDataset(parquet(rows), tiny_tokenizer, max_prompt_length=256, reward_fn_key="task")
    assert [ds[i].data_source for i in range(3)] == ["my/source"] * 3


def test_chat_template_kwargs_reach_the_template(tiny_tokenizer, parquet):
    """data.apply_chat_template_kwargs (verl's key) are the chat template's variables, e.g. enable_thinking."""
    import copy

    from grpo_npu.config import load_config

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% if enable_thinking %}<think>{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    base = ["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "data.max_prompt_length=256"]
    path = parquet(_rows(2))
    base.append(f"data.train_files={path}")
    plain = RLDataset.from_config("train_files", tok, load_config(base).data)
    thinking = RLDataset.from_config("train_files", tok,
                                     load_config(base + ["+data.apply_chat_template_kwargs.enable_thinking=True"]).data)
    think_ids = tok("<think>", add_special_tokens=False)["input_ids"]
    assert thinking[0].raw_prompt_ids == think_ids + plain[0].raw_prompt_ids


def test_media_columns_are_refused(tiny_tokenizer, parquet):
    """Rows with verl's image column (data.image_key's default) are vision-language data: refused, naming it."""
    from grpo_npu.config import load_config

    def data(path):
        return load_config(["actor_rollout_ref.model.path=/tmp/tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                            "data.max_prompt_length=256", f"data.val_files={path}"]).data

    rows = _rows(2)
    with_images = [dict(r, images=[{"image": "x.png"}]) for r in rows]
    with pytest.raises(ValueError, match=r"holds 'images' media \(data\.image_key\): vision-language data is not supported"):
        RLDataset.from_config("val_files", tiny_tokenizer, data(parquet(with_images, "vl.parquet")))
    no_images = [dict(r, images=None) for r in rows]  # an empty media column is text-only data
    assert len(RLDataset.from_config("val_files", tiny_tokenizer, data(parquet(no_images, "text.parquet")))) == 2


def test_tokenize_workers_give_the_same_ids(tiny_tokenizer, parquet):
    """data.filter_overlong_prompts_workers: chunks on threads, the same ids in the same order as one call."""
    path = parquet(_rows(7))
    one = RLDataset(path, tiny_tokenizer, max_prompt_length=256)
    three = RLDataset(path, tiny_tokenizer, max_prompt_length=256, tokenize_workers=3)
    assert [one[i].raw_prompt_ids for i in range(7)] == [three[i].raw_prompt_ids for i in range(7)]


def test_a_tokenizer_without_a_chat_template_is_named(tiny_tokenizer, parquet, monkeypatch):
    monkeypatch.setattr(tiny_tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match=rf"^the tokenizer of {re.escape(tiny_tokenizer.name_or_path)} has no "
                                         r"chat_template; RL prompts are chat lists and need one \("):
        RLDataset(parquet(_rows(2)), tiny_tokenizer)


@pytest.mark.parametrize("value", [None, ""])
def test_a_row_without_a_data_source_is_refused_naming_file_and_row(tiny_tokenizer, parquet, value):
    """The reward is chosen by data_source: a null one used to load, then score 0 with a warning per row."""
    rows = _rows(6)
    rows[4]["data_source"] = value
    with pytest.raises(ValueError, match=rf"data\.parquet row 4: data_source={re.escape(repr(value))}; each row's "
                                         r"data_source column \(data\.reward_fn_key\) must name its data source"):
        RLDataset(parquet(rows), tiny_tokenizer)
