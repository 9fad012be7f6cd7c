"""What the planner knows of one configuration's verified step (``Verified``), and the small rules
its search applies to those figures: the bytes a step must lose, model-state offload's link time,
the offload windows' cap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightmem.config import OffloadSettings
from lightmem.estimate.host import HostBytes
from lightmem.estimate.planning.families import planned_blocks
from lightmem.estimate.pricing.costs import Costs
from lightmem.estimate.report import MemoryEstimate
from lightmem.estimate.settings import EstimateSettings
from lightmem.estimate.words import policy_name
from lightmem.estimate.trace.records import RoutingBound, held_bytes, reserved_or_peak, runs_within


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
    reserve: Any = field(default=None, compare=False, repr=False)
    """What the allocator must be able to reserve for the step (``StepTrace.reserve``; None: the peak)."""
    routing_bound: RoutingBound | None = field(default=None, compare=False, repr=False)
    """For a mixture-of-experts step: the step under the worst-case routing (``StepTrace.routing_bound``),
    which must fit too; None: the step routes nothing."""
    host: HostBytes = field(default_factory=HostBytes, compare=False)
    """What the step holds on the host (``lightmem.estimate.host``)."""

    @property
    def reserved_bytes(self) -> int:
        """What the allocator must be able to reserve for the step (balanced routing)."""
        return reserved_or_peak(self.reserve, self.peak_bytes)

    @property
    def held_bytes(self) -> int:
        """What a budget must hold for the step (for a mixture of experts, its worst-case routing's
        where that is higher)."""
        return held_bytes(self.reserved_bytes, self.routing_bound)

    def runs_within(self, available_bytes: int) -> bool:
        """Whether the step runs with ``available_bytes`` reservable (one replay, not the bisection
        ``held_bytes`` runs), under the worst-case routing too for a mixture-of-experts step."""
        bound = self.routing_bound
        return runs_within(self.reserve, self.peak_bytes, available_bytes) and (
            bound is None or bound.reserve.fits(available_bytes)
        )


def window_cap(base: MemoryEstimate, settings: EstimateSettings) -> int | None:
    """The most an offload window need hold (``sized_windows``): one layer's share of what the budget
    leaves for activations, or, where that is less, one layer's input (what a checkpointed, offloaded
    layer sends); None without a budget."""
    if not settings.budget_bytes:
        return None
    layers = list(planned_blocks(base.blocks).values())
    room = settings.budget_bytes - settings.overhead_bytes - base.static_bytes
    inputs = sorted(block.input_bytes for block in layers)
    return max(room // max(len(layers), 1), inputs[len(inputs) // 2] if inputs else 0)


def searched_under(
    settings: EstimateSettings, costs: Costs, offload: OffloadSettings | None, tile_candidates: list[str]
) -> dict[str, Any]:
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
        "tile_candidates": list(tile_candidates),
        "host_limit_bytes": settings.host.bytes,
    }
