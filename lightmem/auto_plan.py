"""``LightMem(plan="auto")`` over one fit: its budget and prices, when a batch needs a new plan,
whether the plans held on the device, and the error for a batch no plan fits.

The budget is ``device_budget`` or, without it, what the training device can give this process,
measured once at fit start (:func:`lightmem.device_memory.measure_device_budget`). The prices are
the training device's own: on CUDA its link and compute are measured at fit start
(:func:`lightmem.devices.measure_device_speeds`). A plan covers the batch it was made for
and every batch no larger in any dimension of any tensor; a batch it does not cover is planned for
before its forward, together with every batch planned for so far: the next plan is made for the
elementwise maximum of their shapes, so batches that take turns (a token-bucketed loader's [4, 33]
and [8, 17]) are planned for once, as [8, 33], not at every turn.

A plan is made for what the allocator reserves (``Plan.predicted_reserved_bytes``). After each
training batch the peaks it measured are compared with the highest peaks the plans of this fit
predict: allocated (``max_memory_allocated``, for the metrics) and reserved (``max_memory_reserved``,
what running out of memory is decided on). When the reserved peak passes the prediction by more than
``REPLAN_MARGIN``, the next batch is planned again for a budget smaller by that overshoot. The
allocator's peaks are highs of the whole process, which lightmem resets only where its own measure of
the device's speeds raised them (``device_memory.measured_speeds``); a training batch is
measured when it raises that high, so what an earlier fit or a validation batch reached is never
counted: until a training batch raises it, nothing is measured (0 logged, no ratio, no warning).

Step times are held against the plan's prediction too (steps after the first, timed on the device):
past ``REPLAN_MARGIN`` the next batch is planned again with the device's compute and the host's
launches priced at the measured pace. Before that, in the same steps, each block's forward is timed
with CUDA events (``BlockTimer``; not in a compiled model, whose hooks would recompile it) and held
against its interval on the step's timeline (``forward_intervals``: a block the host launches slower
than the device runs it times the host): a block kept on the device or checkpointed that is off its
price by more than ``REPLAN_MARGIN`` is priced as measured from then on, its compute
(``DeviceSpeeds.block_scale``, scaling its forward, backward and re-run) or, where the host's launches
bound it, the host's (``host_op_s``), and the next batch is planned again. Offloaded blocks are not
timed: their forward may wait for the link, which the plan prices apart. Twins (repeated blocks of
one class priced alike) are held together: the median of the timed ones prices them all, untimed
ones included.
"""

from __future__ import annotations

import functools
import statistics
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightmem.compiled import holds_compiled_modules
from lightmem.config import PlanSettings, format_bytes
from lightmem.config.estimator import parse_overhead
from lightmem.device_memory import (
    OVERHEAD_GRAIN_BYTES,
    DeviceMemory,
    measure_device_budget,
    measured_speeds,
    memory_to_measure,
    outside_bytes,
    overhead_for_given_budget,
    overhead_for_measured_budget,
    training_device_memory,
)
from lightmem.devices import DeviceSpeeds
from lightmem.estimate import Plan
from lightmem.estimate.pricing.costs import CHECKPOINT, KEEP
from lightmem.estimate.pricing.timeline import ForwardInterval, forward_intervals
from lightmem.estimate.trace.batch import batch_shapes
from lightmem.estimate.trace.blocks import ROOT_BLOCK, BlockMemory
from lightmem.estimate.words import format_seconds

Shapes = tuple[tuple[int, ...], ...]

REPLAN_MARGIN = 0.15
"""How far a measured peak (reserved) or step time may pass the plan's prediction before the next
batch is planned again."""
TIMED_STEPS = 3
"""Steps after the first whose time is held against the prediction (the first pays warm-ups)."""
FOLLOW_UP_STEPS = 1
"""Steps of a plan made again at new prices (its configuration kept) held against its prediction."""
BLOCK_TIMING_MIN_S = 1e-4
"""Blocks whose forward interval is priced under this are not held to their price: a CUDA event
pair around a few microseconds times little but the events themselves."""


