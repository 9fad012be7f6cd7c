"""The plan for one batch under its settings: one space searched for the budget, or with
``checkpoint_policy="auto"`` the faster of the plans under "full" and "save_matmuls", from one
baseline step."""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from lightmem.estimate.planning.result import Plan, PlanOption
from lightmem.estimate.planning.space import PlanSpace, space_for
from lightmem.estimate.settings import AUTO_POLICY, EstimateSettings
from lightmem.estimate.trace.errors import EstimateError
from lightmem.estimate.trace.step import as_traced_in_full
from lightmem.estimate.words import policy_name


def planned(
    model: nn.Module, batch: Any, settings: EstimateSettings, *, batch_size: int | None = None,
    sequence: tuple[int, int, int] | None = None, started: float,
) -> tuple[Plan, PlanSpace]:  # fmt: skip
    """The plan for ``settings.budget_bytes`` (``AUTO_POLICY``: under either policy) and the space it
    was found in; its ``seconds`` count from ``started``."""
    if isinstance(settings.checkpoint_policy, str) and settings.checkpoint_policy == AUTO_POLICY:
        return plan_either_policy(model, batch, settings, batch_size=batch_size, sequence=sequence, started=started)
    space = space_for(model, batch, settings, batch_size=batch_size, sequence=sequence)
    return plan_in(space, started), space


def plan_in(space: PlanSpace, started: float, other: Plan | None = None) -> Plan:
    """``space``'s plan for its budget (``other``: as for ``PlanSpace.plan``)."""
    assert space.settings.budget_bytes is not None
    result = space.plan(space.settings.budget_bytes, other=other)
    result.seconds = time.perf_counter() - started
    return result


def plan_either_policy(
    model: nn.Module, batch: Any, settings: EstimateSettings, *, batch_size: int | None,
    sequence: tuple[int, int, int] | None = None, started: float,
) -> tuple[Plan, PlanSpace]:  # fmt: skip
    """The faster of the plans under the "full" and "save_matmuls" policies. The second is searched
    only when the first fits and checkpoints: where it re-runs nothing the policy changes nothing,
    and where nothing fits under "full" nothing fits under "save_matmuls" (its checkpointed blocks
    keep their inputs and more, on the device); and then only along the walks that re-run
    something, where they could beat the first.

    One baseline step serves both: traced under "save_matmuls" (whose per-op decisions it counts),
    it is the "full" baseline without them (``as_traced_in_full``). Returns the plan and the space it
    was found in."""
    matmuls_space = space_for(model, batch, settings.with_policy("save_matmuls"), batch_size=batch_size, sequence=sequence)
    full_space = space_for(
        model, batch, settings.with_policy("full"), batch_size=batch_size, sequence=sequence,
        baseline=as_traced_in_full(matmuls_space.baseline),
    )  # fmt: skip
    full = plan_in(full_space, started)
    # Nothing to gain from "save_matmuls" where "full" re-runs nothing; and where nothing fits under
    # "full", nothing fits under it either (a checkpointed block keeps at least its inputs on top).
    if not full.fits or not full.checkpoint:
        full.seconds = time.perf_counter() - started
        return full, full_space
    try:
        matmuls = plan_in(matmuls_space, started, other=full)
    except EstimateError:
        # A step torch's selective checkpointing refuses (a backward through a block twice, with
        # retain_graph) runs under "full" only: a configuration the dry run cannot run is no candidate.
        full.seconds = time.perf_counter() - started
        return full, full_space
    chosen, other = (matmuls, full) if better(matmuls, full) else (full, matmuls)
    if other.fits:
        chosen.alternatives = [
            PlanOption(
                f"{other.family or 'plan'} with checkpoint_policy={policy_name(other.checkpoint_policy)!r}: "
                + ("; ".join(other.parts()) or "nothing"),
                True, other.predicted_total_bytes, other.recompute_s, other.exposed_transfer_s, other.step_seconds,
            ),
            *chosen.alternatives,
        ]
    chosen.evaluations += other.evaluations
    chosen.seconds = time.perf_counter() - started
    return chosen, matmuls_space if chosen is matmuls else full_space


def better(candidate: Plan, than: Plan) -> bool:
    """A plan that fits beats one that does not; among those that fit, the faster one."""
    if candidate.fits != than.fits:
        return candidate.fits
    return candidate.fits and candidate.step_seconds < than.step_seconds
