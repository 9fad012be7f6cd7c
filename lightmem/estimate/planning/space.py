"""``plan``: the fastest lightmem configuration that fits a memory budget.

The space: checkpointing any set of the repeated layers, offloading the saved tensors of any set
of blocks, and offloading every saved tensor of at least ``min_bytes`` anywhere in the model
(the stem of a CNN, an LM's embedding output and head input included), alone or with any set
of checkpointed layers. The space is too large to verify point by point, so it is walked as
four nested sequences ("families"), each from one cheap step to its extreme:

- ``checkpoint``: repeated layers checkpointed one by one, cheapest re-run per byte first;
- ``offload``: offload alone, block by block (a block's largest saved tensors or all of them),
  cheapest per byte first, ending with every saved tensor of at least ``min_bytes`` anywhere;
- ``per block``: per-block actions (offload any block, checkpoint or checkpoint + offload a
  repeated layer), cheapest per byte first, ending with every layer both and every block offloaded;
- ``offload everywhere``: every saved tensor offloaded, then repeated layers checkpointed too.

Predictions (the bytes each action saves) only order a family and say where to start looking.
Whether a configuration fits is decided by the estimator's verified fake step, never by the
prediction: from the first configuration whose predicted savings cover the need, verified steps
gallop down while it fits or up (to the family's extreme) until it does, then bisect, which finds
the first configuration that fits. Among it and every configuration after it, and across
families, the one with the least predicted step time (:mod:`lightmem.estimate.step_time`) is
chosen, verified before it is taken. So whenever a family's extreme fits (every repeated layer
checkpointed, with or without offload) or offload alone fits, the plan fits, at a verified peak
within the budget.

A mixture of experts whose sizes follow its routing is verified twice per configuration (the
estimator's balanced step and its worst-case routing, ``StepTrace.routing_bound``): what must fit
the budget is the worst case, while the plan's predicted step time stays the balanced step's.

Model-state offload (``offload_optimizer``: gradients and optimizer state on the host) is decided
once, before the walks: on when asked for, or when parameters + gradients + optimizer state leave
no room but the parameters alone do. Then every verified step runs with it, the baseline that
decides "already fits" is its step, and its link time (``model_state_transfer_s``) is added to
every configuration's exposed transfer.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import (
    OffloadSettings,
    OptimizerOffloadSettings,
    format_bytes,
)
from lightmem.config.estimator import parse_offload, parse_planned_offload
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.assemble import build_report
from lightmem.estimate.device.caching_allocator import Reserve
from lightmem.estimate.device.run import RoutingBound
from lightmem.estimate.planning.families import KINDS, Candidate, Family, build_families, preference
from lightmem.estimate.planning.result import Plan, PlanOption
from lightmem.estimate.pricing.costs import Costs, costs_for, partial_thresholds, sized_windows
from lightmem.estimate.pricing.timeline import StepTime, compute_s, configuration_time
from lightmem.estimate.report import MemoryEstimate
from lightmem.estimate.settings import EstimateSettings, parse_settings
from lightmem.estimate.steps import run_configuration, step_memory_key
from lightmem.estimate.trace.batch import BatchInfo, inspect_batch
from lightmem.estimate.trace.step import StepTrace
from lightmem.estimate.words import compact_names, dominant_part, natural_order, policy_name

_TRIES_PAST_FIRST_FIT = 3
"""Cheaper candidates verified past a family's first fit before settling on that fit."""


def model_state_transfer_s(link_bytes: int, costs: Costs) -> float:
    """Model-state offload's link time per step: ``link_bytes`` (each gradient out and each
    parameter back, in the device's dtype: the estimator's ``model_state_link_bytes``), priced as
    not hidden by compute: an upper bound on what it exposes."""
    return link_bytes / costs.link_bytes_per_s