class BlockTimer:
    """Forward hooks on the named blocks of ``module`` that time each forward with ``clock`` (a
    ``CudaBlockClock``) while ``active``; ``remove()`` takes them off."""

    def __init__(self, module: nn.Module, names: list[str], clock: Any) -> None:
        self.clock = clock
        self.active = False
        """The hooks time what runs now (the forward of a timed step)."""
        self.timing = False
        """This step is timed (its forward has begun)."""
        self.handles: list[Any] = []
        for name in names:
            try:
                block = module.get_submodule(name)
            except AttributeError:
                continue
            self.handles.append(block.register_forward_pre_hook(functools.partial(self._enter, name)))
            self.handles.append(block.register_forward_hook(functools.partial(self._exit, name), always_call=True))

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        if self.active:
            self.clock.enter(name)

    def _exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self.active:
            self.clock.exit(name)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.active = False


class PlanDoesNotFit(RuntimeError):
    """``plan="auto"`` found no configuration whose step fits the device budget for a batch: raised
    before that batch's forward, with the budget, the closest plan's predicted peak, what dominates
    it and the largest batch that fits."""


def covers(planned: Shapes, shapes: Shapes) -> bool:
    """Whether a plan made for a batch of ``planned`` shapes covers one of ``shapes``: the same
    tensors, none larger in any dimension."""
    return len(planned) == len(shapes) and all(
        len(old) == len(new) and all(n <= o for o, n in zip(old, new)) for old, new in zip(planned, shapes)
    )


def shapes_covering(planned: Shapes | None, shapes: Shapes) -> Shapes:
    """The smallest shapes a plan covering both ``planned`` and ``shapes`` is made for: their
    elementwise maximum, or ``shapes`` alone when the batches hold other tensors (nothing planned,
    another count of tensors or of dimensions)."""
    same_tensors = planned is not None and [len(shape) for shape in planned] == [len(shape) for shape in shapes]
    if planned is None or not same_tensors:
        return shapes
    return tuple(tuple(max(o, n) for o, n in zip(old, new)) for old, new in zip(planned, shapes))


def format_shapes(shapes: Shapes) -> str:
    """``[8, 65]``, or ``[8, 65], [8]`` for a batch of several tensors."""
    return ", ".join(str(list(shape)) for shape in shapes) or "no tensors"


def no_fit_message(
    chosen: Plan, shapes: Shapes, largest: int | None, batch_size: int | None, chunked_loss: str = ""
) -> str:
    """What ``PlanDoesNotFit`` says: the budget, the closest plan's predicted peak and what
    dominates it, the largest batch a plan fits (``largest``; None: not searched), and
    ``chunked_loss``: what a chunked loss would change, where the loss's logits dominate."""
    closest = min((option for option in chosen.alternatives), key=lambda o: o.predicted_total_bytes, default=None)
    parts = [
        f"lightmem: plan='auto' found no configuration that fits the {format_bytes(chosen.budget_bytes)} device "
        f"budget for batches of {format_shapes(shapes)}"
    ]
    if closest is not None:
        parts.append(
            f"; the closest, {closest.description}, needs {format_bytes(closest.predicted_total_bytes)} "
            f"(the allocator's share and the {format_bytes(chosen.overhead_bytes)} overhead allowance included)"
        )
    elif chosen.reason:
        parts.append(f": {chosen.reason}")
    if chosen.dominant:
        parts.append(f". Its peak is {chosen.dominant}")
    if largest is not None and batch_size is not None:
        parts.append(
            f". The largest batch a plan fits is {largest} (this one: {batch_size})" if largest
            else ". Not even a batch of 1 fits"
        )  # fmt: skip
    if chunked_loss:
        parts.append(f". {chunked_loss}")
    parts.append(". Training stopped before this batch's forward: lower the batch size, or raise device_budget.")
    return "".join(parts)


