"""The end-of-run advice: fewer, larger passes, said only for a model pass far from its limit on an accelerator."""

from __future__ import annotations

import pytest

from grpo_npu.perf.advice import FAR, Passes, passes_advice
from grpo_npu.perf.report import PhaseCost, PhaseTotal, StepReport, ranked_phases

UPDATE = Passes(64, 4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 16,
                alternative="actor_rollout_ref.actor.use_dynamic_bsz=True")


def ranked(update_s: float, gen_s: float = 0.011) -> list[PhaseTotal]:
    """One step: the update with a 0.03 s floor, generation with a 0.01 s one."""
    return ranked_phases([StepReport(update_s + gen_s, {"update_actor": PhaseCost(update_s, 0.03, "compute"),
                                                        "gen": PhaseCost(gen_s, 0.01, "roofline")}, {})])


def test_a_slow_pass_on_an_accelerator_names_its_key_value_and_pass_count():
    line = passes_advice(ranked(0.87), {"update_actor": UPDATE}, accelerator=True, peak_gb=12.34, capacity_gb=79.2)
    assert line == ("perf: to try: update_actor runs at 3% of its limit in 4 passes per 64-row batch "
                    "(actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 rows per pass); on an accelerator such "
                    "passes are bound by launching their kernels, whatever their size: fewer, larger ones (raise "
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, or actor_rollout_ref.actor.use_dynamic_bsz=True) "
                    "as memory allows (peak allocated 12.3 of 79.2 GiB)")
    packed = Passes(64, 3, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 4096, packed=True)
    line = passes_advice(ranked(0.87), {"update_actor": packed}, accelerator=True)
    assert "(actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096 tokens per pass)" in line
    assert "(raise actor_rollout_ref.actor.ppo_max_token_len_per_gpu) as memory allows" in line
    assert line.endswith("as memory allows")  # no memory reading, none claimed


@pytest.mark.parametrize("why, accelerator, passes, update_s, gen_s", [
    ("a CPU", False, UPDATE, 0.87, 0.011),
    ("at the threshold", True, UPDATE, 0.03 / FAR, 0.011),
    ("one pass already", True, Passes(64, 1, "k", 64), 0.87, 0.011),
    ("gen is further from its limit", True, UPDATE, 0.87, 2.0),
])
def test_nothing_is_advised_where_fewer_passes_are_not_the_suspect(why, accelerator, passes, update_s, gen_s):
    totals = ranked(update_s, gen_s)
    assert totals[0].name == ("gen" if gen_s > 1 else "update_actor"), why
    assert passes_advice(totals, {"update_actor": passes}, accelerator=accelerator) == "", why
    if why == "at the threshold":  # just under it, the same run is advised
        assert passes_advice(ranked(update_s * 1.01), {"update_actor": passes}, accelerator=True)


def test_a_phase_without_a_floor_gets_no_advice():
    totals = ranked_phases([StepReport(1.0, {"update_actor": PhaseCost(0.9)}, {})])
    assert passes_advice(totals, {"update_actor": UPDATE}, accelerator=True) == ""
    assert passes_advice([], {"update_actor": UPDATE}, accelerator=True) == ""
