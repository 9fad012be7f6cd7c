"""``LightMem(plan="auto")`` trains each mixture of experts (``moe_models``) within its worst-case
routing: with a device budget between the balanced peak and the bound, the plan checkpoints until
the bound fits, and the fit trains through balanced and skewed batches (issue 57)."""

from __future__ import annotations

import logging

import moe_models
import pytest
import pytorch_lightning as pl
from lit_models import cpu_trainer

from lightmem import LightMem, estimate_memory, plan
from lightmem.auto_plan import TIMED_STEPS, AutoPlan
from lightmem.estimate.trace.batch import batch_shapes
from lightmem.testing.device import SimulatedDeviceMemory

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")


@pytest.mark.parametrize("family", moe_models.FAMILIES)
def test_a_budget_under_the_worst_case_routing_makes_the_plan_checkpoint_until_the_bound_fits(family, caplog):
    module = moe_models.lightning_module(family, pl)
    est = estimate_memory(module, moe_models.batch_of(family, moe_models.balanced_ids()), device="cpu")
    budget = (est.peak_bytes + est.routing_bound_bytes) // 2  # the balanced step fits, its bound does not
    callback = LightMem(plan="auto", device_budget=budget)
    trainer = cpu_trainer([callback], pl, max_steps=3)
    with caplog.at_level(logging.INFO):
        trainer.fit(module, moe_models.loader(family))
    chosen = callback.chosen_plan
    assert trainer.global_step == 3  # two balanced batches and a skewed one
    assert chosen.fits and chosen.checkpoint
    assert chosen.predicted_reserved_bytes < chosen.routing_bound_bytes == chosen.predicted_total_bytes <= budget
    said = [record.getMessage() for record in caplog.records if record.getMessage().startswith("lightmem: plan for")]
    assert len(said) == 1 and "(reserved, overhead allowance included, under the worst-case routing of its experts)" in said[0]


# -- held to the bound on a device (simulated) ----------------------------------------------------


def _routed_plan_steps(reserved_bytes) -> AutoPlan:
    """A routed plan's first steps on a simulated device, each reserving ``reserved_bytes(plan)``."""
    model, batch = moe_models.build("by_hand"), moe_models.batch_of("by_hand", moe_models.balanced_ids())
    est = estimate_memory(model, batch, moe_models.loss_fn("by_hand"), device="cpu")
    budget = (est.peak_bytes + est.routing_bound_bytes) // 2
    chosen = plan(model, batch, budget, moe_models.loss_fn("by_hand"), device="cpu")
    assert chosen.checkpoint and chosen.predicted_reserved_bytes < chosen.routing_bound_bytes
    device = SimulatedDeviceMemory(budget)
    auto_plan = AutoPlan(budget, device)
    auto_plan.take(chosen, batch_shapes(batch))
    for step in range(TIMED_STEPS + 1):
        auto_plan.batch_start()
        device.peak_bytes = device.reserved_peak_bytes = reserved_bytes(chosen)
        auto_plan.check(step, batch)
    return auto_plan


def test_a_routed_plan_whose_steps_reach_past_the_balanced_peak_within_the_bound_is_not_planned_tighter():
    auto_plan = _routed_plan_steps(lambda chosen: chosen.routing_bound_bytes)
    assert auto_plan.predicted_reserved_bytes == auto_plan.plan.routing_bound_bytes
    assert auto_plan.replan_reason is None and auto_plan.tighter_by_bytes == 0


def test_a_routed_plan_whose_steps_stay_well_under_the_bound_gives_no_room_back():
    # Balanced batches so far: a later one may route as unevenly as the bound assumes.
    auto_plan = _routed_plan_steps(lambda chosen: int(0.6 * chosen.routing_bound_bytes))
    assert auto_plan.replan_reason is None and auto_plan.looser_by_bytes == 0
