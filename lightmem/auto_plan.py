"""``LightMem(plan="auto")`` over one fit: its budget, when a batch needs a new plan, and whether
the plans' predicted peak held.

The budget is ``device_budget`` or, without it, what the training device can give this process,
measured once at fit start (:func:`lightmem.device_memory.measure_device_budget`). A plan covers the
batch it was made for and every batch no larger in any dimension of any tensor; a batch it does not
cover is planned for before its forward, together with every batch planned for so far: the next
plan is made for the elementwise maximum of their shapes, so batches that take turns (a
token-bucketed loader's [4, 33] and [8, 17]) are planned for once, as [8, 33], not at every turn.

After each training batch the peak it measured is compared with the highest peak the plans of this
fit predict: both are highs of the fit's training batches so far, so a plan for a small batch is
never held against the peak a larger one reached. The allocator's peak (``max_memory_allocated``)
is a high of the whole process, which lightmem never resets; a training batch is measured when it
raises that high, so what an earlier fit or a validation batch reached is never counted. A batch
that stays under such an earlier high is not seen: until a training batch raises it, nothing is
measured (0 logged, no ratio, no warning).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightmem.config import PlanSettings, format_bytes
from lightmem.device_memory import (
    FRAGMENTATION_MARGIN,
    DeviceMemory,
    measure_device_budget,
    memory_to_measure,
    overhead_for_measured_budget,
    training_device_memory,
)
from lightmem.estimate import Plan
from lightmem.estimate.batch import batch_shapes

Shapes = tuple[tuple[int, ...], ...]


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


class AutoPlan:
    """The plan state of one fit; see the module docstring.

    Args:
        budget_bytes: the device budget every plan of this fit is made for.
        memory: the training device's memory, whose allocator peak is checked against the
            prediction (None: not checked, e.g. a CPU device with a given ``device_budget``).
        budget_source: how the budget was measured, for the fit-start line (None: it was given).
        plan_overhead_bytes: what the plans set aside within the budget (None: the planner's
            default, for a given budget).
    """

    def __init__(
        self, budget_bytes: int, memory: DeviceMemory | None, budget_source: str | None = None,
        plan_overhead_bytes: int | None = None,
    ) -> None:  # fmt: skip
        self.budget_bytes = budget_bytes
        self.memory = memory
        self.budget_source = budget_source
        self.plan_overhead_bytes = plan_overhead_bytes
        """The ``overhead_bytes`` every plan of this fit is made with (None: the planner's default)."""
        self.plan: Plan | None = None
        """The plan applied now (the last one made)."""
        self.planned_shapes: Shapes | None = None
        self.predicted_peak_bytes = 0
        """The highest peak the plans applied in this fit predict (``Plan.predicted_peak_bytes``)."""
        self.worst_ratio: float | None = None
        """The highest measured / predicted peak over the training batches so far."""
        self.training_peak_bytes = 0
        """The highest the allocator's peak rose to within this fit's training batches (0: none raised it)."""
        self._peak_before_batch = 0
        self._warned = False

    @classmethod
    def at_fit_start(cls, settings: PlanSettings, device: torch.device, world_size: int) -> AutoPlan:
        """The given ``device_budget``, or the device's measured now (then the plans set aside only
        what the measure could not see: ``overhead_for_measured_budget``).

        Raises:
            ValueError: no ``device_budget`` and the training device is not a CUDA device (nothing
                to measure): the message says what to pass.
        """
        if settings.device_budget_bytes is not None:
            return cls(settings.device_budget_bytes, training_device_memory(device))
        memory = memory_to_measure(
            device, flag=settings.flag("plan"), budget_flag="device_budget", subject="'auto'",
            device_named="the training device",
            example=f"{settings.spelling.entry}(plan='auto', device_budget='20GiB')",
        )  # fmt: skip
        budget = measure_device_budget(memory)
        return cls(budget.budget_bytes, memory, budget.describe(), overhead_for_measured_budget(world_size))

    def needs_plan(self, batch: Any) -> bool:
        """True for the first batch and for any batch the current plan does not cover."""
        return self.planned_shapes is None or not covers(self.planned_shapes, batch_shapes(batch))

    def shapes_to_plan_for(self, batch: Any) -> Shapes:
        """What the next plan is made for: ``batch`` and every batch planned for so far."""
        return shapes_covering(self.planned_shapes, batch_shapes(batch))

    def take(self, chosen: Plan, shapes: Shapes) -> None:
        """``chosen``, made for batches of ``shapes``, is applied from the current batch on."""
        self.plan, self.planned_shapes = chosen, shapes
        self.predicted_peak_bytes = max(self.predicted_peak_bytes, chosen.predicted_peak_bytes)

    def batch_start(self) -> None:
        """Right before a training batch's forward: the allocator's peak so far, which only a rise
        within the batch gets past."""
        if self.memory is not None:
            self._peak_before_batch = self.memory.peak_allocated_bytes()

    def measured_peak_bytes(self) -> int:
        return self.training_peak_bytes

    def check(self, step: int, batch: Any, rank: int | None = None) -> None:
        """After a training batch: the worst ratio so far, and one warning the first time the
        measured peak exceeds the prediction by more than ``FRAGMENTATION_MARGIN`` of it (the margin
        the budget leaves for the allocator). ``rank``: named in the warning (each rank warns of its
        own device); None with one process."""
        if self.memory is None or self.plan is None or self.predicted_peak_bytes <= 0:
            return
        peak = self.memory.peak_allocated_bytes()
        if peak > self._peak_before_batch:
            self.training_peak_bytes = max(self.training_peak_bytes, peak)
        measured = self.training_peak_bytes
        if not measured:
            return
        ratio = measured / self.predicted_peak_bytes
        self.worst_ratio = ratio if self.worst_ratio is None else max(self.worst_ratio, ratio)
        if ratio > 1 + FRAGMENTATION_MARGIN and not self._warned:
            self._warned = True
            where = f"step {step}" if rank is None else f"step {step} on rank {rank}"
            warnings.warn(
                f"lightmem: at {where} (batch shape {format_shapes(batch_shapes(batch))}) the device's peak "
                f"allocated memory, {format_bytes(measured)}, exceeds the peak plan='auto' predicted, "
                f"{format_bytes(self.predicted_peak_bytes)}, by more than the {FRAGMENTATION_MARGIN:.0%} "
                "margin left for the allocator's fragmentation: the plan may not hold on this device; a lower "
                "device_budget leaves more room.",
                stacklevel=2,
            )
