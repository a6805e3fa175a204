"""actor.mask_truncated_completions: a response cut at the length limit (stop_reason 'length') weighs nothing in
the policy, KL and entropy losses, exactly as if its row were not in the batch (TRL's mask_truncated_completions).

The reference is the same update run on the batch without the truncated rows.
"""

from __future__ import annotations

import pytest
import torch

from .helpers import full_weights, make_batch, make_cfg, make_worker, max_abs_diff

pytestmark = pytest.mark.usefixtures("process_group")

TRUNCATED = (2, 5)  # rows the engine stopped at the length limit


def _batch(model_path: str):
    """8 responses with old and reference log-probs of the initial policy, two of them truncated."""
    batch = make_batch(seed=11, empty_row=None)
    worker = make_worker(make_cfg(model_path))
    logp, _ = worker.actor.log_probs(batch, micro_size=8, max_tokens=None, with_entropy=False)
    stop = ["length" if i in TRUNCATED else "stop" for i in range(len(batch))]
    return batch.replace(old_logp=logp, ref_logp=logp - 0.1 * batch.response_mask, stop_reason=stop)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_truncated_rows_weigh_as_if_absent_but_count_as_responses(tiny_model_path, agg):
    """token-mean: the update on the batch without those rows. The seq-mean modes still divide by every response of
    the mini-batch (verl's global_batch_size; TRL's grpo loss, a mean over all completions), so their losses and
    gradient are the reference's times kept / all rows, and AdamW's first step, scale-free, moves the weights alike."""
    share = 1.0 if agg == "token-mean" else 1 - len(TRUNCATED) / 8
    batch = _batch(tiny_model_path)
    kept = [i for i in range(len(batch)) if i not in TRUNCATED]
    common = (f"actor_rollout_ref.actor.loss_agg_mode={agg}", "actor_rollout_ref.actor.use_kl_loss=True",
              "actor_rollout_ref.actor.kl_loss_type=mse", "actor_rollout_ref.actor.entropy_coeff=0.01",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    runs = {}
    for name, data, mask_on in (("masked", batch, True), ("reference", batch.select(kept), False),
                                ("unmasked", batch, False)):
        worker = make_worker(make_cfg(tiny_model_path, *common,
                                      f"actor_rollout_ref.actor.mask_truncated_completions={mask_on}"))
        metrics = worker.update_actor(data)
        runs[name] = (metrics, full_weights(worker.actor.module.hf))
    masked, reference, unmasked = runs["masked"], runs["reference"], runs["unmasked"]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm"):
        assert masked[0][key] == pytest.approx(reference[0][key] * share, rel=1e-5, abs=1e-7), key
    assert masked[0]["actor/pg_clipfrac"] == pytest.approx(reference[0]["actor/pg_clipfrac"], rel=1e-5, abs=1e-7)
    assert max_abs_diff(masked[1], reference[1]) < (1e-7 if share == 1.0 else 1e-6)
    # without the option the truncated rows count (the comparison above can fail)
    assert unmasked[0]["actor/pg_loss"] != pytest.approx(reference[0]["actor/pg_loss"], rel=1e-3)
    assert masked[0]["response_length/truncated_masked_frac"] == pytest.approx(len(TRUNCATED) / len(batch))
    assert "response_length/truncated_masked_frac" not in unmasked[0]


def test_loss_mask_and_missing_stop_reasons(tiny_model_path):
    worker = make_worker(make_cfg(tiny_model_path, "actor_rollout_ref.actor.mask_truncated_completions=True"))
    batch = make_batch(seed=1, empty_row=None)
    stop = ["length" if i in TRUNCATED else "stop" for i in range(len(batch))]
    mask = worker.actor.loss_tokens(batch.replace(stop_reason=stop))
    expected = batch.response_mask.clone()
    expected[list(TRUNCATED)] = 0
    assert torch.equal(mask, expected)
    with pytest.raises(ValueError, match="mask_truncated_completions=True needs each response's stop_reason"):
        worker.actor.loss_tokens(batch)