def allocated_need(peak_bytes: int, reserved_bytes: int, available_bytes: int) -> int:
    """The allocated bytes a step whose allocated peak is ``peak_bytes`` and reserved peak
    ``reserved_bytes`` must lose to fit ``available_bytes``: the reserved overshoot, in allocated
    bytes (the allocator's share taken as the step's own)."""
    return max(0, (reserved_bytes - available_bytes) * peak_bytes // max(reserved_bytes, 1))


@dataclass(frozen=True)
class Verified:
    """A candidate's fake step: its peak, the host memory its offload holds, (with model-state
    offload) the bytes that moves over the link per step, the bytes each block sent to host, and
    what dominated its peak (for the no-fit message)."""

    peak_bytes: int
    host_bytes: int
    link_bytes: int = 0
    moved: tuple[tuple[str, int], ...] = ()
    dominant: str = ""
    reserve: Reserve | None = field(default=None, compare=False, repr=False)
    """What the allocator must be able to reserve for the step (``StepTrace.reserve``; None: the peak)."""
    routing_bound: RoutingBound | None = field(default=None, compare=False, repr=False)
    """For a mixture-of-experts step: the step under the worst-case routing (``StepTrace.routing_bound``),
    which must fit too; None: the step routes nothing."""


_VERIFIED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], Verified]] = weakref.WeakKeyDictionary()
"""Verified steps by model, kept across calls: the configuration, batch and every setting that decides
what a fake step allocates (``_step_key``), never the prices. A re-plan of ``LightMem(plan="auto")``
for the same batches at new prices, the second checkpoint policy of ``checkpoint_policy="auto"`` (for
the configurations that re-run nothing) and ``max_batch_size(plan=True)``'s plan at the size it found
verify nothing twice."""


