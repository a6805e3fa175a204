"""The weight-sync canary on toys: the schedule, the bisection's probe count, the stop line and its metrics.

The toy engine holds one scalar per tensor name; its log-prob of every probe token is -1 minus how far its
tensors are from the actor's, so a tensor sent wrong shows as a mismatch exactly as on a real model.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_npu.errors import SyncMismatch, TrainingStopped
from grpo_npu.rollout.base import Rollout
from grpo_npu.rollout.names import SYNC_CHECK_THRESHOLDS
from grpo_npu.rollout.sync_check import KEY, PROBE_MAX_TOKENS, SyncCheck, bisect, default_threshold, mixed_weights

NAMES = [f"model.layers.{i}.weight" for i in range(16)]


@pytest.mark.parametrize("count", [1, 2, 3, 16, 17, 100])
def test_bisect_finds_the_broken_name_in_log2_probes(count):
    names = [f"t{i}" for i in range(count)]
    counts = []
    for broken in names:
        probes = []

        def is_bad(suspects: set[str]) -> bool:
            probes.append(suspects)
            return broken in suspects

        assert bisect(names, is_bad) == broken
        counts.append(len(probes))
    # halvings, plus one probe of the name found alone when the last halving kept the second half
    assert max(counts) <= math.ceil(math.log2(count)) + 1
    if count == 16:
        assert (min(counts), max(counts)) == (4, 5)


def test_bisect_gives_none_when_no_single_tensor_is_at_fault():
    # the mismatch needs t3 and t12 together: no half, and no single tensor, reproduces it
    assert bisect(NAMES, lambda s: {NAMES[3], NAMES[12]} <= s) is None


def test_mixed_weights_takes_suspects_from_the_synced_stream():
    synced = [(n, torch.tensor(float(i))) for i, n in enumerate(NAMES)]
    correct = [(n, torch.tensor(-1.0)) for n in NAMES]
    out = dict(mixed_weights({NAMES[2], NAMES[5]}, iter(synced), iter(correct)))
    assert [k for k, v in out.items() if float(v) != -1.0] == [NAMES[2], NAMES[5]]
    with pytest.raises(RuntimeError, match="sends 'b' where the actor has 'a'"):
        list(mixed_weights(set(), iter([("b", torch.zeros(1))]), iter([("a", torch.zeros(1))])))


def test_schedule_first_syncs_then_every_n_steps_once_per_step():
    check = SyncCheck(first_syncs=2, every_n_steps=3, threshold=1.0, probe_prompts=1, device=torch.device("cpu"))
    # (step, syncs): validation before training and step 1 share step 1; DAPO regenerates twice in step 3
    steps = [1, 1, 2, 3, 3, 4, 5, 6, 6, 7]
    assert [s for s in steps if check.due(s)] == [1, 1, 3, 6]
    off = SyncCheck(first_syncs=0, every_n_steps=0, threshold=1.0, probe_prompts=1, device=torch.device("cpu"))
    assert not any(off.due(s) for s in range(1, 10))


def test_default_threshold_is_the_least_precise_dtype():
    assert default_threshold([torch.float32]) == SYNC_CHECK_THRESHOLDS["float32"]
    assert default_threshold([torch.float32, torch.bfloat16]) == 0.05
    with pytest.raises(ValueError, match=f"{KEY}.threshold"):
        default_threshold([torch.float64])


def test_probe_is_the_first_prompts_last_tokens_and_stays_fixed():
    check = SyncCheck(first_syncs=1, every_n_steps=0, threshold=1.0, probe_prompts=2, device=torch.device("cpu"))
    ids = torch.tensor([[0, 0, 5, 6], [0, 0, 0, 9], [1, 2, 3, 4], [7, 7, 7, 7]])
    mask = (ids > 0).long()
    check.set_probe(ids, mask)
    assert check.probe == [[5, 6], [1, 2, 3, 4]]  # the 1-token prompt cannot be teacher-forced
    check.set_probe(ids.flip(0), mask.flip(0))
    assert check.probe == [[5, 6], [1, 2, 3, 4]]
    long = torch.arange(1, 200)[None]
    fresh = SyncCheck(first_syncs=1, every_n_steps=0, threshold=1.0, probe_prompts=2, device=torch.device("cpu"))
    fresh.set_probe(long, torch.ones_like(long))
    assert fresh.probe == [list(range(200 - PROBE_MAX_TOKENS, 200))]


class ToyEngine(Rollout):
    """Packs what it receives (cannot hand it back); scores every token -1 - sum |engine - actor|."""

    def __init__(self, actor: dict[str, float]):
        self.actor = actor
        self.weights: dict[str, float] = {}
        self.syncs = 0

    def generate(self, prompt_ids, prompt_mask, sampling):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        self.syncs += 1
        self.weights.update({n: float(t) for n, t in named_tensors})

    def prompt_logprobs(self, sequences):
        error = sum(abs(self.weights[n] - v) for n, v in self.actor.items())
        return [torch.full((len(s) - 1,), -1.0 - error) for s in sequences]


def actor_logprobs(sequences):
    return [torch.full((len(s) - 1,), -1.0) for s in sequences]


def toy_run(broken: str | None, fault=lambda t: t * 3):
    actor = {n: float(i + 1) for i, n in enumerate(NAMES)}
    correct = lambda: ((n, torch.tensor(v)) for n, v in actor.items())  # noqa: E731
    synced = lambda: ((n, fault(t) if n == broken else t) for n, t in correct())  # noqa: E731
    engine = ToyEngine(actor)
    engine.update_weights(synced())  # the step's sync
    check = SyncCheck(first_syncs=1, every_n_steps=0, threshold=1e-3, probe_prompts=2, device=torch.device("cpu"))
    check.set_probe(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.ones(2, 3, dtype=torch.long))
    return engine, lambda: check.run(7, engine=engine, actor_logprobs=actor_logprobs, synced_weights=synced,
                                     actor_weights=correct, names=NAMES)


def test_a_clean_sync_passes_and_reports_the_difference():
    engine, run = toy_run(None)
    metrics = run()
    assert metrics["rollout/sync_check/logprob_diff_mean"] == 0.0
    assert metrics["rollout/sync_check/logprob_diff_max"] == 0.0
    assert engine.syncs == 1  # no re-sync when the check passes


def test_a_tensor_sent_wrong_stops_the_run_naming_it_and_the_step():
    engine, run = toy_run(NAMES[11])
    with pytest.raises(SyncMismatch) as caught:
        run()
    message = str(caught.value)
    assert isinstance(caught.value, TrainingStopped)  # exit code 1: stopped by policy
    assert "\n" not in message
    assert "at step 7" in message and f"names {NAMES[11]} " in message and f"{KEY}.enable=False" in message
    assert "differ from the actor's by 24 nats" in message  # |3 * 12 - 12|, on every probe token
    # the step's sync + two controls + log2(16) halvings + the confirmation
    assert engine.syncs == 1 + 2 + 4 + 1


def test_a_fault_in_the_engine_is_not_blamed_on_a_tensor():
    engine, run = toy_run(None)
    engine.prompt_logprobs = lambda seqs: [torch.full((len(s) - 1,), -2.0) for s in seqs]  # a wrong forward
    with pytest.raises(SyncMismatch, match="not one tensor's values but the engine's loader or forward"):
        run()


def test_a_sync_lost_once_is_reported_as_such():
    engine, run = toy_run(None)
    engine.weights[NAMES[0]] = 0.0  # the step's sync lost a tensor; a second sync delivers it
    with pytest.raises(SyncMismatch, match="a second sync of the same weights cleared it"):
        run()


def test_hf_prompt_logprobs_match_an_unpadded_reference(tiny_hf, tiny_tokenizer):
    from grpo_npu.rollout.hf_rollout import HFRollout

    rollout = HFRollout(tiny_hf, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_ids=[tiny_tokenizer.eos_token_id])
    sequences = [tiny_tokenizer(text)["input_ids"] for text in ("What is 12 + 7?", "7 * 8 = 56, so the answer is")]
    assert len(set(map(len, sequences))) == 2  # rows of different lengths: the shorter one is padded
    got = rollout.prompt_logprobs(sequences)
    for seq, logp in zip(sequences, got):
        with torch.no_grad():
            logits = tiny_hf(torch.tensor([seq])).logits[0].float()  # (L, V)
        want = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)


def test_prompts_all_too_short_to_teacher_force_say_how_to_turn_the_check_off():
    check = SyncCheck(first_syncs=1, every_n_steps=0, threshold=1.0, probe_prompts=2, device=torch.device("cpu"))
    ids = torch.tensor([[0, 5], [0, 9]])
    with pytest.raises(ValueError, match=rf"^{KEY}: every prompt has fewer than 2 tokens, so none can be teacher-forced; "
                                         rf"turn the check off \({KEY}\.enable=False\)$"):
        check.set_probe(ids, (ids > 0).long())
