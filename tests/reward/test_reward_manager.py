"""Reward managers: decoding, last-token placement, dapo overlong shaping, per-row info, sandbox == serial."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from grpo_npu.reward import RewardFunctionError, compute_score, make_compute_score
from grpo_npu.reward.manager import OverlongShaping, decode, get_reward_manager, last_token_index

TEXTS = [
    "12 + 30 = 42. #### 42",  # right
    "12 + 30 = 43. #### 43",  # wrong
    "I think it is 42",  # no marker: strict finds nothing
    "#### 42.0",  # numerically right
    "",  # empty response: only eos
]
TRUTHS = ["42", "42", "42", "42", "42"]


def make_batch(tok, texts, width=24, eos=True, empty_rows=()):
    """(response_ids, response_mask), (B, T): text tokens + eos, right-padded; rows in empty_rows have no token."""
    ids = torch.full((len(texts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        if i in empty_rows:
            continue
        row = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
        assert len(row) <= width
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def reference_token_scores(ids, mask, tok, data_sources, truths, score_fn) -> torch.Tensor:
    """Row by row: decode up to the last masked token, score, put the score there."""
    out = torch.zeros(ids.shape, dtype=torch.float32)
    for i in range(ids.shape[0]):
        valid = [t for t, m in enumerate(mask[i].tolist()) if m]
        if not valid:
            continue
        text = tok.decode(ids[i, : valid[-1] + 1].tolist(), skip_special_tokens=True)
        out[i, valid[-1]] = score_fn(data_sources[i], text, truths[i])
    return out


def test_naive_places_the_score_on_the_last_token(tiny_tokenizer):
    ids, mask = make_batch(tiny_tokenizer, TEXTS)
    sources = ["openai/gsm8k"] * len(TEXTS)
    manager = get_reward_manager("naive", tokenizer=tiny_tokenizer, num_workers=1)
    out = manager(ids, mask, sources, TRUTHS)
    ref = reference_token_scores(ids, mask, tiny_tokenizer, sources, TRUTHS,
                                 lambda s, t, g: compute_score(s, t, g)["score"])
    assert out.token_level_scores.dtype == torch.float32
    torch.testing.assert_close(out.token_level_scores, ref)
    assert out.column("score") == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert out.column("acc") == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert out.column("pred") == ["42", "43", None, "42.0", None]
    assert out.token_level_scores.sum(1).tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert out.token_level_scores[0, int(mask[0].sum()) - 1] == 1.0  # on the eos, the last response token


def test_decoding_skips_special_tokens_and_handles_holes_and_empty_rows(tiny_tokenizer):
    seen = []

    def spy(data_source, solution_str, ground_truth, extra_info):
        seen.append((solution_str, extra_info))
        return 2.5

    ids, mask = make_batch(tiny_tokenizer, ["#### 1", "#### 2", "#### 3"], eos=False, empty_rows=(2,))  # cut at the limit
    mask[1, 1] = 0  # a hole inside the response (e.g. masked tool output): the text still runs to the last 1
    manager = get_reward_manager("naive", tokenizer=tiny_tokenizer, compute_score=spy)
    out = manager(ids, mask, ["a", "b", "c"], ["1", "2", "3"], [{"k": 0}, {"k": 1}, None])
    assert [s for s, _ in seen] == ["#### 1", "#### 2", ""]
    assert [e for _, e in seen] == [{"k": 0}, {"k": 1}, None]
    last = last_token_index(mask)
    assert last.tolist() == [int(mask[0].sum()) - 1, int(mask[1].sum()), -1]
    assert out.token_level_scores[0, last[0]] == 2.5 and out.token_level_scores[1, last[1]] == 2.5
    assert out.token_level_scores[2].abs().sum() == 0  # no token to carry it ...
    assert out.extra[2]["score"] == 2.5  # ... but the score is reported
    assert out.column("acc") == [2.5, 2.5, 2.5]  # a float result: acc is the score (as verl's DAPO manager)


def test_fast_decode_matches_batch_decode(tiny_tokenizer):
    ids, mask = make_batch(tiny_tokenizer, TEXTS + ["Ana has 3 books, 1,000 coins & 2 <|im_start|> marks"], width=40)
    seqs = [row[: int(m.sum())] for row, m in zip(ids.tolist(), mask)]
    assert decode(tiny_tokenizer, seqs) == tiny_tokenizer.batch_decode(seqs, skip_special_tokens=True)


@pytest.mark.parametrize("buffer_len, factor", [(4, 1.0), (8, 0.5), (20, 2.0)])
def test_dapo_overlong_penalty(tiny_tokenizer, buffer_len, factor):
    max_len = 32
    texts = ["#### 42", "#### 4" + " 4" * 6, "#### 42" + " x" * 8, "#### 41" + " y" * 10, "#### 42" + " z" * 13]
    ids, mask = make_batch(tiny_tokenizer, texts, width=max_len)  # lengths 5, 16, 21, 25, 31 with eos
    sources, truths = ["openai/gsm8k"] * 5, ["42"] * 5
    manager = get_reward_manager("dapo", tokenizer=tiny_tokenizer,
                                 overlong=OverlongShaping(max_len, buffer_len=buffer_len, penalty_factor=factor))
    out = manager(ids, mask, sources, truths)
    lengths = mask.sum(1).tolist()
    scores = [compute_score(s, tiny_tokenizer.decode(ids[i, : lengths[i]], skip_special_tokens=True), g)["score"]
              for i, (s, g) in enumerate(zip(sources, truths))]
    for i, n in enumerate(lengths):
        exceed = n - (max_len - buffer_len)
        penalty = min(-exceed / buffer_len * factor, 0.0)
        assert out.extra[i]["overlong_reward"] == pytest.approx(penalty)
        assert out.extra[i]["overlong"] == (penalty < 0)
        assert out.extra[i]["score"] == scores[i]  # the scorer's score, before shaping
        assert out.token_level_scores[i, n - 1].item() == pytest.approx(scores[i] + penalty)
        assert out.token_level_scores[i].count_nonzero() <= 1
    assert any(out.column("overlong")) and not all(out.column("overlong"))
    assert "reward/overlong_reward/mean" not in out.metrics  # only with reward_model.overlong_buffer.log


def test_dapo_overlong_log_metrics(tiny_tokenizer):
    """reward_model.overlong_buffer.log: the batch means of overlong_reward and overlong become metrics."""
    texts = ["#### 42", "#### 42" + " z" * 13, "#### 42" + " x" * 8]
    ids, mask = make_batch(tiny_tokenizer, texts, width=32)
    manager = get_reward_manager("dapo", tokenizer=tiny_tokenizer,
                                 overlong=OverlongShaping(32, buffer_len=16, log=True))
    out = manager(ids, mask, ["openai/gsm8k"] * 3, ["42"] * 3)
    rewards = out.column("overlong_reward")
    assert out.metrics["reward/overlong_reward/mean"] == pytest.approx(sum(rewards) / 3)
    assert out.metrics["reward/overlong/mean"] == pytest.approx(sum(r < 0 for r in rewards) / 3)
    assert 0 < out.metrics["reward/overlong/mean"] < 1


def test_dapo_without_buffer_equals_naive(tiny_tokenizer):
    ids, mask = make_batch(tiny_tokenizer, TEXTS)
    args = (ids, mask, ["openai/gsm8k"] * 5, TRUTHS)
    naive = get_reward_manager("naive", tokenizer=tiny_tokenizer)(*args)
    dapo = get_reward_manager("dapo", tokenizer=tiny_tokenizer)(*args)
    assert torch.equal(naive.token_level_scores, dapo.token_level_scores)
    assert naive.extra == dapo.extra


def test_manager_errors(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"reward_manager='prime'; known: \['dapo', 'gdpo', 'naive'\]"):
        get_reward_manager("prime", tokenizer=tiny_tokenizer)
    with pytest.raises(ValueError, match="overlong_buffer.enable=True needs reward_model.reward_manager=dapo"):
        get_reward_manager("naive", tokenizer=tiny_tokenizer, overlong=OverlongShaping(8, buffer_len=4))
    with pytest.raises(ValueError, match=r"overlong_buffer.len: expected <= data.max_response_length \(8\)"):
        get_reward_manager("dapo", tokenizer=tiny_tokenizer, overlong=OverlongShaping(8, buffer_len=9))
    with pytest.raises(ValueError, match="overlong_buffer.len: expected > 0"):
        get_reward_manager("dapo", tokenizer=tiny_tokenizer, overlong=OverlongShaping(8, buffer_len=0))
    with pytest.raises(ValueError, match="num_workers=-1"):
        get_reward_manager("naive", tokenizer=tiny_tokenizer, num_workers=-1)
    manager = get_reward_manager("naive", tokenizer=tiny_tokenizer)
    ids, mask = make_batch(tiny_tokenizer, TEXTS[:2])
    with pytest.raises(ValueError, match="response_mask shape"):
        manager(ids, mask[:, :3], ["openai/gsm8k"] * 2, ["1", "2"])
    with pytest.raises(ValueError, match="ground_truths has 1 entries for 2 responses"):
        manager(ids, mask, ["openai/gsm8k"] * 2, ["1"])
    with pytest.raises(RewardFunctionError, match=r"row 1 \(data_source='mystery'\): .*NotImplementedError: no built-in reward"):
        manager(ids, mask, ["openai/gsm8k", "mystery"], ["1", "2"])


@pytest.mark.parametrize("result, message", [
    ({"acc": 1.0}, r"row 0 \(data_source='s'\): the reward function returned a dict without 'score' \(keys: \['acc'\]\)"),
    ("high", "returned a non-numeric score/acc: 'high'"),
    ({"score": 1.0, "acc": "yes"}, "non-numeric score/acc"),
])
def test_unusable_results_are_reported(tiny_tokenizer, result, message):
    manager = get_reward_manager("naive", tokenizer=tiny_tokenizer, compute_score=lambda *a: result)
    ids, mask = make_batch(tiny_tokenizer, ["x"])
    with pytest.raises(RewardFunctionError, match=message):
        manager(ids, mask, ["s"], ["1"])


def test_dict_results_keep_their_extra_keys(tiny_tokenizer):
    fn = lambda ds, text, gt, info: {"score": -1.0, "acc": False, "pred": "p", "judge": "strict"}  # noqa: E731
    out = get_reward_manager("naive", tokenizer=tiny_tokenizer, compute_score=fn)(
        *make_batch(tiny_tokenizer, ["a", "b"]), ["s", "s"], ["1", "1"])
    assert out.extra == [{"score": -1.0, "acc": 0.0, "pred": "p", "judge": "strict"}] * 2


# ------------------------------------------------------------------------------------------------
# The process pool (the reward sandbox; its failure handling: tests/reward/test_sandbox.py)
# ------------------------------------------------------------------------------------------------
N_MANY = 104  # rows: several chunks per worker
SLOW_FILE = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, delay=0.0):
    time.sleep(delay)
    return {"score": float(solution_str.endswith(ground_truth)), "pid_tag": len(solution_str)}
'''


def _many(tok, n):
    texts = [f"{i} + 1 = {i + 1}. #### {i + (i % 3 == 0)}" for i in range(n)]
    truths = [str(i + 1) for i in range(n)]
    return make_batch(tok, texts, width=32), ["openai/gsm8k"] * n, truths


def test_pool_equals_in_process(tiny_tokenizer, tmp_path):
    (ids, mask), sources, truths = _many(tiny_tokenizer, N_MANY)
    serial = get_reward_manager("naive", tokenizer=tiny_tokenizer, num_workers=1)(ids, mask, sources, truths)
    with get_reward_manager("naive", tokenizer=tiny_tokenizer, num_workers=2) as pooled:
        out = pooled(ids, mask, sources, truths)
        assert pooled.scorer.last_used_pool
    assert torch.equal(out.token_level_scores, serial.token_level_scores) and out.extra == serial.extra
    assert 0 < sum(out.column("acc")) < len(truths)

    path = tmp_path / "slow.py"
    path.write_text(SLOW_FILE)
    custom = make_compute_score(str(path), reward_kwargs={"delay": 0.0})
    one = get_reward_manager("naive", tokenizer=tiny_tokenizer, compute_score=custom, num_workers=1)(ids, mask, sources, truths)
    with get_reward_manager("naive", tokenizer=tiny_tokenizer, compute_score=custom, num_workers=2) as pooled:
        two = pooled(ids, mask, sources, truths)  # the FileFunction is re-loaded inside each worker
        assert pooled.scorer.last_used_pool
    assert one.extra == two.extra and torch.equal(one.token_level_scores, two.token_level_scores)


def test_auto_mode_keeps_bounded_builtins_in_process_and_sandboxes_custom_functions(tiny_tokenizer, tmp_path):
    (ids, mask), sources, truths = _many(tiny_tokenizer, N_MANY)
    with get_reward_manager("naive", tokenizer=tiny_tokenizer, num_workers=0) as fast:
        fast(ids, mask, sources, truths)
        assert not fast.scorer.last_used_pool  # the gsm8k regex reads 300 characters: microseconds a row
    path = tmp_path / "slow.py"
    path.write_text(SLOW_FILE)
    for delay in (0.0, 2e-3):  # a custom function is sandboxed however cheap it is
        fn = make_compute_score(str(path), reward_kwargs={"delay": delay})
        with get_reward_manager("naive", tokenizer=tiny_tokenizer, compute_score=fn, num_workers=0) as custom:
            out = custom(ids, mask, sources, truths)
            assert custom.scorer.last_used_pool
        assert out.column("score")[:4] == [1.0, 0.0, 0.0, 1.0]
        assert out.metrics == {"reward/timeouts": 0.0, "reward/errors": 0.0}


def test_unpicklable_scorer_stays_in_process(tiny_tokenizer, caplog):
    (ids, mask), sources, truths = _many(tiny_tokenizer, N_MANY)
    fn = lambda ds, text, gt, info: 1.0  # noqa: E731  (a lambda cannot be pickled)
    with pytest.raises(Exception):
        pickle.dumps(fn)
    with caplog.at_level(logging.WARNING, logger="grpo_npu.reward.parallel"):
        with get_reward_manager("naive", tokenizer=tiny_tokenizer, compute_score=fn, num_workers=2) as manager:
            out = manager(ids, mask, sources, truths)
            assert not manager.scorer.last_used_pool
    assert out.column("score") == [1.0] * len(truths)
    assert "cannot be pickled" in caplog.text


def test_errors_inside_workers_name_the_row(tiny_tokenizer, tmp_path, caplog):
    """One failing row of 104 is under reward_model.max_failed_fraction: it scores the fallback, counted and logged."""
    path = tmp_path / "picky.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    if ground_truth == '80':\n        raise KeyError('no rubric')\n    return 0.5\n")
    (ids, mask), sources, truths = _many(tiny_tokenizer, N_MANY)
    with caplog.at_level(logging.WARNING, logger="grpo_npu.reward.parallel"):
        with get_reward_manager("naive", tokenizer=tiny_tokenizer, compute_score=make_compute_score(str(path)),
                                num_workers=2) as manager:
            out = manager(ids, mask, sources, truths)
    assert out.column("score") == [0.5] * 79 + [0.0] + [0.5] * (N_MANY - 80)
    assert out.metrics == {"reward/timeouts": 0.0, "reward/errors": 1.0}
    assert "row 79 (data_source='openai/gsm8k'): the reward function raised KeyError: 'no rubric'" in caplog.text
