"""agg_loss against a loop reference, and micro-batch invariance with global counts."""

from __future__ import annotations

import pytest
import torch

from grpo_npu.algo import losses
from grpo_npu.algo.names import POLICY_LOSS_MODES, POLICY_LOSS_PARAMS, POLICY_LOSS_READS

MODES = list(losses.AGG_MODES)


def ref_agg(loss, mask, mode, *, num_tokens=None, num_seqs=None, horizon=None):
    """Loops over rows and tokens in Python floats."""
    rows = [[float(loss[i, t]) for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    total = sum(sum(r) for r in rows)
    num_tokens = sum(len(r) for r in rows) if num_tokens is None else num_tokens
    num_seqs = sum(1 for r in rows if r) if num_seqs is None else num_seqs
    horizon = mask.shape[1] if horizon is None else horizon
    if mode == "token-sum":
        return total
    if mode == "token-mean":
        return total / max(num_tokens, 1)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / max(num_seqs, 1)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / max(num_seqs, 1)
    return total / (max(num_seqs, 1) * horizon)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (7, 5), (16, 11)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agg_loss_matches_reference(batch_kit, mode, shape, dtype):
    random_mask, _ = batch_kit
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    mask = random_mask(*shape, gen)
    loss = torch.randn(shape, generator=gen).to(dtype)
    loss[~mask] = float("nan")  # padding is never read
    got = losses.agg_loss(loss, mask, mode)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert float(got) == pytest.approx(ref_agg(loss, mask, mode), rel=1e-5, abs=1e-6)
    # explicit global counts and horizon
    kwargs = dict(num_tokens=37, num_seqs=9, horizon=20)
    got = losses.agg_loss(loss, mask, mode, **kwargs)
    assert float(got) == pytest.approx(ref_agg(loss, mask, mode, **kwargs), rel=1e-5, abs=1e-6)
    got = losses.agg_loss(loss, mask, mode, num_tokens=torch.tensor(37), num_seqs=torch.tensor(9), horizon=20)
    assert float(got) == pytest.approx(ref_agg(loss, mask, mode, **kwargs), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_without_global_counts_fully_masked_rows_are_not_sequences(mode):
    """verl's agg_loss without global_batch_size: seq_mask.sum() counts the rows with a valid token."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    alone = losses.agg_loss(loss[:1], mask[:1], mode)
    with_empty_row = losses.agg_loss(loss, mask, mode)
    torch.testing.assert_close(with_empty_row, alone)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 1.0), ("token-sum", 2.0), ("seq-mean-token-sum", 1.0), ("seq-mean-token-mean", 0.5),
    ("seq-mean-token-sum-norm", 0.5),
])
def test_global_counts_take_every_row_as_a_sequence(mode, expected):
    """The workers' counts: a row whose tokens rollout correction all rejected still counts, as verl 0.9.1 divides
    the seq-mean modes by global_batch_size = ppo_mini_batch_size x n (its numbers: 0.5 / 1.0 / 0.5)."""
    loss = torch.tensor([[1.0, 1.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    num_tokens, num_seqs = losses.agg_counts(mask)
    assert int(num_tokens) == 2 and int(num_seqs) == 2
    got = losses.agg_loss(loss, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=2)
    assert float(got) == pytest.approx(expected)


def test_all_masked_batch_gives_zero():
    loss = torch.ones(3, 4, requires_grad=True)
    for mode in MODES:
        out = losses.agg_loss(loss, torch.zeros(3, 4), mode)
        assert float(out.detach()) == 0.0
        out.backward()
        assert torch.equal(loss.grad, torch.zeros(3, 4))


def test_seq_mean_token_sum_norm_rounds_as_verl():
    """float32: sum of row sums / num_seqs, then / horizon, in verl agg_loss's order, bit for bit.

    Dividing each row by the horizon first gives -0.08556167 instead of -0.08556168 on this batch.
    """
    loss = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(5, 7, dtype=torch.bool)
    verl_order = loss.sum(-1).sum() / torch.tensor(5.0) / 7
    assert torch.equal(losses.agg_loss(loss, mask, "seq-mean-token-sum-norm"), verl_order)


def test_agg_loss_errors():
    loss = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="actor.loss_agg_mode: unknown value 'seq-mean'; known: token-mean, token-sum"):
        losses.agg_loss(loss, torch.ones(2, 3), "seq-mean")
    with pytest.raises(ValueError, match=r"equal \(B, T\) shapes"):
        losses.agg_loss(loss, torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match="max_response_length"):
        losses.agg_loss(loss, torch.ones(2, 3), "seq-mean-token-sum-norm", horizon=0)


# ------------------------------------------------------------------------------------------------
# Micro-batch invariance: sum over micro-batches with global counts == the whole mini-batch
# ------------------------------------------------------------------------------------------------
def _split_rows(batch: int, parts: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Row index sets of ``parts`` micro-batches over a shuffled batch (uneven sizes allowed)."""
    order = torch.randperm(batch, generator=gen)
    return list(torch.tensor_split(order, parts))


def _trim(mask: torch.Tensor) -> int:
    """Width of a micro-batch trimmed to its longest response (at least 1)."""
    lengths = mask.long().cumsum(-1).argmax(-1) + 1
    return max(1, int(lengths.max())) if mask.any() else 1


def _invariance_check(build_loss, params: torch.Tensor, mask: torch.Tensor, mode: str, gen: torch.Generator):
    """build_loss(rows, width, **agg_kwargs) -> scalar loss of those rows; compares 1 vs 2/4/8 micro-batches."""
    batch, width = mask.shape
    num_tokens, num_seqs = losses.agg_counts(mask)
    full = build_loss(torch.arange(batch), width, num_tokens=num_tokens, num_seqs=num_seqs, horizon=width)
    (full_grad,) = torch.autograd.grad(full, params)
    for parts in (1, 2, 4, 8):
        micro = _split_rows(batch, parts, gen)
        # the trainer all-reduces the local counts of every micro-batch (and rank) into global ones
        counts = [losses.agg_counts(mask[rows]) for rows in micro]
        global_tokens = sum(c[0] for c in counts)
        global_seqs = sum(c[1] for c in counts)
        total = sum(
            build_loss(rows, _trim(mask[rows]), num_tokens=global_tokens, num_seqs=global_seqs, horizon=width)
            for rows in micro
        )
        (grad,) = torch.autograd.grad(total, params)
        torch.testing.assert_close(total, full, rtol=1e-6, atol=1e-6, msg=f"{mode}: loss differs with {parts} micro-batches")
        torch.testing.assert_close(grad, full_grad, rtol=1e-6, atol=1e-6, msg=f"{mode}: grads differ with {parts} micro-batches")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_agg_loss_micro_batch_invariance(batch_kit, mode, seed):
    random_mask, _ = batch_kit
    gen = torch.Generator().manual_seed(seed)
    batch, width = 24, 9
    mask = random_mask(batch, width, gen)
    params = torch.randn(batch, width, generator=gen, requires_grad=True)

    def build_loss(rows, trimmed, **agg_kwargs):
        per_token = torch.tanh(params[rows, :trimmed]) * params[rows, :trimmed] ** 2  # any nonlinear loss
        return losses.agg_loss(per_token, mask[rows, :trimmed], mode, **agg_kwargs)

    _invariance_check(build_loss, params, mask, mode, gen)


# Clip-Cov and KL-Cov pick their tokens within each micro-batch (verl's), so they depend on the micro-batching.
MICRO_BATCH_DEPENDENT = ("clip_cov", "kl_cov")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_name", [m for m in POLICY_LOSS_MODES if m not in MICRO_BATCH_DEPENDENT])
def test_policy_loss_micro_batch_invariance(batch_kit, mode, loss_name):
    random_mask, _ = batch_kit
    gen = torch.Generator().manual_seed(7)
    batch, width = 16, 10
    mask = random_mask(batch, width, gen)
    logp = (-torch.rand(batch, width, generator=gen) * 3).requires_grad_(True)
    old_logp = logp.detach() + torch.randn(batch, width, generator=gen) * 0.3
    advantages = torch.randn(batch, 1, generator=gen).expand(batch, width).contiguous()
    loss_fn = losses.get_policy_loss_fn(loss_name)
    given = {"clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.5, "dro_beta": 0.2}
    settings = {POLICY_LOSS_PARAMS[k]: given[POLICY_LOSS_PARAMS[k]] for k in POLICY_LOSS_READS[loss_name]}

    def build_loss(rows, trimmed, **agg_kwargs):
        cols = slice(0, trimmed)
        loss, _ = loss_fn(
            logp[rows, cols], old_logp[rows, cols], advantages[rows, cols], mask[rows, cols],
            agg_mode=mode, **settings, **agg_kwargs,
        )
        return loss

    _invariance_check(build_loss, logp, mask, mode, gen)