class PlanSpace:
    """The planner's space for one model, batch and settings; ``plan(budget)`` searches it.

    Verified steps are remembered by configuration (``_VERIFIED``: across spaces of the same model,
    batch and settings too), so asking for several budgets (or the same budget twice) runs each
    configuration's fake step once.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        settings: EstimateSettings,
        info: BatchInfo,
        base: MemoryEstimate,
        costs: Costs,
        *,
        offload: OffloadSettings | None = None,
        batch_size: int | None = None,
        baseline: StepTrace | None = None,
    ) -> None:
        self.model, self.batch, self.settings, self.info = model, batch, settings, info
        self.base, self.costs, self.batch_size, self.baseline = base, costs, batch_size, baseline
        self.searched_offload = offload
        """The offload settings the search runs under (None: lightmem's defaults)."""
        self.offload = offload if offload is not None else parse_offload(True, flag="plan(offload=...)")
        assert self.offload is not None
        self.families = build_families(base.blocks, costs)
        self.verified: dict[tuple[Candidate, bool], Verified] = {}
        """Verified steps by candidate and whether model state was offloaded."""
        self.traced = 0
        """Fake steps this space ran (verified steps found in ``_VERIFIED`` are not run again)."""
        self._memory_key = step_memory_key(model, batch, settings, batch_size)

    def _step_key(self, candidate: Candidate, model_state: bool) -> tuple[Any, ...]:
        """What decides the candidate's fake step: the space's memory key, the candidate, its offload
        settings (windows included) and, when it checkpoints, the policy."""
        offload = candidate.offload_settings(self.offload)
        policy = policy_name(self.settings.checkpoint_policy) if candidate.checkpoint else None
        return (self._memory_key, candidate, model_state, repr(offload.to_dict()) if offload is not None else None, policy)

    def verify(self, candidate: Candidate, model_state: bool = False) -> Verified:
        """The candidate's fake step, with model-state offload when ``model_state`` (run once per
        candidate and choice)."""
        found = self.verified.get((candidate, model_state))
        remembered = _VERIFIED.setdefault(self.model, {})
        key = self._step_key(candidate, model_state) if found is None else None
        if key is not None and key in remembered:
            found = self.verified[(candidate, model_state)] = remembered[key]
        if found is None:
            self.traced += 1
            trace = run_configuration(
                self.model, self.batch, self.settings, info=self.info, batch_size=self.batch_size,
                checkpoint=tuple(candidate.checkpoint_names()) or None,
                offload=candidate.offload_settings(self.offload), offload_optimizer=model_state,
            )  # fmt: skip
            found = Verified(
                trace.peak.bytes, trace.host_bytes, trace.optimizer_link_bytes,
                tuple(trace.offloaded_by_block.items()), dominant_part(trace), trace.reserve, trace.routing_bound,
            )  # fmt: skip
            self.verified[(candidate, model_state)] = remembered[key] = found
        return found

    def model_state_step(self) -> Verified:
        """The baseline step with model-state offload (no activation technique): its peak and the
        bytes that offload moves over the link per step."""
        named = self.base.scenarios.get("offload_optimizer")
        if named is not None:  # run with the report, at the space's batch size
            return Verified(
                named.peak_bytes, named.host_bytes, named.model_state_link_bytes,
                reserve=named.reserve, routing_bound=named.routing_bound,
            )
        return self.verify(Candidate(), model_state=True)

    def reserved(self, verified: Verified) -> int:
        """What the allocator must be able to reserve for a verified step: what must fit the budget
        (for a mixture-of-experts step, its worst-case routing's where that is higher)."""
        reserved = verified.reserve.bytes if verified.reserve is not None else verified.peak_bytes
        bound = verified.routing_bound
        return reserved if bound is None else max(reserved, bound.reserved_bytes)

    def fits(self, verified: Verified, available: int) -> bool:
        """Whether a verified step runs with ``available`` bytes reservable (one replay, not the bisection
        ``reserved`` runs), under the worst-case routing too for a mixture-of-experts step."""
        fits = verified.reserve.fits(available) if verified.reserve is not None else verified.peak_bytes <= available
        bound = verified.routing_bound
        return fits and (bound is None or bound.reserve.fits(available))

    def describe(self, candidate: Candidate) -> str:
        """The candidate in words: "checkpoint layer1.0-2 (Bottleneck) + offload every saved tensor ..."."""
        return _describe(candidate, self.base.block_kinds, self.costs.min_bytes)

    def extremes(self) -> list[Candidate]:
        """The configurations that save the most in each family, and offload alone: what
        completeness is promised for."""
        found = [family.candidates[-1] for family in self.families]
        found += [family.candidates[0] for family in self.families if family.starts_with_offload_alone]
        return list(dict.fromkeys(found))

    def _first_fit(self, family: Family, available: int, need: int, model_state: bool = False) -> int | None:
        """The first candidate of ``family`` that fits, searched with verified steps from the
        first one whose predicted savings cover ``need``: galloping (1, 2, 4 ... steps) down
        while it fits or up until it does, then bisecting. Fitting is taken to be monotone
        along a family (a longer prefix saves more), so two or three steps usually settle it;
        when nothing up to the extreme fits, None.

        Along "offload everywhere" fitting can go the other way (checkpointing on top of
        offload raises the peak when a re-run materialises a large block in backward): when
        nothing after the start fits, the start itself (offload alone) is the answer if it fits.
        """
        fits = lambda index: self.fits(self.verify(family.candidates[index], model_state), available)  # noqa: E731
        last = len(family.candidates) - 1
        guess = family.guess(need)
        step = 1
        if fits(guess):
            low, high = -1, guess  # low: taken not to fit (the baseline does not); high: fits
            while high - step > low:
                if not fits(high - step):
                    low = high - step
                    break
                high, step = high - step, step * 2
        else:
            low, high = guess, None
            while low < last:
                probe = min(low + step, last)
                if fits(probe):
                    high = probe
                    break
                low, step = probe, step * 2
            if high is None:
                return 0 if family.starts_with_offload_alone and fits(0) else None
        while high - low > 1:
            probe = (low + high) // 2
            low, high = (low, probe) if fits(probe) else (probe, high)
        return high

    def plan(self, budget_bytes: int, other: Plan | None = None) -> Plan:
        """The fastest verified configuration within ``budget_bytes`` (overhead allowance included).

        ``other``: the plan under the other checkpoint policy (``checkpoint_policy="auto"``). Only
        what this policy changes is searched (walks that re-run something), only along walks
        predicted to reach the need, and, when ``other`` fits, only where they could be faster.
        (A per-op policy keeps more than "full" in every checkpointed block, so where "full"'s
        walks do not fit, its own are not expected to.)"""
        settings, base, costs = self.settings, self.base, self.costs
        # What must fit is what the allocator reserves for a verified (allocated) peak.
        available = budget_bytes - settings.overhead_bytes
        baseline_peak = base.scenarios["baseline"].peak_bytes
        baseline_reserved = base.scenarios["baseline"].predicted_reserved
        baseline_bound = base.scenarios["baseline"].routing_bound
        baseline_s = compute_s(base.blocks, costs)
        result = Plan(
            [], None, baseline_peak, settings.overhead_bytes, budget_bytes, False, "", estimate=base,
            checkpoint_policy=settings.checkpoint_policy, flops_per_s=costs.flops_per_s,
            link_bytes_per_s=costs.link_bytes_per_s, settings=_searched_under(settings, costs, self.searched_offload),
            step_seconds=baseline_s, baseline_step_seconds=baseline_s, speeds=settings.speeds,
            predicted_reserved_bytes=baseline_reserved, costs=costs,
            routing_bound_bytes=baseline_bound.reserved_bytes if baseline_bound is not None else 0,
        )  # fmt: skip
        result.estimate_kinds = base.block_kinds
        before = self.traced
        model_state = settings.offload_optimizer
        if base.budget_below_overhead:
            result.reason = base.overhead_shortfall()
            return result
        if base.static_exceeds_budget and (model_state or not base.parameters_fit):
            overhead = settings.overhead_bytes
            left = f"the {format_bytes(budget_bytes)} budget" if not overhead else (
                f"the {format_bytes(budget_bytes - overhead)} the {format_bytes(budget_bytes)} budget leaves after the "
                f"{format_bytes(overhead)} overhead allowance"
            )  # fmt: skip
            result.reason = (
                f"{base.static_parts()} alone take {format_bytes(base.static_bytes)}, over {left}; no activation "
                "technique helps (see the advice)"
            )
            return result
        # Model-state offload is decided once, before the walks: every verified step below runs
        # with it, and its link time is part of every configuration's exposed transfer.
        model_state_s = 0.0
        if base.static_exceeds_budget or model_state:
            model_state = True
            result.offload_optimizer = True
            # The settings asked for, or (turned on here) the engine's defaults: run_configuration's rule.
            if settings.optimizer_offload is not None:
                result.offload_optimizer_device_dtype = settings.optimizer_offload.device_dtype_name
            found = self.model_state_step()
            baseline_peak, link_bytes = found.peak_bytes, found.link_bytes
            baseline_reserved = found.reserve.bytes if found.reserve is not None else found.peak_bytes
            baseline_bound = found.routing_bound
            model_state_s = model_state_transfer_s(link_bytes, costs)
            result.predicted_peak_bytes = baseline_peak
            result.predicted_reserved_bytes = baseline_reserved
            result.routing_bound_bytes = baseline_bound.reserved_bytes if baseline_bound is not None else 0
            result.exposed_transfer_s = model_state_s
            result.step_seconds = configuration_time(base.blocks, costs, model_state_link_bytes=link_bytes).step_s
        if baseline_bound is not None:  # a mixture of experts: what must fit is its worst-case routing's
            baseline_peak = max(baseline_peak, baseline_bound.peak_bytes)
            baseline_reserved = max(baseline_reserved, baseline_bound.reserved_bytes)
        if baseline_reserved <= available:
            result.fits = True
            result.reason = (
                f"with offload_optimizer the peak is {format_bytes(baseline_peak)} + overhead "
                f"{format_bytes(settings.overhead_bytes)}"
                if model_state
                else "the baseline step already fits"
            ) + (" under the worst-case routing of its experts" if baseline_bound is not None else "")
            result.evaluations = self.traced - before
            return result

        need = allocated_need(baseline_peak, baseline_reserved, available)
        best: tuple[StepTime, Family, int] | None = None
        fitted: dict[Candidate, tuple[StepTime, str]] = {}
        families = self.families
        if other is not None:
            added = other.recompute_s + other.exposed_transfer_s if other.fits else float("inf")
            families = [
                family for family in families
                if any(candidate.checkpoint for candidate in family.candidates) and max(family.predicted_saved) >= need
                and min(t.total_s for t in family.times) < added
            ]  # fmt: skip

        def offers(family: Family) -> tuple[float, int, int, bool]:
            """What a walk might offer: its cheapest candidate from the first predicted to fit
            (from the start for offload everywhere: the others may only fit with it)."""
            start = 0 if family.starts_with_offload_alone else family.guess(need)
            return min(preference(family.times[i], family.candidates[i]) for i in range(start, len(family.candidates)))

        # The walk that might offer most first: a fit it finds spares the walks that cannot beat it.
        for family in sorted(families, key=offers):
            if best is not None and offers(family) >= preference(best[0], best[1].candidates[best[2]]):
                continue  # a configuration that fits is already at least as fast
            first = self._first_fit(family, available, need, model_state)
            if first is None:
                continue

            def rank(index: int, family: Family = family) -> tuple[float, int, int, bool]:
                return preference(family.times[index], family.candidates[index])

            # The first fit is verified. Cheaper candidates after it are verified nearest first,
            # each one taken while it fits; the walk stops at the first that does not.
            fitted[family.candidates[first]] = (family.times[first], family.name)
            chosen = first
            for _ in range(_TRIES_PAST_FIRST_FIT):
                cheaper = [i for i in range(chosen + 1, len(family.candidates)) if rank(i) < rank(chosen)]
                if not cheaper or not self.fits(self.verify(family.candidates[cheaper[0]], model_state), available):
                    break
                chosen = cheaper[0]
            fitted[family.candidates[chosen]] = (family.times[chosen], family.name)
            if best is None or rank(chosen) < preference(best[0], best[1].candidates[best[2]]):
                best = (family.times[chosen], family, chosen)
        if best is None:  # a configuration verified for another budget may fit this one
            best = self._fastest_verified_fit(available, model_state)
        result.evaluations = self.traced - before
        refused = self._closest_refused(available, model_state)
        if best is None and not refused:
            result.reason = (
                "the model has no blocks to checkpoint and saves no tensor of at least "
                f"{format_bytes(costs.min_bytes)} to offload"
            )
            return result
        if best is None:
            result.alternatives = refused
            closest = min(refused, key=lambda option: option.predicted_total_bytes)
            result.dominant = next(
                self.verified[key].dominant for key in self.verified
                if self.describe(key[0]) == closest.description and key[1] == model_state
            )  # fmt: skip
            result.reason = "no configuration in the planner's space fits: " + "; ".join(
                f"{option.description}: {format_bytes(option.predicted_total_bytes - settings.overhead_bytes)} reserved"
                for option in refused
            ) + (
                f", over the {format_bytes(budget_bytes - settings.overhead_bytes)} available after the overhead "
                f"allowance; what remains is parameters, gradients, optimizer state, temporaries and the tensors "
                f"below the offload threshold (the closest peak is {result.dominant})"
            )
            return result
        times, family, index = best
        candidate = family.candidates[index]
        verified = self.verify(candidate, model_state)
        result.fits = True
        result.checkpoint = candidate.checkpoint_names()
        result.offload = candidate.offload_settings(self.offload)
        result.actions = candidate.actions(base.blocks) if not candidate.everywhere else {
            name: action for name, action in candidate.actions(base.blocks).items() if name in candidate.checkpoint
        }
        result.offload_everywhere = candidate.everywhere
        result.predicted_peak_bytes = verified.peak_bytes
        result.predicted_reserved_bytes = verified.reserve.bytes if verified.reserve is not None else verified.peak_bytes
        bound = verified.routing_bound
        result.routing_bound_bytes = bound.reserved_bytes if bound is not None else 0
        result.host_bytes = verified.host_bytes
        price = self.step_of(candidate, verified)
        result.recompute_s, result.exposed_transfer_s = price.recompute_s, price.exposed_transfer_s
        result.step_seconds = price.step_s
        result.family = family.name
        others = [
            self._option(other, True, model_state)
            for other in fitted
            if other != candidate
        ]
        result.alternatives = sorted(others, key=lambda o: o.step_seconds) + refused
        result.reason = (
            f"verified peak {format_bytes(verified.peak_bytes)} allocated, "
            f"{format_bytes(result.predicted_reserved_bytes)} reserved + overhead {format_bytes(settings.overhead_bytes)}"
        ) + (
            f"; under the worst-case routing of its experts {format_bytes(bound.peak_bytes)} allocated, "
            f"{format_bytes(bound.reserved_bytes)} reserved" if bound is not None else ""
        )  # fmt: skip
        return result

    def _fastest_verified_fit(self, available: int, model_state: bool) -> tuple[StepTime, Family, int] | None:
        """The fastest configuration already verified that fits ``available``, with its family."""
        found = None
        for family in self.families:
            for index, candidate in enumerate(family.candidates):
                verified = self.verified.get((candidate, model_state))
                if verified is None or not self.fits(verified, available):
                    continue
                if found is None or preference(family.times[index], candidate) < preference(found[0], found[1].candidates[found[2]]):
                    found = (family.times[index], family, index)
        return found

    def _closest_refused(self, available: int, model_state: bool) -> list[PlanOption]:
        """For each kind of configuration (``KINDS``) none of whose verified ones fits
        ``available``: the verified one of that kind that came closest."""
        closest: dict[str, tuple[int, Candidate]] = {}
        fitting: set[str] = set()
        for (candidate, state), verified in self.verified.items():
            if state != model_state or not (candidate.checkpoint or candidate.offloads):
                continue
            if self.fits(verified, available):
                fitting.add(candidate.kind)
                continue
            reserved = self.reserved(verified)
            if candidate.kind not in closest or reserved < closest[candidate.kind][0]:
                closest[candidate.kind] = (reserved, candidate)
        return [
            self._option(closest[kind][1], False, model_state) for kind in KINDS if kind in closest and kind not in fitting
        ]

    def step_of(self, candidate: Candidate, verified: Verified) -> StepTime:
        """A verified candidate's step: its re-runs and the bytes its fake step sent per block."""
        return configuration_time(
            self.base.blocks, self.costs, candidate.checkpoint_names(), dict(verified.moved), verified.link_bytes
        )

    def _option(self, candidate: Candidate, fits: bool, model_state: bool) -> PlanOption:
        """``candidate`` as an alternative the plan lists: its reserved peak with the overhead
        allowance, and its step priced from its verified fake step (with model-state offload's
        transfer, with ``model_state``)."""
        verified = self.verify(candidate, model_state)
        description = _describe(candidate, self.base.block_kinds, self.costs.min_bytes)
        step = self.step_of(candidate, verified)
        return PlanOption(
            description, fits, self.reserved(verified) + self.settings.overhead_bytes,
            step.recompute_s, step.exposed_transfer_s, step.step_s,
        )  # fmt: skip


def plan_space(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
    budget: int | str | None = None,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    gpu: str | DeviceSpeeds = "auto",
    overhead_bytes: int | str | None = None,
    zero_grad: str = "after_forward",
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str | None = None,
    offload: bool | Mapping[str, Any] | OffloadSettings | None = None,
    checkpoint_policy: CheckpointPolicyArg = "full",
    batch_size: int | None = None,
    fn_name: str = "plan_space",
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    baseline: StepTrace | None = None,
) -> PlanSpace:
    """The planner's space for ``model`` and ``batch`` (at ``batch_size`` when given), with its
    baseline step run: ``space.plan(budget_bytes)`` answers for any budget, each configuration's
    fake step run at most once across them. Arguments as for :func:`plan`; ``baseline``: the
    baseline step, already traced under these settings."""
    settings = parse_settings(
        fn_name, model, loss_fn, optimizer=optimizer, precision=precision, device=device, gpu=gpu,
        overhead_bytes=overhead_bytes, budget=budget, zero_grad=zero_grad, checkpoint_policy=checkpoint_policy,
        offload_optimizer=offload_optimizer, flops_per_s=flops_per_s, link_bytes_per_s=link_bytes_per_s,
    )  # fmt: skip
    offload_settings = parse_planned_offload(True if offload is None else offload, flag=f"{fn_name}(offload=...)")
    info = inspect_batch(batch)
    base, baseline = build_report(model, batch, settings, info, None, None, batch_size=batch_size, baseline=baseline)
    costs = costs_for(settings, baseline, offload_settings)
    if offload_settings is not None and costs.allow_offload:
        # The windows the plan hands the engine are what its link moves while a block computes.
        offload_settings = sized_windows(offload_settings, base.blocks, costs)
        costs = dataclasses.replace(
            costs, inflight_bytes=offload_settings.max_inflight_bytes, prefetch_bytes=offload_settings.prefetch_bytes
        )
        costs = dataclasses.replace(costs, partial=partial_thresholds(base.blocks, costs))
    return PlanSpace(
        model, batch, settings, info, base, costs, offload=offload_settings, batch_size=batch_size, baseline=baseline
    )


def search_plan(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    info: BatchInfo,
    base: MemoryEstimate,
    costs: Costs,
    *,
    offload: OffloadSettings | None = None,
    batch_size: int | None = None,
) -> Plan:
    """Search the space of ``base``'s blocks for ``settings.budget_bytes``, verifying with fake steps.

    ``offload``: the settings a chosen offload is built from (None: lightmem's defaults)."""
    assert settings.budget_bytes is not None
    space = PlanSpace(model, batch, settings, info, base, costs, offload=offload, batch_size=batch_size)
    return space.plan(settings.budget_bytes)


def _searched_under(settings: EstimateSettings, costs: Costs, offload: OffloadSettings | None) -> dict[str, Any]:
    """What a plan was searched under, JSON-ready: the flags that shaped it, as parsed."""
    return {
        "device": settings.device,
        "precision": settings.precision.name,
        "optimizer": settings.optimizer.name,
        "overhead_bytes": settings.overhead_bytes,
        "budget_bytes": settings.budget_bytes,
        "checkpoint_policy": policy_name(settings.checkpoint_policy),
        "offload": offload.to_dict() if offload is not None else None,
        "offload_considered": costs.allow_offload,
        "offload_optimizer": settings.offload_optimizer,
        "offload_optimizer_device_dtype": (
            settings.optimizer_offload.device_dtype_name if settings.optimizer_offload is not None else None
        ),
        "gpu": settings.gpu,
        "speeds": settings.speeds.to_dict() if settings.speeds is not None else None,
        "expandable_segments": settings.expandable_segments,
        "allocator": "replayed" if settings.device == "cuda" else None,
        "flops_per_s": costs.flops_per_s,
        "link_bytes_per_s": costs.link_bytes_per_s,
    }


def _describe(candidate: Candidate, kinds: Mapping[str, str], min_bytes: int) -> str:
    parts = []
    if candidate.checkpoint:
        parts.append(f"checkpoint {compact_names(candidate.checkpoint_names(), kinds)}")
    if candidate.everywhere:
        parts.append(f"offload every saved tensor of at least {format_bytes(min_bytes)}")
    else:
        if candidate.offload:
            parts.append(f"offload {compact_names(sorted(candidate.offload, key=natural_order), kinds)}")
        for threshold in sorted({threshold for _, threshold in candidate.partial}):
            names = sorted((name for name, own in candidate.partial if own == threshold), key=natural_order)
            parts.append(f"offload the tensors of at least {format_bytes(threshold)} of {compact_names(names, kinds)}")
    return " + ".join(parts)