def twins(blocks: Mapping[str, BlockMemory]) -> dict[str, tuple[str, ...]]:
    """Each block's group of twins, itself included: repeated blocks of one class whose forwards are
    priced alike and save the same bytes compute alike (the first one's backward may differ by an op
    or two: the forward is what the block clock times); any other block is a group of its own."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, block in blocks.items():
        repeated = block.repeated and block.kind
        key = (block.kind, float(f"{block.forward_s:.12g}"), block.saved_bytes) if repeated else (name,)
        groups.setdefault(key, []).append(name)
    return {name: tuple(group) for group in groups.values() for name in group}


class AutoPlan:
    """The plan state of one fit; see the module docstring.

    Args:
        budget_bytes: the device budget every plan of this fit is made for.
        memory: the training device's memory, whose allocator peaks are checked against the
            prediction (None: not checked, e.g. a CPU device with a given ``device_budget``).
        budget_source: how the budget was measured, for the fit-start line (None: it was given).
        plan_overhead_bytes: what the plans set aside within the budget (None: the planner's
            default, for a given budget).
        speeds: the training device's speeds, measured at fit start (None: the planner's
            ``gpu="auto"``).
        peaks_reset: measuring them raised the allocator's peaks, which were then reset.
    """

    def __init__(
        self, budget_bytes: int, memory: DeviceMemory | None, budget_source: str | None = None,
        plan_overhead_bytes: int | None = None, speeds: DeviceSpeeds | None = None, peaks_reset: bool = False,
    ) -> None:  # fmt: skip
        self.budget_bytes = budget_bytes
        self.memory = memory
        self.budget_source = budget_source
        self.plan_overhead_bytes = plan_overhead_bytes
        """The ``overhead_bytes`` every plan of this fit is made with (None: the planner's default)."""
        self.speeds = speeds
        """What the plans price steps at (measured at fit start, or corrected by measured steps)."""
        self.peaks_reset = peaks_reset
        """Measuring the speeds raised the allocator's peaks, so lightmem reset them (``measured_speeds``)."""
        self.plan: Plan | None = None
        """The plan applied now (the last one made)."""
        self.planned_shapes: Shapes | None = None
        self.predicted_peak_bytes = 0
        """The highest allocated peak the plans applied in this fit predict (``Plan.predicted_peak_bytes``)."""
        self.predicted_reserved_bytes = 0
        """The highest reserved peak they predict (``Plan.predicted_reserved_bytes``; for a mixture of
        experts its worst-case routing's, ``Plan.routing_bound_bytes``)."""
        self.worst_ratio: float | None = None
        """The highest measured / predicted reserved peak over the training batches so far."""
        self.training_peak_bytes = 0
        """The highest the allocator's peak rose to within this fit's training batches (0: none raised it)."""
        self.training_reserved_bytes = 0
        """The same for its reserved peak."""
        self.tighter_by_bytes = 0
        """How far the budget the next plans are made for is below ``budget_bytes``: the overshoots
        of the reserved peak measured so far."""
        self.looser_by_bytes = 0
        """How far it is above: half of what a plan's reserved peak stayed under its prediction
        (``_loosen``), once per fit."""
        outside = outside_bytes(memory) if memory is not None else 0
        overhead = plan_overhead_bytes if plan_overhead_bytes is not None else parse_overhead(None, "cuda", flag="overhead_bytes")
        self.outside_allowed_bytes = overhead + (outside if budget_source is not None else 0)
        """What the device may hold outside the caching allocator before plans are made tighter: the
        overhead they set aside (and, for a measured budget, what was outside it when measured), raised
        to what it was measured to hold past that."""
        self._outside_allowed_at_start = self.outside_allowed_bytes
        self._retries_at_plan = 0
        self.replan_reason: str | None = None
        """Why the current plan is to be replaced before the next batch (None: it stands)."""
        self.step_times_s: list[float] = []
        """Device seconds of the steps timed since the current plan was applied (its first not counted)."""
        self._first_step_of_plan = True
        self.block_times_s: dict[str, list[float]] = {}
        """Each block's forward seconds in the steps timed since the current plan was applied."""
        self._steps_of_plan = 0
        self._block_timer: BlockTimer | None = None
        self._peak_before_batch = 0
        self._reserved_before_batch = 0
        self._warned = False
        self._clock: Any = None
        self._follow_up = False

    @classmethod
    def at_fit_start(
        cls, settings: PlanSettings, device: torch.device, world_size: int, measure_speeds: bool = True
    ) -> AutoPlan:
        """The given ``device_budget``, or the device's measured now (then the plans set aside only
        what the measure could not see: ``overhead_for_measured_budget``); and the device's speeds.

        Raises:
            ValueError: no ``device_budget`` and the training device is not a CUDA device (nothing
                to measure): the message says what to pass.
        """
        memory = training_device_memory(device)
        speeds, peaks_reset = measured_speeds(memory) if memory is not None and measure_speeds else (None, False)
        if settings.device_budget_bytes is not None:
            overhead = overhead_for_given_budget(memory, parse_overhead(None, "cuda", flag="overhead_bytes"))
            return cls(settings.device_budget_bytes, memory, plan_overhead_bytes=overhead, speeds=speeds, peaks_reset=peaks_reset)
        memory = memory_to_measure(
            device, flag=settings.flag("plan"), budget_flag="device_budget", subject="'auto'",
            device_named="the training device",
            example=f"{settings.spelling.entry}(plan='auto', device_budget='20GiB')",
        )  # fmt: skip
        budget = measure_device_budget(memory)
        return cls(
            budget.budget_bytes, memory, budget.describe(), overhead_for_measured_budget(world_size), speeds=speeds,
            peaks_reset=peaks_reset,
        )  # fmt: skip

    @property
    def planning_budget_bytes(self) -> int:
        """The budget the next plan is made for: ``budget_bytes`` less the overshoots measured, plus
        what a plan was measured to leave unused (``looser_by_bytes``)."""
        return self.budget_bytes - self.tighter_by_bytes - self.outside_grown_bytes + self.looser_by_bytes

    @property
    def outside_grown_bytes(self) -> int:
        """What the device's memory outside the allocator grew by past what the plans set aside."""
        return self.outside_allowed_bytes - self._outside_allowed_at_start

    def needs_plan(self, batch: Any) -> bool:
        """True for the first batch, for any batch the current plan does not cover, and after a
        measured overshoot."""
        return (
            self.planned_shapes is None
            or self.replan_reason is not None
            or not covers(self.planned_shapes, batch_shapes(batch))
        )

    def shapes_to_plan_for(self, batch: Any) -> Shapes:
        """What the next plan is made for: ``batch`` and every batch planned for so far."""
        return shapes_covering(self.planned_shapes, batch_shapes(batch))

    def unplanned(self, shapes: Shapes | None) -> None:
        """Batches of ``shapes`` train without a new plan (the dry run could not trace their step):
        they are not planned for again; None (no batch was seen) plans at the next batch."""
        if shapes is not None:
            self.planned_shapes = shapes if self.planned_shapes is None else shapes_covering(self.planned_shapes, shapes)
            self.replan_reason = None

    def take(self, chosen: Plan, shapes: Shapes, module: nn.Module | None = None) -> None:
        """``chosen``, made for batches of ``shapes``, is applied from the current batch on; with
        ``module`` (the model it was made for) and a device that times blocks, the blocks it priced
        are timed in its first steps."""
        # A plan made again at new prices that chose the same configuration changes nothing on the
        # device: its first step pays no warm-up, and one step tells whether the new prices hold.
        self._follow_up = self.plan is not None and self.plan.lightmem_kwargs() == chosen.lightmem_kwargs()
        self.plan, self.planned_shapes = chosen, shapes
        self.predicted_peak_bytes = max(self.predicted_peak_bytes, chosen.predicted_peak_bytes)
        # A mixture of experts is held to its worst-case routing: a batch routed unevenly reaches past the balanced peak.
        self.predicted_reserved_bytes = max(self.predicted_reserved_bytes, chosen.predicted_reserved_bytes, chosen.routing_bound_bytes)
        self.replan_reason = None
        self.step_times_s = []
        self._first_step_of_plan = not self._follow_up
        self.block_times_s = {}
        self._steps_of_plan = 0
        self._retries_at_plan = self.memory.alloc_retries() if self.memory is not None else 0
        self.remove_block_timer()
        if module is not None and self.memory is not None and self.speeds is not None:
            self._time_blocks(module, chosen)

    def _time_blocks(self, module: nn.Module, chosen: Plan) -> None:
        clock = self.memory.block_clock() if self.memory is not None else None
        if clock is None or chosen.estimate is None or holds_compiled_modules(module):
            return
        intervals = self._forward_intervals(chosen)
        names = [
            block.name for block in chosen.estimate.blocks.values()
            if block.name != ROOT_BLOCK and block.forward_s > 0 and block.name in intervals
            and intervals[block.name].seconds >= BLOCK_TIMING_MIN_S
            and chosen.actions.get(block.name, KEEP) in (KEEP, CHECKPOINT)
        ]  # fmt: skip
        if names:
            self._block_timer = BlockTimer(module, names, clock)

    def remove_block_timer(self) -> None:
        """Take the block timer's hooks off the model (at the end of the plan's timed steps, a new
        plan, or the end of the fit)."""
        if self._block_timer is not None:
            self._block_timer.remove()
            self._block_timer = None

    def forward_done(self) -> None:
        """The batch's forward has ended: backward's re-runs of checkpointed blocks are not timed."""
        if self._block_timer is not None:
            self._block_timer.active = False

    def batch_start(self) -> None:
        """Right before a training batch's forward: the allocator's peaks so far, which only a rise
        within the batch gets past; the batch's clock starts."""
        if self.memory is not None:
            self._peak_before_batch = self.memory.peak_allocated_bytes()
            self._reserved_before_batch = self.memory.peak_reserved_bytes()
            if self._clock is None:
                self._clock = self.memory.step_clock()
            if self._clock is not None:
                self._clock.start()
        if self._block_timer is not None:  # the steps the step clock times, the first not counted
            self._block_timer.active = self._block_timer.timing = 1 <= self._steps_of_plan <= TIMED_STEPS

    def measured_peak_bytes(self) -> int:
        return self.training_peak_bytes

    def measured_reserved_bytes(self) -> int:
        return self.training_reserved_bytes

    def measured_step_s(self) -> float:
        """The median of the steps timed since the plan was applied (0: none yet)."""
        return statistics.median(self.step_times_s) if self.step_times_s else 0.0

    def check(self, step: int, batch: Any, rank: int | None = None) -> None:
        """After a training batch: the worst ratio so far; one warning the first time the measured
        reserved peak exceeds the prediction by more than ``REPLAN_MARGIN``, which also asks for a
        tighter plan before the next batch; and the step time held against the prediction.
        ``rank``: named in the warning (each rank warns of its own device); None with one process."""
        if self.memory is None or self.plan is None:
            return
        peak = self.memory.peak_allocated_bytes()
        if peak > self._peak_before_batch:
            self.training_peak_bytes = max(self.training_peak_bytes, peak)
        reserved = self.memory.peak_reserved_bytes()
        if reserved > self._reserved_before_batch:
            self.training_reserved_bytes = max(self.training_reserved_bytes, reserved)
        self._steps_of_plan += 1
        self._read_block_times()
        if self._clock is not None:
            seconds = self._clock.stop()
            if seconds is not None:
                self._time_step(seconds)
        where = f"step {step}" if rank is None else f"step {step} on rank {rank}"
        self._hold_outside(where)
        predicted, measured = self.predicted_reserved_bytes, self.training_reserved_bytes
        if not measured or predicted <= 0:
            return
        ratio = measured / predicted
        self.worst_ratio = ratio if self.worst_ratio is None else max(self.worst_ratio, ratio)
        if ratio < 1 - REPLAN_MARGIN:
            self._loosen(measured, predicted)
        if ratio <= 1 + REPLAN_MARGIN or measured - predicted <= self.tighter_by_bytes:
            return
        self.tighter_by_bytes = measured - predicted
        self.replan_reason = (
            f"the reserved peak measured at {where}, {format_bytes(measured)}, passed the predicted "
            f"{format_bytes(predicted)} by more than {REPLAN_MARGIN:.0%}: planned again for a budget "
            f"{format_bytes(self.tighter_by_bytes)} smaller"
        )
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"lightmem: at {where} (batch shape {format_shapes(batch_shapes(batch))}) the device's peak "
                f"reserved memory, {format_bytes(measured)}, exceeds the peak plan='auto' predicted, "
                f"{format_bytes(predicted)}, by more than {REPLAN_MARGIN:.0%}: the next batch is planned again "
                f"for a budget {format_bytes(self.tighter_by_bytes)} smaller.",
                stacklevel=2,
            )

    def _hold_outside(self, where: str) -> None:
        """What the device holds outside the allocator (the context grows as libraries load their
        kernels in the first steps) against what the plans set aside: past it, the next batch is
        planned for a budget smaller by the growth."""
        assert self.memory is not None
        outside = outside_bytes(self.memory)
        if outside <= self.outside_allowed_bytes + OVERHEAD_GRAIN_BYTES:
            return
        grown = outside - self.outside_allowed_bytes
        self.outside_allowed_bytes = outside
        self.replan_reason = (
            f"the device's memory outside the allocator measured at {where}, {format_bytes(outside)}, passed the "
            f"{format_bytes(outside - grown)} set aside: planned again for a budget {format_bytes(grown)} smaller"
        )

    def _loosen(self, measured: int, predicted: int) -> None:
        """Upward: once the plan's first steps are timed, a reserved peak under the prediction by more
        than ``REPLAN_MARGIN``, reached without an allocator retry (so the allocator's own high, not
        one held under a limit), leaves room: the next batch is planned for a budget larger by half of
        it, once per fit (a plan that then passes its prediction is planned tighter again)."""
        assert self.memory is not None and self.plan is not None
        if self.looser_by_bytes or self.replan_reason is not None or self._steps_of_plan != TIMED_STEPS + 1:
            return
        if not (self.plan.checkpoint or self.plan.offload is not None or self.plan.tile) or self.memory.alloc_retries() > self._retries_at_plan:
            return  # nothing to take back, or a peak held under a limit
        if self.plan.routing_bound_bytes:
            return  # under its worst-case routing's bound: a later batch may route as unevenly as the bound assumes
        self.looser_by_bytes = (predicted - measured) // 2
        self.replan_reason = (
            f"the reserved peak measured over the plan's first steps, {format_bytes(measured)}, is under the predicted "
            f"{format_bytes(predicted)} by more than {REPLAN_MARGIN:.0%} with no allocator retry: planned again for a "
            f"budget {format_bytes(self.looser_by_bytes)} larger"
        )

    def _read_block_times(self) -> None:
        """After a batch: end the block clock's step and take every step it has finished timing;
        once all are in (or the timed steps are past) the blocks are held to their prices and the
        hooks come off."""
        timer = self._block_timer
        if timer is None:
            return
        if timer.timing:
            timer.active = timer.timing = False
            timer.clock.end_step()
        while (seconds := timer.clock.read()) is not None:
            for name, value in seconds.items():
                self.block_times_s.setdefault(name, []).append(value)
        complete = self.block_times_s and all(len(times) >= TIMED_STEPS for times in self.block_times_s.values())
        if complete or self._steps_of_plan > TIMED_STEPS + 1:
            if self.replan_reason is None:
                self._reprice_blocks()
            self.remove_block_timer()

    def _forward_intervals(self, chosen: Plan) -> dict[str, ForwardInterval]:
        """Each block's forward interval as ``chosen`` prices it (its costs; the fit's block scale),
        what a pair of CUDA events around the block times; none for a plan not searched."""
        if chosen.estimate is None or chosen.costs is None or self.speeds is None:
            return {}
        costs = replace(chosen.costs, block_scale=dict(self.speeds.block_scale))
        return forward_intervals(chosen.estimate.blocks, chosen.actions, costs)

    def _reprice_blocks(self) -> None:
        """Hold each timed block's median forward against its priced interval on the step's
        timeline (``forward_intervals``); those off by more than ``REPLAN_MARGIN`` are priced as
        measured from now on, and the next batch planned again.

        What an interval measures is what bounds it: a block the host launches slower than the
        device runs it times the host. So a block priced as bound by its compute has its compute
        priced as measured (``DeviceSpeeds.block_scale``), one priced as bound by the host's
        launches prices the host's (``host_op_s``: one host launches every block, so the median of
        those blocks' paces); and either bound priced above what was measured comes down to it.

        Twins (``twins``: repeated blocks of one class priced alike) compute alike, so they are
        held together: their timed members' median over the price is the pace of every one of
        them, those the plan did not time included (offloaded ones, whose forward may wait for the
        link). Priced one by one, identical blocks measured in some positions and not in others
        would look different to the planner, which would move its work to the ones measured
        cheaper (likely why the H100's third run re-planned a GPT's batch onto blocks 3-4 and 9-15,
        105.0 ms a step, where the second run's plan, blocks 0-8, measured 87.1 ms)."""
        assert self.plan is not None
        if self.speeds is None or not self.block_times_s or self.plan.estimate is None:
            return
        blocks = self.plan.estimate.blocks
        intervals = self._forward_intervals(self.plan)
        timed: dict[str, tuple[float, float]] = {}  # name -> (measured, priced now)
        for name, times in self.block_times_s.items():
            if name in intervals and blocks[name].forward_s > 0:
                timed[name] = (statistics.median(times), intervals[name].seconds)
        groups = twins(blocks)
        off: dict[str, tuple[float, float]] = {}  # a timed block of each group off its price
        new_scale: dict[str, float] = {}
        host_scales: list[float] = []
        for group in dict.fromkeys(groups[name] for name in timed):
            members = [name for name in group if name in timed]
            ratio = statistics.median(timed[name][0] / timed[name][1] for name in members)
            if abs(ratio - 1) <= REPLAN_MARGIN:
                continue
            paces = []
            for name in members:
                measured, interval = timed[name][0], intervals[name]
                scale = self.speeds.block_scale.get(name, 1.0)  # under the host's launches: not known off
                if not interval.host_bound or interval.device_s > measured:
                    scale = measured / blocks[name].forward_s
                paces.append(scale)
                if interval.host_bound or interval.host_s > measured:
                    # The host's lead over the block before is taken as priced.
                    host_scales.append((measured + interval.launch_s - interval.host_s) / interval.launch_s)
            pace = min(max(statistics.median(paces), 0.2), 5.0)
            if any(pace != self.speeds.block_scale.get(name, 1.0) for name in group):
                new_scale.update(dict.fromkeys(group, pace))
            # A median off the margin has a member off it too: the reason names the worst.
            off.update((name, timed[name]) for name in members if abs(timed[name][0] / timed[name][1] - 1) > REPLAN_MARGIN)
        host_scale = min(max(statistics.median(host_scales), 0.2), 5.0) if host_scales else 1.0
        if not off or (not new_scale and host_scale == 1.0):  # nothing to price anew (at a clamp)
            return
        changed = []
        if new_scale:
            self.speeds = self.speeds.with_block_scale(new_scale, f"{len(new_scale)} block(s) priced at their measured forward")
            changed.append("each block's compute")
        if host_scale != 1.0:
            self.speeds = self.speeds.with_host_scale(host_scale, f"the host's launches x{host_scale:.2f} as blocks measured")
            changed.append("the host's launches")
        worst = max(off, key=lambda name: max(off[name][0] / off[name][1], off[name][1] / off[name][0]))
        measured, priced = off[worst]
        others = f" and {len(off) - 1} more off by more than {REPLAN_MARGIN:.0%}" if len(off) > 1 else ""
        untimed = sum(name not in timed for name in new_scale)
        alike = f"; {untimed} untimed twin(s) priced alike" if untimed else ""
        host = f" (x{host_scale:.2f})" if host_scale != 1.0 else ""
        self.replan_reason = (
            f"block {worst}'s forward measured {format_seconds(measured)}, {measured / priced:.2f}x its priced "
            f"{format_seconds(priced)}{others}{alike}: planned again with {' and '.join(changed)} priced as measured{host}"
        )

    def _time_step(self, seconds: float) -> None:
        """One step's device time. The first after a plan pays warm-ups and is not counted; once
        ``TIMED_STEPS`` are timed their median is held against the prediction, and after that the
        median of the last ``TIMED_STEPS`` at every step (warm-ups that outlast the first step hide
        the steady pace from the first check). A plan made again at new prices that kept its
        configuration is held to the next step already (no warm-up to wait out): prices set from
        steps that were still warming up (GPT-2 on the H200: 70-78 ms, then 61 ms from the fourth
        step on) are corrected a step later, not three."""
        assert self.plan is not None
        if self._first_step_of_plan:
            self._first_step_of_plan = False
            return
        self.step_times_s.append(seconds)
        steps = FOLLOW_UP_STEPS if self._follow_up else TIMED_STEPS
        if len(self.step_times_s) < steps or self.speeds is None or self.plan.step_seconds <= 0:
            return
        if self.replan_reason is not None:  # the blocks' times have asked for it already
            return
        measured, predicted = statistics.median(self.step_times_s[-TIMED_STEPS:]), self.plan.step_seconds
        if abs(measured / predicted - 1) <= REPLAN_MARGIN:
            return
        # The machine runs at another pace than priced: the device's compute and the host's launches
        # alike (a step bound by either is then priced as measured); what the link adds is as priced.
        added = self.plan.exposed_transfer_s
        pace = max(predicted - added, 1e-9) / max(measured - added, 1e-9)
        pace = min(max(pace, 0.2), 5.0)
        self.speeds = self.speeds.with_pace(pace, f"compute and host paced x{pace:.2f} by the measured step")
        self.replan_reason = (
            f"the measured step, {format_seconds(measured)}, is {measured / predicted:.2f}x the predicted "
            f"{format_seconds(predicted)}: planned again with the device's compute and the host's launches priced at "
            "the measured pace"
        )
