"""The planner's space: every configuration of one model, batch and settings, and its search.

The space: checkpointing any set of the repeated layers, offloading the saved tensors of any set
of blocks, and offloading every saved tensor of at least ``min_bytes`` anywhere in the model
(the stem of a CNN, an LM's embedding output and head input included), alone or with any set
of checkpointed layers. The space is too large to verify point by point, so it is walked as
four nested sequences ("families", ``lightmem.estimate.planning.families``), each from one cheap
step to its extreme:

- ``checkpoint``: repeated layers checkpointed one by one, cheapest re-run per byte first;
- ``offload``: offload alone, block by block (a block's largest saved tensors or all of them),
  cheapest per byte first, ending with every saved tensor of at least ``min_bytes`` anywhere;
- ``per block``: per-block actions (offload any block, checkpoint or checkpoint + offload a
  repeated layer), cheapest per byte first, ending with every layer both and every block offloaded;
- ``offload everywhere``: every saved tensor offloaded, then repeated layers checkpointed too;
- ``tile``: position-wise modules (read from the trace: ``lightmem.estimate.trace.position_wise``)
  run in sequence shards one by one, cheapest per byte first, then, with every one tiled, the
  per-block actions on top (within a checkpointed block, tiling its MLP keeps the MLP's
  intermediates out of the re-run too), ending with everything tiled, every layer checkpointed and
  offloaded.

Predictions (the bytes each action saves) only order a family and say where to start looking.
Whether a configuration fits is decided by the estimator's verified fake step, never by the
prediction: from the first configuration whose predicted savings cover the need, verified steps
gallop down while it fits or up (to the family's extreme) until it does, then bisect, which finds
the first configuration that fits. Among it and every configuration after it, and across
families, the one with the least predicted step time (:mod:`lightmem.estimate.pricing.timeline`)
is chosen, verified before it is taken. So whenever a family's extreme fits (every repeated layer
checkpointed, with or without offload) or offload alone fits, the plan fits, at a verified peak
within the budget.

A mixture of experts whose sizes follow its routing is verified twice per configuration (the
estimator's balanced step and its worst-case routing, ``StepTrace.routing_bound``): what must fit
the budget is the worst case, while the plan's predicted step time stays the balanced step's.

Model-state offload (``offload_optimizer``: gradients and optimizer state on the host) is decided
once, before the walks: on when asked for, or when parameters + gradients + optimizer state leave
no room but the parameters alone do. Then every verified step runs with it, the baseline that
decides "already fits" is its step, and its link time (``model_state_transfer_s``) is added to
every configuration's exposed transfer. Along the sequence (``model_state_when_needed``) it is
tried again where nothing fits without it.

Every verified configuration's host memory (``lightmem.estimate.host``: the offload pool's bound
and model state) is held to the settings' host limit: one that fits the device but not the host is
not taken, and where every one that fits the device holds too much, the plan says the host, not
the device, is the limit (``Plan.limited_by``).

``plan`` and the estimate's reach-the-budget advice search this one space: both build it from the
same report and settings (``PlanSpace``), so the two never disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightmem.config import OffloadSettings
from lightmem.config.estimator import parse_planned_offload
from lightmem.estimate.assemble import build_report
from lightmem.estimate.host import HostBytes, host_bytes
from lightmem.estimate.planning.verified import (
    Verified, allocated_need, model_state_transfer_s, searched_under, window_cap,
)  # fmt: skip
from lightmem.estimate.planning.families import (
    KINDS, TILED_KINDS, Candidate, Family, build_families, preference,
)  # fmt: skip
from lightmem.estimate.planning.result import Plan, PlanOption
from lightmem.estimate.pricing.costs import costs_for, partial_thresholds, sized_windows
from lightmem.estimate.pricing.timeline import StepTime, compute_s, configuration_time
from lightmem.estimate.report import MemoryEstimate
from lightmem.estimate.settings import EstimateSettings, parse_settings
from lightmem.estimate.steps import STEPS, run_configuration, step_key
from lightmem.estimate.trace.batch import BatchInfo, inspect_batch
from lightmem.estimate.trace.step import StepTrace
from lightmem.estimate.words import (
    dominant_part,
    fits_as_it_is,
    nothing_fits,
    nothing_to_plan,
    policy_name,
    static_reason,
    verified_fit,
)  # fmt: skip

_TRIES_PAST_FIRST_FIT = 3
"""Cheaper candidates verified past a family's first fit before settling on that fit."""


