"""What the tracer records of a fake step: one record per storage with its role, the peak and
where it is, the window of the measured step, and the step's device requests in the allocator's
order (``StepAllocations``, what ``device.caching_allocator`` replays)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALLOCATE, FREE, FREE_PREVIOUS = 0, 1, 2
"""Event kinds of ``StepAllocations.events``."""


@dataclass(frozen=True)
class StepAllocations:
    """One traced step's device requests in the order the allocator sees them.

    ``events`` are ``(kind, value)``: ``ALLOCATE`` / ``FREE`` of slot ``value`` (its bytes in
    ``sizes``), or ``FREE_PREVIOUS`` of a gradient of ``value`` bytes made by the step before.
    """

    persistent: tuple[int, ...]
    """Requests made before training and never freed: parameters, buffers, cuBLAS workspaces."""
    state: tuple[int, ...]
    """The optimizer's state: created in the first step's optimizer step, then kept."""
    state_at: int
    """Index in ``events`` where the optimizer step starts (``len(events)``: at the step's end)."""
    inputs: tuple[int, ...]
    """The batch: allocated before each step, freed after it."""
    sizes: tuple[int, ...]
    events: tuple[tuple[int, int], ...]
    carried: frozenset[int]
    """Slots alive at the step's end that the next step frees as its previous gradients."""

    @property
    def requested_peak_bytes(self) -> int:
        """The highest sum of live requests over the replay's steady step (a lower bound of any cap)."""
        live = sum(self.persistent) + sum(self.state) + sum(self.inputs)
        live += sum(self.sizes[slot] for slot in self.carried)
        peak = live
        for kind, value in self.events:
            if kind == ALLOCATE:
                live += self.sizes[value]
                peak = max(peak, live)
            elif kind == FREE:
                live -= self.sizes[value]
            else:
                live -= value
        return peak


CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "workspaces")


# Roles a storage can start with; "other" is anything allocated by an op.
PARAMETER, BUFFER, INPUT, GRADIENT, STATE, OTHER = range(6)


OpStep = tuple[Any, tuple[int, ...], tuple[Any, ...]]
"""One op of the forward as the trace keeps it: (the op, the record id of each tensor it read (-1: a
tensor the trace never saw made), its plain number arguments): what made a tensor, read back by
``lightmem.estimate.trace.op_chain``."""


@dataclass(slots=True)
class StorageRecord:
    """One device allocation (a storage) of the traced step."""

    nbytes: int
    """Bytes as the allocator hands them out (its block size on CUDA)."""
    role: int
    alloc_event: int
    grad_at: int = -1
    """Event index from which the storage is a parameter's ``.grad`` (-1: never)."""
    saved_at: int = -1
    """Event index at which autograd first saved it for backward (-1: never)."""
    saved_block: str | None = None
    saved_shape: tuple[int, ...] | None = None
    freed: bool = False
    recomputed: bool = False
    """Allocated by a forward re-run during backward (activation checkpointing)."""
    last_dim: int = 0
    """Size of the last dimension of the tensor the storage was first seen as (0: a scalar)."""
    requested: int = 0
    """Bytes the storage asked for (``nbytes`` is what the allocator hands out for it)."""
    known: Any = None
    """What the dry run assumes of the storage's values (``lightmem.estimate.trace.values.Known``), if anything."""
    made_by: OpStep | None = None
    """In forward: the op whose output the storage is (None: not made by an op of the forward)."""
    changed_by: list[OpStep] | None = None
    """In forward: the in-place ops that wrote the storage after it was made, in order."""


@dataclass(slots=True)
class PeakInfo:
    """Where and what the highest point of the measured step is."""

    bytes: int
    breakdown: dict[str, int]
    phase: str
    op: str
    block: str | None
    event: int
    inputs_bytes: int = 0
    buffers_bytes: int = 0


@dataclass
class TraceWindow:
    start: int = 0
    end: int = 0
    forward_end: int = 0


@dataclass(frozen=True)
class RoutingBound:
    """The step again under the worst-case routing (``StepRequest.routing="worst"``: each expert's rows
    as many as a routing can give it, every row for the first top-k asked for and one for each other,
    ``lightmem.estimate.trace.values.Routing``): a bound on its transient peak, where the step itself assumes
    balanced routing (each expert rows x top-k / experts)."""

    peak: PeakInfo
    reserve: Any
    """What the allocator must be able to reserve for it (``device.caching_allocator.Reserve``)."""

    @property
    def peak_bytes(self) -> int:
        return self.peak.bytes

    @property
    def reserved_bytes(self) -> int:
        """What the allocator must be able to reserve for the worst-case step (CPU: its peak)."""
        return self.reserve.bytes


def reserved_or_peak(reserve: Any, peak_bytes: int) -> int:
    """What the device's allocator must be able to reserve for a step whose allocated peak is
    ``peak_bytes``: its requests' replay (``device.caching_allocator.Reserve``: the least cap it
    runs under; a CPU step's is its peak), or the peak where nothing was replayed (a report made by
    hand). The one home of this rule."""
    return reserve.bytes if reserve is not None else peak_bytes


def runs_within(reserve: Any, peak_bytes: int, available_bytes: int) -> bool:
    """Whether a step runs with ``available_bytes`` reservable: one replay under that cap
    (``Reserve.fits``), not the bisection ``reserved_or_peak`` runs; the peak where nothing was replayed."""
    return reserve.fits(available_bytes) if reserve is not None else peak_bytes <= available_bytes


def held_bytes(reserved_bytes: int, routing_bound: RoutingBound | None) -> int:
    """What a budget must hold for a step that reserves ``reserved_bytes``: that, or for a mixture of
    experts (``routing_bound``) what its worst-case routing reserves where that is higher."""
    return reserved_bytes if routing_bound is None else max(reserved_bytes, routing_bound.reserved_bytes)