@dataclass
class _Search:
    """One budget's search through the space: what is available, what must be saved, and what the
    walks have found so far."""

    available: int
    need: int
    model_state: bool
    best: tuple[StepTime, Family, int] | None = None
    fitted: dict[Candidate, tuple[StepTime, str]] = field(default_factory=dict)


class PlanSpace:
    """The planner's space for one model, batch and settings; ``plan(budget)`` searches it.

    Built from the report of the step without lightmem (``base``) and its trace (``baseline``): the
    prices (``costs_for``), and, where offload is planned, the windows the plan hands the engine
    (what the link moves while a block computes) and each block's partial offload. Verified steps
    are remembered (``steps.STEPS``: across spaces of the same model, batch and settings too), so
    asking for several budgets (or the same budget twice) runs each configuration's fake step once.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        settings: EstimateSettings,
        info: BatchInfo,
        base: MemoryEstimate,
        baseline: StepTrace,
        *,
        batch_size: int | None = None,
        sequence: tuple[int, int, int] | None = None,
    ) -> None:
        self.model, self.batch, self.settings, self.info = model, batch, settings, info
        self.base, self.batch_size, self.baseline = base, batch_size, baseline
        self.sequence = sequence
        """The batch's sequence at the length planned for (``StepRequest.sequence``); None: as given."""
        self.host = settings.host
        """The host memory a configuration may hold (``lightmem.estimate.host``)."""
        self.model_state_when_needed = False
        """Search again with model-state offload where nothing fits without it (``plan``)."""
        costs = costs_for(settings, baseline, settings.offload)
        offload = settings.offload
        if offload is not None and costs.allow_offload:
            # The windows the plan hands the engine are what its link moves while a block computes.
            offload = sized_windows(offload, base.blocks, costs, window_cap(base, settings))
            costs = dataclasses.replace(
                costs, inflight_bytes=offload.max_inflight_bytes, prefetch_bytes=offload.prefetch_bytes
            )
            costs = dataclasses.replace(costs, partial=partial_thresholds(base.blocks, costs))
        self.costs = costs
        self.searched_offload = offload
        """The offload settings the search runs under, windows sized (None: offload not planned)."""
        self.offload = offload if offload is not None else settings.offload
        self.tile_candidates = base.tile_candidates if settings.tile and not base.compiled else []
        """The modules this space may tile (none for a compiled model: a tiled module runs eagerly
        between compiled graphs)."""
        self.families = build_families(base.blocks, costs, self.tile_candidates)
        self.verified: dict[tuple[Candidate, bool], Verified] = {}
        """Verified steps by candidate and whether model state was offloaded."""
        self.traced = 0
        """Fake steps this space ran (verified steps remembered in ``STEPS`` are not run again)."""
        self._step_key = step_key(model, batch, settings, batch_size, sequence)

    def _key(self, candidate: Candidate, model_state: bool) -> tuple[Any, ...]:
        """What decides the candidate's fake step: the space's step key, the candidate, its offload
        settings (windows included) and, when it checkpoints, the policy."""
        offload = candidate.offload_settings(self.offload) if self.offload is not None else None
        policy = policy_name(self.settings.checkpoint_policy) if candidate.checkpoint else None
        return (self._step_key, candidate, model_state, repr(offload.to_dict()) if offload is not None else None, policy)

    def verify(self, candidate: Candidate, model_state: bool = False) -> Verified:
        """The candidate's fake step, with model-state offload when ``model_state`` (run once per
        candidate and choice)."""
        found = self.verified.get((candidate, model_state))
        if found is not None:
            return found
        key = self._key(candidate, model_state)
        found = STEPS.verified(self.model, key)
        if found is None:
            self.traced += 1
            trace = run_configuration(
                self.model, self.batch, self.settings, info=self.info, batch_size=self.batch_size,
                checkpoint=tuple(candidate.checkpoint_names()) or None,
                offload=candidate.offload_settings(self.offload) if self.offload is not None else None,
                offload_optimizer=model_state, tile=candidate.tile_settings(), sequence=self.sequence,
            )  # fmt: skip
            offload = candidate.offload_settings(self.offload) if self.offload is not None else None
            held = host_bytes(
                trace.host_bytes, trace.host_largest_bytes, trace.optimizer_host_bytes,
                offload.host_budget_bytes if offload is not None else None,
            )  # fmt: skip
            found = Verified(
                trace.peak.bytes, trace.host_bytes, trace.optimizer_link_bytes,
                tuple(trace.offloaded_by_block.items()), dominant_part(trace), trace.reserve, trace.routing_bound, held,
            )  # fmt: skip
            STEPS.remember_verified(self.model, key, found)
        self.verified[(candidate, model_state)] = found
        return found

    def model_state_step(self) -> Verified:
        """The baseline step with model-state offload (no activation technique): its peak and the
        bytes that offload moves over the link per step."""
        named = self.base.scenarios.get("offload_optimizer")
        if named is not None:  # run with the report, at the space's batch size
            return Verified(
                named.peak_bytes, named.host_bytes, named.model_state_link_bytes,
                reserve=named.reserve, routing_bound=named.routing_bound, host=HostBytes(model_state=named.host_bytes),
            )
        return self.verify(Candidate(), model_state=True)

    def reserved(self, verified: Verified) -> int:
        """What must fit the budget for a verified step (``Verified.held_bytes``)."""
        return verified.held_bytes

    def admits(self, verified: Verified, available: int) -> bool:
        """Whether a verified step runs with ``available`` bytes reservable (``Verified.runs_within``)
        and what it holds on the host within the space's host limit."""
        return verified.runs_within(available) and self.host.admits(verified.host)

    def held_by_host(self, available: int, model_state: bool) -> tuple[Candidate, Verified] | None:
        """When every verified configuration that runs within ``available`` holds more than the host
        limit: the one that holds least (None: the device, not the host, refused them)."""
        fitting = [
            (candidate, verified) for (candidate, state), verified in self.verified.items()
            if state == model_state and verified.runs_within(available)
        ]  # fmt: skip
        if not fitting or any(self.host.admits(verified.host) for _, verified in fitting):
            return None
        return min(fitting, key=lambda found: found[1].host.total)

    @property
    def kinds(self) -> dict[str, str]:
        """The class name of each block and each module the space may tile, for words."""
        return {**self.base.block_kinds, **{name: self.costs.modules[name].kind for name in self.tile_candidates}}

    def describe(self, candidate: Candidate) -> str:
        """The candidate in words: "checkpoint layer1.0-2 (Bottleneck) + offload every saved tensor ..."."""
        return candidate.describe(self.kinds, self.costs.min_bytes)

    def extremes(self) -> list[Candidate]:
        """The configurations that save the most in each family, and offload alone: what
        completeness is promised for."""
        found = [family.candidates[-1] for family in self.families]
        found += [family.candidates[0] for family in self.families if family.starts_with_offload_alone]
        return list(dict.fromkeys(found))

    def extreme_totals(self) -> list[tuple[str, int]]:
        """Each extreme configuration (``extremes``) in words, with what its verified step needs
        reserved plus the overhead allowance (with model-state offload when the settings ask it)."""
        model_state = self.settings.offload_optimizer
        return [
            (self.describe(candidate), self.verify(candidate, model_state).held_bytes + self.settings.overhead_bytes)
            for candidate in self.extremes()
        ]

    def _first_fit(self, family: Family, available: int, need: int, model_state: bool = False) -> int | None:
        """The first candidate of ``family`` that fits, searched with verified steps from the
        first one whose predicted savings cover ``need``: galloping (1, 2, 4 ... steps) down
        while it fits or up until it does, then bisecting. Fitting is taken to be monotone
        along a family (a longer prefix saves more), so two or three steps usually settle it;
        when nothing up to the extreme fits, None.

        Along "offload everywhere" fitting can go the other way (checkpointing on top of
        offload raises the peak when a re-run materialises a large block in backward): when
        nothing after the start fits, the start itself (offload alone) is the answer if it fits.
        So where neither the first guess nor the extreme fits, that walk is settled by its start:
        a refusal verifies each walk's ends, not the steps between them.
        """
        fits = lambda index: self.admits(self.verify(family.candidates[index], model_state), available)  # noqa: E731
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
            if family.starts_with_offload_alone and guess < last and not fits(last):
                # Checkpointing on top of offloading everything keeps no less on the device (a re-run
                # materialises its block in backward): where the extreme does not fit either, the walk
                # has nothing to find but its start.
                return 0 if fits(0) else None
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
        walks do not fit, its own are not expected to.)

        With ``model_state_when_needed`` (``max_sequence_length``'s spaces), on CUDA, where no
        configuration fits with gradients and optimizer state on the device (the device's budget or
        the host's stopping it), the walks are searched again with them on the host (model-state
        offload): at long context the activations, not the model state, fill the device, and the
        model state's bytes are room."""
        found = self._plan(budget_bytes, other)
        retry = self.model_state_when_needed and self.settings.device == "cuda" and not found.offload_optimizer
        if found.fits or not retry:
            return found
        # Model state on the host frees at most the gradients and optimizer state: where the closest
        # configuration is further over the budget, it cannot fit either. Where the host stopped the
        # plan (the configurations that fit the device offload too much), the room it frees on the
        # device lets configurations that offload less fit.
        trace = self.baseline
        freed = trace.gradient_bytes + trace.optimizer_state_bytes
        closest = min((option.predicted_total_bytes for option in found.alternatives), default=None)
        if found.limited_by == "device" and closest is not None and closest - budget_bytes > freed:
            return found
        moved = self._plan(budget_bytes, other, model_state=True)
        if not moved.fits:
            return found
        moved.evaluations += found.evaluations
        return moved

    def _plan(self, budget_bytes: int, other: Plan | None, *, model_state: bool = False) -> Plan:
        """``plan``'s search, with model-state offload when ``model_state`` (or asked for, or needed by
        the model state alone)."""
        settings, base, costs = self.settings, self.base, self.costs
        baseline = base.scenarios["baseline"]
        baseline_s = compute_s(base.blocks, costs)
        result = Plan(
            [], None, baseline.peak_bytes, settings.overhead_bytes, budget_bytes, False, "", estimate=base,
            checkpoint_policy=settings.checkpoint_policy, flops_per_s=costs.flops_per_s,
            link_bytes_per_s=costs.link_bytes_per_s, settings=self.searched_under(), step_seconds=baseline_s,
            baseline_step_seconds=baseline_s, speeds=settings.speeds, predicted_reserved_bytes=baseline.predicted_reserved,
            costs=costs, routing_bound_bytes=baseline.routing_bound.reserved_bytes if baseline.routing_bound else 0,
        )  # fmt: skip
        result.estimate_kinds = base.block_kinds
        before = self.traced
        model_state = model_state or settings.offload_optimizer
        if base.budget_below_overhead:
            result.reason = base.overhead_shortfall()
            return result
        if base.static_exceeds_budget and (model_state or not base.parameters_fit):
            result.reason = static_reason(base.static_parts(), base.static_bytes, budget_bytes, settings.overhead_bytes)
            return result
        # Model-state offload is decided once, before the walks: every verified step below runs
        # with it, and its link time is part of every configuration's exposed transfer.
        start = Verified(baseline.peak_bytes, 0, reserve=baseline.reserve, routing_bound=baseline.routing_bound)
        if base.static_exceeds_budget or model_state:
            model_state = True
            start = self._with_model_state(result)
            if not self.host.admits(start.host):
                result.reason = f"gradients and optimizer state go to the host, and {self.host.refusal(start.host)}"
                result.limited_by = "host"
                return result
        # What must fit is what the allocator reserves for a verified (allocated) peak.
        available = budget_bytes - settings.overhead_bytes
        bound = start.routing_bound
        peak = start.peak_bytes if bound is None else max(start.peak_bytes, bound.peak_bytes)
        reserved = start.held_bytes
        if reserved <= available:
            result.fits = True
            result.reason = fits_as_it_is(model_state, peak, settings.overhead_bytes, bound is not None)
            result.evaluations = self.traced - before
            return result
        search = _Search(available, allocated_need(peak, reserved, available), model_state)
        self._walk(search, other)
        if search.best is None:  # a configuration verified for another budget may fit this one
            search.best = self._fastest_verified_fit(available, model_state)
        result.evaluations = self.traced - before
        held = self.held_by_host(available, model_state) if search.best is None else None
        if held is not None:
            result.reason = (
                f"every configuration verified to fit the device holds more host memory than the host allows: the "
                f"least, {self.describe(held[0])}, {self.host.refusal(held[1].host)}"
            )
            result.limited_by, result.host = "host", held[1].host
            return result
        refused = self._closest_refused(available, model_state)
        if search.best is None:
            self._refuse(result, refused, budget_bytes, model_state)
            return result
        self._take(result, search, refused)
        return result

    def _with_model_state(self, result: Plan) -> Verified:
        """Model-state offload turned on in ``result``: its baseline step and what it adds."""
        result.offload_optimizer = True
        # The settings asked for, or (turned on here) the engine's defaults: run_configuration's rule.
        if self.settings.optimizer_offload is not None:
            result.offload_optimizer_device_dtype = self.settings.optimizer_offload.device_dtype_name
        found = self.model_state_step()
        result.predicted_peak_bytes = found.peak_bytes
        result.predicted_reserved_bytes = found.reserved_bytes
        result.routing_bound_bytes = found.routing_bound.reserved_bytes if found.routing_bound is not None else 0
        result.exposed_transfer_s = model_state_transfer_s(found.link_bytes, self.costs)
        result.host = found.host
        result.step_seconds = configuration_time(self.base.blocks, self.costs, model_state_link_bytes=found.link_bytes).step_s
        return found

    def _walk(self, search: _Search, other: Plan | None) -> None:
        """Walk the families, the one that might offer most first: a fit one finds spares the walks
        that cannot beat it."""
        families = self.families
        if other is not None:
            added = other.recompute_s + other.exposed_transfer_s if other.fits else float("inf")
            families = [
                family for family in families
                if any(candidate.checkpoint for candidate in family.candidates) and max(family.predicted_saved) >= search.need
                and min(t.total_s for t in family.times) < added
            ]  # fmt: skip

        def offers(family: Family) -> tuple[float, int, int, bool]:
            """What a walk might offer: its cheapest candidate from the first predicted to fit
            (from the start for offload everywhere: the others may only fit with it)."""
            start = 0 if family.starts_with_offload_alone else family.guess(search.need)
            return min(preference(family.times[i], family.candidates[i]) for i in range(start, len(family.candidates)))

        for family in sorted(families, key=offers):
            best = search.best
            if best is not None and offers(family) >= preference(best[0], best[1].candidates[best[2]]):
                continue  # a configuration that fits is already at least as fast
            first = self._first_fit(family, search.available, search.need, search.model_state)
            if first is not None:
                self._cheapest_from(family, first, search)

    def _cheapest_from(self, family: Family, first: int, search: _Search) -> None:
        """From ``family``'s first fit (verified), the cheaper candidates after it, nearest first,
        each taken while it fits; the walk stops at the first that does not."""

        def rank(index: int) -> tuple[float, int, int, bool]:
            return preference(family.times[index], family.candidates[index])

        search.fitted[family.candidates[first]] = (family.times[first], family.name)
        chosen = first
        for _ in range(_TRIES_PAST_FIRST_FIT):
            cheaper = [i for i in range(chosen + 1, len(family.candidates)) if rank(i) < rank(chosen)]
            if not cheaper or not self.admits(self.verify(family.candidates[cheaper[0]], search.model_state), search.available):
                break
            chosen = cheaper[0]
        search.fitted[family.candidates[chosen]] = (family.times[chosen], family.name)
        best = search.best
        if best is None or rank(chosen) < preference(best[0], best[1].candidates[best[2]]):
            search.best = (family.times[chosen], family, chosen)

    def _refuse(self, result: Plan, refused: list[PlanOption], budget_bytes: int, model_state: bool) -> None:
        """``result`` says that nothing fits, and what came closest of each kind."""
        if not refused:
            result.reason = nothing_to_plan(self.costs.min_bytes)
            return
        result.alternatives = refused
        result.limited_by = "device"
        closest = min(refused, key=lambda option: option.predicted_total_bytes)
        result.dominant = next(
            self.verified[key].dominant for key in self.verified
            if self.describe(key[0]) == closest.description and key[1] == model_state
        )  # fmt: skip
        result.reason = nothing_fits(refused, budget_bytes, self.settings.overhead_bytes, result.dominant)

    def _take(self, result: Plan, search: _Search, refused: list[PlanOption]) -> None:
        """``result`` takes the search's best configuration, with what else fitted and what did not."""
        assert search.best is not None
        _, family, index = search.best
        candidate = family.candidates[index]
        verified = self.verify(candidate, search.model_state)
        base = self.base
        result.fits = True
        result.checkpoint = candidate.checkpoint_names()
        result.offload = candidate.offload_settings(self.offload) if self.offload is not None else None
        result.actions = candidate.actions(base.blocks) if not candidate.everywhere else {
            name: action for name, action in candidate.actions(base.blocks).items() if name in candidate.checkpoint
        }
        result.offload_everywhere = candidate.everywhere
        result.tile = candidate.tile_names()
        result.tile_kinds = {name: self.costs.modules[name].kind for name in result.tile}
        result.host = verified.host
        result.predicted_peak_bytes = verified.peak_bytes
        result.predicted_reserved_bytes = verified.reserved_bytes
        bound = verified.routing_bound
        result.routing_bound_bytes = bound.reserved_bytes if bound is not None else 0
        result.host_bytes = verified.host_bytes
        price = self.step_of(candidate, verified)
        result.recompute_s, result.exposed_transfer_s = price.recompute_s, price.exposed_transfer_s
        result.step_seconds = price.step_s
        result.family = family.name
        others = [self._option(other, True, search.model_state) for other in search.fitted if other != candidate]
        result.alternatives = sorted(others, key=lambda o: o.step_seconds) + refused
        result.reason = verified_fit(verified.peak_bytes, result.predicted_reserved_bytes, self.settings.overhead_bytes, bound)

    def _fastest_verified_fit(self, available: int, model_state: bool) -> tuple[StepTime, Family, int] | None:
        """The fastest configuration already verified that fits ``available``, with its family."""
        found = None
        for family in self.families:
            for index, candidate in enumerate(family.candidates):
                verified = self.verified.get((candidate, model_state))
                if verified is None or not self.admits(verified, available):
                    continue
                if found is None or preference(family.times[index], candidate) < preference(found[0], found[1].candidates[found[2]]):
                    found = (family.times[index], family, index)
        return found

    def _closest_refused(self, available: int, model_state: bool) -> list[PlanOption]:
        """For each kind of configuration (``KINDS``) none of whose verified ones fits
        ``available``: the verified one of that kind that came closest (the first verified of
        those that came as close). A step's allocated peak bounds what it reserves from below, so
        what each reserves is worked out (a bisection of replays) only where it could be closer."""
        candidates: dict[str, list[tuple[int, int, Candidate, Verified]]] = {}
        fitting: set[str] = set()
        for order, ((candidate, state), verified) in enumerate(self.verified.items()):
            if state != model_state or not (candidate.checkpoint or candidate.offloads or candidate.tile):
                continue
            if self.admits(verified, available):
                fitting.add(candidate.kind)
                continue
            bound = verified.routing_bound
            least = verified.peak_bytes if bound is None else max(verified.peak_bytes, bound.peak_bytes)
            candidates.setdefault(candidate.kind, []).append((least, order, candidate, verified))
        closest: dict[str, Candidate] = {}
        for kind, found in candidates.items():
            best: tuple[int, int] | None = None
            for least, order, candidate, verified in sorted(found, key=lambda item: (item[0], item[1])):
                if best is not None and (least, order) > best:
                    break  # it reserves at least its peak: it cannot come closer
                held = (verified.held_bytes, order)
                if best is None or held < best:
                    best, closest[kind] = held, candidate
        return [
            self._option(closest[kind], False, model_state)
            for kind in (*KINDS, *TILED_KINDS) if kind in closest and kind not in fitting
        ]  # fmt: skip

    def step_of(self, candidate: Candidate, verified: Verified) -> StepTime:
        """A verified candidate's step: its re-runs and the bytes its fake step sent per block."""
        return configuration_time(
            self.base.blocks, self.costs, candidate.checkpoint_names(), dict(verified.moved), verified.link_bytes,
            candidate.tile,
        )

    def _option(self, candidate: Candidate, fits: bool, model_state: bool) -> PlanOption:
        """``candidate`` as an alternative the plan lists: its reserved peak with the overhead
        allowance, and its step priced from its verified fake step (with model-state offload's
        transfer, with ``model_state``)."""
        verified = self.verify(candidate, model_state)
        step = self.step_of(candidate, verified)
        return PlanOption(
            self.describe(candidate), fits, verified.held_bytes + self.settings.overhead_bytes,
            step.recompute_s, step.exposed_transfer_s, step.step_s,
        )  # fmt: skip

    def searched_under(self) -> dict[str, Any]:
        """What a plan was searched under, JSON-ready: the flags that shaped it, as parsed."""
        return searched_under(self.settings, self.costs, self.searched_offload, self.tile_candidates)


def space_for(
    model: nn.Module, batch: Any, settings: EstimateSettings, *, batch_size: int | None = None,
    baseline: StepTrace | None = None, sequence: tuple[int, int, int] | None = None,
) -> PlanSpace:  # fmt: skip
    """The planner's space for ``model`` and ``batch`` (at ``batch_size`` and ``sequence`` when
    given) under ``settings``, with its baseline step run: ``space.plan(budget_bytes)`` answers for
    any budget, each configuration's fake step run at most once across them. ``baseline``: the
    baseline step, already traced under these settings."""
    info = inspect_batch(batch)
    base, baseline = build_report(
        model, batch, settings, info, None, None, batch_size=batch_size, baseline=baseline, sequence=sequence
    )
    return PlanSpace(model, batch, settings, info, base, baseline, batch_size=batch_size, sequence=sequence)


def plan_space(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
    budget: int | str | None = None,
    offload: bool | Mapping[str, Any] | OffloadSettings | None = None,
    batch_size: int | None = None,
    loss_as_chunked: bool = False,
    fn_name: str = "plan_space",
    **flags: Any,
) -> PlanSpace:
    """The planner's space from a call's arguments, as for :func:`lightmem.plan` (``flags``: those
    ``parse_settings`` takes), parsed once and named ``fn_name(argument=...)`` in an error;
    ``loss_as_chunked``: every step priced as if the loss were chunked (``space_for``)."""
    settings = parse_settings(fn_name, model, loss_fn, budget=budget, **flags)
    settings = settings.searching(parse_planned_offload(True if offload is None else offload, flag=f"{fn_name}(offload=...)"))
    return space_for(model, batch, settings.priced_as_chunked() if loss_as_chunked else settings, batch_size=batch_size)
