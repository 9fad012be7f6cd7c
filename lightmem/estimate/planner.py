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
- ``offload everywhere``: every saved tensor offloaded, then repeated layers checkpointed too;
- ``tile``: position-wise modules (read from the trace: ``lightmem.estimate.position_wise``) run
  in sequence shards one by one, cheapest per byte first, then, with every one tiled, the per-block
  actions on top (within a checkpointed block, tiling its MLP keeps the MLP's intermediates out of
  the re-run too), ending with everything tiled, every layer checkpointed and offloaded.

Predictions (the bytes each action saves) only order a family and say where to start looking.
Whether a configuration fits is decided by the estimator's verified fake step, never by the
prediction: from the first configuration whose predicted savings cover the need, verified steps
gallop down while it fits or up (to the family's extreme) until it does, then bisect, which finds
the first configuration that fits. Among it and every configuration after it, and across
families, the one with the least predicted step time (:mod:`lightmem.estimate.step_time`) is
chosen, verified before it is taken. So whenever a family's extreme fits (every repeated layer
checkpointed, with or without offload) or offload alone fits, the plan fits, at a verified peak
within the budget.

Model-state offload (``offload_optimizer``: gradients and optimizer state on the host) is decided
once, before the walks: on when asked for, or when parameters + gradients + optimizer state leave
no room but the parameters alone do. Then every verified step runs with it, the baseline that
decides "already fits" is its step, and its link time (``model_state_transfer_s``) is added to
every configuration's exposed transfer.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.compiled import holds_compiled_modules
from lightmem.config import (
    LIGHTMEM,
    OffloadSettings,
    OptimizerOffloadSettings,
    TileSettings,
    format_bytes,
    parse_count,
)
from lightmem.estimate.advice import advise
from lightmem.estimate.batch import BatchInfo, inspect_batch, sequence_axis
from lightmem.estimate.caching_allocator import Reserve
from lightmem.estimate.chunked_loss import plan_with_chunked_loss
from lightmem.estimate.configuration import (
    EstimateSettings, build_report, costs_for, parse_settings, run_configuration, step_memory_key,
)  # fmt: skip
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.host import HostBytes, HostLimit, host_bytes, host_limit
from lightmem.estimate.report import (
    BlockMemory,
    MemoryEstimate,
    Plan,
    PlanOption,
    compact_modules,
    compact_names,
    natural_order,
    policy_name,
)
from lightmem.estimate.settings import parse_offload, parse_planned_offload
from lightmem.estimate.step import ROOT_BLOCK, EstimateError, StepTrace, as_traced_in_full, dominant_part
from lightmem.estimate.step_time import (
    BOTH,
    CHECKPOINT,
    KEEP,
    OFFLOAD,
    PARTIAL,
    Costs,
    StepTime,
    block_cost_s,
    compute_s,
    configuration_time,
    partial_thresholds,
    recompute_s,
    saves_bytes,
    sized_windows,
    step_time,
    tile_s,
)

__all__ = [
    "BOTH", "CHECKPOINT", "KEEP", "OFFLOAD", "Candidate", "Costs", "PlanSpace", "choose_actions",
    "config_for", "costs_for", "plan", "plan_space", "recompute_s", "saves_bytes", "search_plan",
]  # fmt: skip
_RANK = {KEEP: 0, PARTIAL: 1, OFFLOAD: 2, CHECKPOINT: 3, BOTH: 4}  # a block only moves up this list
KINDS = ("checkpoint", "offload", "checkpoint + offload")
"""The three kinds of configuration the space holds, each searched for every model layout; a
refusal names the closest of each kind."""
TILED_KINDS = tuple(f"tile + {kind}" for kind in ("checkpoint", "offload", "checkpoint + offload"))
"""With position-wise modules to tile, the kinds with tiling: ``"tile"`` alone and ``TILED_KINDS``."""
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


def planned_blocks(blocks: Mapping[str, BlockMemory]) -> dict[str, BlockMemory]:
    """The blocks a plan checkpoints: the repeated layers, or every block of a model without any."""
    repeated = {name: block for name, block in blocks.items() if block.repeated}
    if repeated:
        return repeated
    return {name: block for name, block in blocks.items() if name != ROOT_BLOCK}


def greedy_steps(
    blocks: Mapping[str, BlockMemory],
    costs: Costs,
    start: Mapping[str, str] | None = None,
    checkpoint: bool = True,
) -> list[tuple[str, str]]:
    """Every action upgrade, cheapest per byte saved first, until none saves more.

    Repeated layers (``planned_blocks``) may be checkpointed, offloaded (their largest tensors
    only, or all) or both; with offload allowed, any other block may be offloaded. Free offloads
    (transfer hidden by compute) come first; a block may later move from offload to checkpoint.
    ``checkpoint=False``: offloads only.
    """
    actions = dict(start or {})
    checkpointable = planned_blocks(blocks)
    allowed: dict[str, tuple[str, ...]] = {}
    for name, block in blocks.items():
        offloads = (PARTIAL, OFFLOAD) if costs.partial.get(name, (0, 0))[1] else (OFFLOAD,)
        if name in checkpointable and checkpoint:
            allowed[name] = (*offloads, CHECKPOINT, BOTH) if costs.allow_offload else (CHECKPOINT,)
        elif costs.allow_offload and name != ROOT_BLOCK:
            allowed[name] = offloads
    steps: list[tuple[str, str]] = []
    while True:
        best: tuple[float, int, list[object], str, str] | None = None
        for name, options in allowed.items():
            block, current = blocks[name], actions.get(name, KEEP)
            for action in options:
                if _RANK[action] <= _RANK[current]:
                    continue
                gain = saves_bytes(block, action, costs) - saves_bytes(block, current, costs)
                if gain <= 0:
                    continue
                extra = block_cost_s(block, action, costs) - block_cost_s(block, current, costs)
                key = (max(extra, 0.0) / gain, -gain, natural_order(name), action, name)
                if best is None or key < best:
                    best = key
        if best is None:
            return steps
        name, action = best[4], best[3]
        actions[name] = action
        steps.append((name, action))


def choose_actions(
    blocks: Mapping[str, BlockMemory], need_bytes: int, costs: Costs, start: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The first greedy steps whose predicted saving covers ``need_bytes`` (blocks left out are
    kept); possibly short of the need when every step is taken."""
    actions = dict(start or {})
    saved = sum(saves_bytes(blocks[name], action, costs) for name, action in actions.items())
    for name, action in greedy_steps(blocks, costs, actions):
        if saved >= need_bytes:
            break
        saved += saves_bytes(blocks[name], action, costs) - saves_bytes(blocks[name], actions.get(name, KEEP), costs)
        actions[name] = action
    return actions


def config_for(
    actions: Mapping[str, str], min_bytes: int, thresholds: Mapping[str, int] | None = None
) -> tuple[list[str], dict[str, Any] | None]:
    """Map per-block actions onto lightmem flags: checkpoint names and the offload dict (with a
    partial offload, ``include`` maps each block to its threshold: ``thresholds``, 0 for a whole
    block)."""
    checkpoint = [name for name, action in actions.items() if action in (CHECKPOINT, BOTH)]
    offloaded = [name for name, action in actions.items() if action in (OFFLOAD, BOTH, PARTIAL)]
    if not offloaded:
        return checkpoint, None
    if any(actions[name] == PARTIAL for name in offloaded):
        include = {name: (thresholds or {}).get(name, 0) if actions[name] == PARTIAL else 0 for name in offloaded}
        return checkpoint, {"min_bytes": min_bytes, "include": include}
    return checkpoint, {"min_bytes": min_bytes, "include": offloaded}


@dataclass(frozen=True)
class Candidate:
    """One point of the planner's space: blocks checkpointed, blocks offloaded, or everything
    offloaded (``everywhere``: no ``include``, every saved tensor of at least ``min_bytes``)."""

    checkpoint: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    everywhere: bool = False
    partial: frozenset[tuple[str, int]] = frozenset()
    """Blocks whose largest saved tensors only are offloaded: (name, threshold in bytes)."""
    tile: frozenset[str] = frozenset()
    """Position-wise modules run in sequence shards (``LightMem(tile=...)``)."""

    @classmethod
    def from_actions(
        cls, actions: Mapping[str, str], everywhere: bool = False, thresholds: Mapping[str, int] | None = None,
        tile: frozenset[str] = frozenset(),
    ) -> Candidate:  # fmt: skip
        checkpoint = frozenset(name for name, action in actions.items() if action in (CHECKPOINT, BOTH))
        offload = frozenset(name for name, action in actions.items() if action in (OFFLOAD, BOTH))
        partial = frozenset(
            (name, (thresholds or {})[name]) for name, action in actions.items() if action == PARTIAL
        )
        if everywhere:
            return cls(checkpoint, frozenset(), True, tile=tile)
        return cls(checkpoint, offload, False, partial, tile)

    @property
    def offloads(self) -> bool:
        return self.everywhere or bool(self.offload) or bool(self.partial)

    @property
    def kind(self) -> str:
        """What the candidate does: one of ``KINDS``."""
        kind = (KINDS[2] if self.offloads else KINDS[0]) if self.checkpoint else KINDS[1] if self.offloads else ""
        if self.tile:
            return f"tile + {kind}" if kind else "tile"
        return kind or KINDS[1]

    def actions(self, blocks: Mapping[str, BlockMemory]) -> dict[str, str]:
        """Per-block actions, for pricing: with ``everywhere``, every block offloads."""
        found = {}
        partial = {name for name, _ in self.partial}
        for name in blocks:
            offloaded = self.everywhere or name in self.offload
            if name in self.checkpoint:
                found[name] = BOTH if offloaded else CHECKPOINT
            elif offloaded:
                found[name] = OFFLOAD
            elif name in partial:
                found[name] = PARTIAL
        return found

    def checkpoint_names(self) -> list[str]:
        return sorted(self.checkpoint, key=natural_order)

    def tile_names(self) -> list[str]:
        return sorted(self.tile, key=natural_order)

    def tile_settings(self) -> TileSettings | None:
        """The tiling it runs with, as ``LightMem(tile=...)`` applies it (None: none)."""
        return TileSettings(modules=tuple(self.tile_names()), spelling=LIGHTMEM) if self.tile else None

    def offload_settings(self, searched: OffloadSettings) -> OffloadSettings | None:
        """``searched`` (the settings the plan runs under) with this candidate's modules:
        ``include`` None offloads everywhere."""
        if not self.offloads:
            return None
        if self.everywhere:
            return searched.with_choice(min_bytes=searched.min_bytes, include=None)
        thresholds = dict.fromkeys(self.offload, 0) | dict(self.partial)
        include = tuple(sorted(thresholds, key=natural_order))
        own = tuple(thresholds[name] for name in include) if self.partial else None
        return searched.with_choice(min_bytes=searched.min_bytes, include=include, include_min_bytes=own)


@dataclass
class Family:
    """A nested sequence of candidates, each one adding to the one before, and their prices."""

    name: str
    candidates: list[Candidate]
    times: list[StepTime]
    predicted_saved: list[int]

    @property
    def starts_with_offload_alone(self) -> bool:
        """Its first candidate offloads everywhere and checkpoints nothing ("offload everywhere"):
        a configuration of its own, along which fitting is not monotone (see ``_first_fit``)."""
        return self.candidates[0].everywhere and not self.candidates[0].checkpoint

    def guess(self, need: int) -> int:
        """The first candidate predicted to save ``need`` bytes (the last when none is)."""
        return next((i for i, saved in enumerate(self.predicted_saved) if saved >= need), len(self.candidates) - 1)


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
    host: HostBytes = field(default_factory=HostBytes)
    """What the step holds on the host (``lightmem.estimate.host``)."""


def _family(name: str, candidates: list[Candidate], blocks: Mapping[str, BlockMemory], costs: Costs) -> Family:
    times, saved = [], []
    after_tiling: dict[frozenset[str], dict[str, BlockMemory]] = {}
    for candidate in candidates:
        actions = candidate.actions(blocks)
        times.append(step_time(blocks, actions, costs, tiled=candidate.tile))
        if candidate.tile not in after_tiling:
            after_tiling[candidate.tile] = tiled_blocks(blocks, costs, candidate.tile)
        left = after_tiling[candidate.tile]
        tiling = sum(costs.modules[module].saved_bytes for module in candidate.tile)
        saved.append(tiling + sum(saves_bytes(left[n], a, costs) for n, a in actions.items()))
    return Family(name, candidates, times, saved)


def tiled_blocks(blocks: Mapping[str, BlockMemory], costs: Costs, tiled: frozenset[str]) -> dict[str, BlockMemory]:
    """``blocks`` as their steps save with the ``tiled`` modules run in shards: what each tiled module
    saved besides its input taken out of its block (a prediction, to order the walks)."""
    if not tiled:
        return dict(blocks)
    removed: dict[str, list[int]] = {}
    for name in tiled:
        module = costs.modules[name]
        removed.setdefault(module.block or ROOT_BLOCK, []).extend(module.saved_sizes)
    found = {}
    for name, block in blocks.items():
        sizes = list(block.saved_sizes)
        for size in removed.get(name, ()):
            if size in sizes:
                sizes.remove(size)
        found[name] = dataclasses.replace(block, saved_bytes=sum(sizes), saved_sizes=sizes)
    return found


def tile_order(blocks: Mapping[str, BlockMemory], costs: Costs, candidates: list[str]) -> list[str]:
    """The modules a plan may tile, cheapest per byte first: what tiling adds to the step (its
    second forward and its launches, ``tile_s``) over what it saves."""

    def per_byte(name: str) -> tuple[float, list[object]]:
        module = costs.modules[name]
        seconds = sum(tile_s(module, blocks, costs))
        return seconds / max(module.saved_bytes, 1), natural_order(name)

    return sorted(candidates, key=per_byte)


def build_families(blocks: Mapping[str, BlockMemory], costs: Costs, tile: list[str] | tuple[str, ...] = ()) -> list[Family]:
    """The planner's walks through the space: four (one on CPU: checkpoint only), and with ``tile``
    (the modules it may tile) the tile walk (module docstring)."""
    families = _walks(blocks, costs)
    if tile:
        families.append(_tile_walk(blocks, costs, list(tile)))
    return families


def _tile_walk(blocks: Mapping[str, BlockMemory], costs: Costs, modules: list[str]) -> Family:
    """Modules tiled one by one (``tile_order``), then, every one tiled, the per-block actions on the
    blocks as they save with them tiled (checkpoint alone where offload is not considered)."""
    order = tile_order(blocks, costs, modules)
    candidates = [Candidate(tile=frozenset(order[: index + 1])) for index in range(len(order))]
    everything = frozenset(order)
    left = tiled_blocks(blocks, costs, everything)
    thresholds = {name: threshold for name, (threshold, _) in costs.partial.items()}
    walk = costs if costs.allow_offload else dataclasses.replace(costs, allow_offload=False)
    actions: dict[str, str] = {}
    for name, action in greedy_steps(left, walk):
        actions[name] = action
        candidates.append(Candidate.from_actions(actions, thresholds=thresholds, tile=everything))
    # The predictions stop where offloading a tiled layer seems to save all it keeps, but its reloads
    # and its backward are then on the device together: the walk goes on to every layer checkpointed
    # (and its input offloaded), one layer at a time, the extreme long context needs.
    last = BOTH if walk.allow_offload else CHECKPOINT
    for name in sorted(planned_blocks(left), key=natural_order):
        if _RANK[actions.get(name, KEEP)] < _RANK[last]:
            actions[name] = last
            candidates.append(Candidate.from_actions(actions, thresholds=thresholds, tile=everything))
    return _family("tile", candidates, blocks, costs)


def _walks(blocks: Mapping[str, BlockMemory], costs: Costs) -> list[Family]:
    """The four walks without tiling (one on CPU: checkpoint only)."""
    families = []
    checkpoint_only = dataclasses.replace(costs, allow_offload=False)
    actions: dict[str, str] = {}
    candidates = []
    for name, action in greedy_steps(blocks, checkpoint_only):
        actions[name] = action
        candidates.append(Candidate.from_actions(actions))
    if candidates:
        families.append(_family("checkpoint", candidates, blocks, costs))
    if not costs.allow_offload:
        return families
    thresholds = {name: threshold for name, (threshold, _) in costs.partial.items()}
    # Offload alone: any block's largest saved tensors or all of them, cheapest per byte first
    # (free offloads first), then every saved tensor of at least min_bytes anywhere in the model.
    actions, candidates = {}, []
    for name, action in greedy_steps(blocks, costs, checkpoint=False):
        actions[name] = action
        candidates.append(Candidate.from_actions(actions, thresholds=thresholds))
    offload_alone = _family("offload", [*candidates, Candidate(everywhere=True)], blocks, costs)
    if offload_alone.times[-1].moved_bytes:  # else nothing reaches the threshold
        families.append(offload_alone)
    actions, candidates = {}, []
    for name, action in greedy_steps(blocks, costs):
        actions[name] = action
        candidates.append(Candidate.from_actions(actions, thresholds=thresholds))
    if candidates:
        families.append(_family("per block", candidates, blocks, costs))
    # Everything offloaded; then the layers whose re-run costs least against the transfer it
    # spares (their saved tensors, less the input checkpoint keeps) are checkpointed first.
    layers = planned_blocks(blocks)
    order = sorted(
        layers,
        key=lambda name: (
            block_cost_s(blocks[name], BOTH, costs) - block_cost_s(blocks[name], OFFLOAD, costs),
            natural_order(name),
        ),
    )
    candidates = [Candidate(everywhere=True)]
    for index in range(len(order)):
        candidates.append(Candidate(frozenset(order[: index + 1]), everywhere=True))
    everywhere = _family("offload everywhere", candidates, blocks, costs)
    if everywhere.times[0].moved_bytes:  # else nothing reaches the threshold: checkpointing's twin
        families.append(everywhere)
    return families


def _rank(price: StepTime, candidate: Candidate) -> tuple[float, int, int, bool]:
    """Order of preference: least predicted time; on a tie, fewer bytes moved, fewer re-runs, and
    offload everywhere (LightMem's default: no module list) before the same offload block by block."""
    return (price.total_s, price.moved_bytes, len(candidate.checkpoint), not candidate.everywhere)


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
        tile: bool = True,
        host: HostLimit | None = None,
        sequence: tuple[int, int, int] | None = None,
    ) -> None:
        self.model, self.batch, self.settings, self.info = model, batch, settings, info
        self.sequence = sequence
        """The batch's sequence at the length planned for (``StepRequest.sequence``); None: as given."""
        self.host = host if host is not None else HostLimit(None)
        self.model_state_when_needed = False
        """Search again with model-state offload where nothing fits without it (``plan``)."""
        """The host memory a configuration may hold (``lightmem.estimate.host``)."""
        self.base, self.costs, self.batch_size, self.baseline = base, costs, batch_size, baseline
        self.searched_offload = offload
        """The offload settings the search runs under (None: lightmem's defaults)."""
        self.offload = offload if offload is not None else parse_offload(True, flag="plan(offload=...)")
        assert self.offload is not None
        self.tile_candidates = base.tile_candidates if tile and not holds_compiled_modules(model) else []
        """The modules this space may tile (none for a compiled model: a tiled module runs eagerly
        between compiled graphs)."""
        self.families = build_families(base.blocks, costs, self.tile_candidates)
        self.verified: dict[tuple[Candidate, bool], Verified] = {}
        """Verified steps by candidate and whether model state was offloaded."""
        self.traced = 0
        """Fake steps this space ran (verified steps found in ``_VERIFIED`` are not run again)."""
        self._memory_key = step_memory_key(model, batch, settings, batch_size, sequence)

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
                tile=candidate.tile_settings(), sequence=self.sequence,
            )  # fmt: skip
            offload = candidate.offload_settings(self.offload)
            held = host_bytes(
                trace.host_bytes, trace.host_largest_bytes, trace.optimizer_host_bytes,
                offload.host_budget_bytes if offload is not None else None,
            )  # fmt: skip
            found = Verified(
                trace.peak.bytes, trace.host_bytes, trace.optimizer_link_bytes,
                tuple(trace.offloaded_by_block.items()), dominant_part(trace), trace.reserve, held,
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
                reserve=named.reserve, host=HostBytes(model_state=named.host_bytes),
            )
        return self.verify(Candidate(), model_state=True)

    def reserved(self, verified: Verified) -> int:
        """What the allocator must be able to reserve for a verified step: what must fit the budget."""
        return verified.reserve.bytes if verified.reserve is not None else verified.peak_bytes

    def fits(self, verified: Verified, available: int) -> bool:
        """Whether a verified step runs with ``available`` bytes reservable (one replay, not the bisection
        ``reserved`` runs) and what it holds on the host within ``host`` (the space's host limit)."""
        return self.fits_device(verified, available) and self.host.admits(verified.host)

    def fits_device(self, verified: Verified, available: int) -> bool:
        """``fits`` on the device alone."""
        return verified.reserve.fits(available) if verified.reserve is not None else verified.peak_bytes <= available

    def held_by_host(self, available: int, model_state: bool) -> Verified | None:
        """When every verified configuration that fits the device holds more than the host limit:
        the one that holds least (None: the device, not the host, refused them)."""
        fitting = [
            verified for (candidate, state), verified in self.verified.items()
            if state == model_state and self.fits_device(verified, available)
        ]  # fmt: skip
        if not fitting or any(self.host.admits(verified.host) for verified in fitting):
            return None
        return min(fitting, key=lambda verified: verified.host.total)

    @property
    def kinds(self) -> dict[str, str]:
        """The class name of each block and each module the space may tile, for words."""
        return {**self.base.block_kinds, **{name: self.costs.modules[name].kind for name in self.tile_candidates}}

    def describe(self, candidate: Candidate) -> str:
        """The candidate in words: "checkpoint layer1.0-2 (Bottleneck) + offload every saved tensor ..."."""
        return _describe(candidate, self.kinds, self.costs.min_bytes)

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
        walks do not fit, its own are not expected to.)

        With ``model_state_when_needed`` (``max_sequence_length``'s spaces), on CUDA, where no
        configuration fits with gradients and optimizer state on the device, the walks are searched
        again with them on the host (model-state offload): at long context the activations, not the
        model state, fill the device, and the model state's bytes are room."""
        found = self._plan(budget_bytes, other)
        retry = self.model_state_when_needed and self.settings.device == "cuda" and not found.offload_optimizer
        if found.fits or not retry or found.limited_by != "device":
            return found
        # Model state on the host frees at most the gradients and optimizer state: where the closest
        # configuration is further over the budget, it cannot fit either.
        trace = self.baseline
        freed = trace.gradient_bytes + trace.optimizer_state_bytes if trace is not None else budget_bytes
        closest = min((option.predicted_total_bytes for option in found.alternatives), default=None)
        if closest is not None and closest - budget_bytes > freed:
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
        # What must fit is what the allocator reserves for a verified (allocated) peak.
        available = budget_bytes - settings.overhead_bytes
        baseline_peak = base.scenarios["baseline"].peak_bytes
        baseline_reserved = base.scenarios["baseline"].reserved
        baseline_s = compute_s(base.blocks, costs)
        result = Plan(
            [], None, baseline_peak, settings.overhead_bytes, budget_bytes, False, "", estimate=base,
            checkpoint_policy=settings.checkpoint_policy, flops_per_s=costs.flops_per_s,
            link_bytes_per_s=costs.link_bytes_per_s,
            settings={**_searched_under(settings, costs, self.searched_offload), "tile_candidates": list(self.tile_candidates)},
            step_seconds=baseline_s, baseline_step_seconds=baseline_s, speeds=settings.speeds,
            predicted_reserved_bytes=baseline_reserved, costs=costs,
        )  # fmt: skip
        result.estimate_kinds = base.block_kinds
        before = self.traced
        model_state = model_state or settings.offload_optimizer
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
            baseline_reserved = self.reserved(found)
            model_state_s = model_state_transfer_s(link_bytes, costs)
            result.predicted_peak_bytes = baseline_peak
            result.predicted_reserved_bytes = baseline_reserved
            result.exposed_transfer_s = model_state_s
            result.step_seconds = configuration_time(base.blocks, costs, model_state_link_bytes=link_bytes).step_s
            result.host = found.host
            if not self.host.admits(found.host):
                result.reason = f"gradients and optimizer state go to the host, and {self.host.refusal(found.host)}"
                result.limited_by = "host"
                return result
        if baseline_reserved <= available:
            result.fits = True
            result.reason = (
                f"with offload_optimizer the peak is {format_bytes(baseline_peak)} + overhead "
                f"{format_bytes(settings.overhead_bytes)}"
                if model_state
                else "the baseline step already fits"
            )
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
            return min(_rank(family.times[i], family.candidates[i]) for i in range(start, len(family.candidates)))

        # The walk that might offer most first: a fit it finds spares the walks that cannot beat it.
        for family in sorted(families, key=offers):
            if best is not None and offers(family) >= _rank(best[0], best[1].candidates[best[2]]):
                continue  # a configuration that fits is already at least as fast
            first = self._first_fit(family, available, need, model_state)
            if first is None:
                continue

            def rank(index: int, family: Family = family) -> tuple[float, int, int, bool]:
                return _rank(family.times[index], family.candidates[index])

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
            if best is None or rank(chosen) < _rank(best[0], best[1].candidates[best[2]]):
                best = (family.times[chosen], family, chosen)
        if best is None:  # a configuration verified for another budget may fit this one
            best = self._fastest_verified_fit(available, model_state)
        result.evaluations = self.traced - before
        held = self.held_by_host(available, model_state) if best is None else None
        if held is not None:
            closest = next(candidate for (candidate, state), found in self.verified.items() if found is held and state == model_state)
            result.reason = (
                f"every configuration verified to fit the device holds more host memory than the host allows: the "
                f"least, {self.describe(closest)}, {self.host.refusal(held.host)}"
            )
            result.limited_by, result.host = "host", held.host
            return result
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
            result.limited_by = "device"
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
        result.tile = candidate.tile_names()
        result.tile_kinds = {name: self.costs.modules[name].kind for name in result.tile}
        result.predicted_peak_bytes = verified.peak_bytes
        result.predicted_reserved_bytes = self.reserved(verified)
        result.host_bytes = verified.host_bytes
        result.host = verified.host
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
        )
        return result

    def _fastest_verified_fit(self, available: int, model_state: bool) -> tuple[StepTime, Family, int] | None:
        """The fastest configuration already verified that fits ``available``, with its family."""
        found = None
        for family in self.families:
            for index, candidate in enumerate(family.candidates):
                verified = self.verified.get((candidate, model_state))
                if verified is None or not self.fits(verified, available):
                    continue
                if found is None or _rank(family.times[index], candidate) < _rank(found[0], found[1].candidates[found[2]]):
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
            self._option(closest[kind][1], False, model_state)
            for kind in (*KINDS, "tile", *TILED_KINDS) if kind in closest and kind not in fitting
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
        description = _describe(candidate, self.kinds, self.costs.min_bytes)
        step = self.step_of(candidate, verified)
        return PlanOption(
            description, fits, self.reserved(verified) + self.settings.overhead_bytes,
            step.recompute_s, step.exposed_transfer_s, step.step_s,
        )  # fmt: skip


def _describe(candidate: Candidate, kinds: Mapping[str, str], min_bytes: int) -> str:
    parts = []
    if candidate.tile:
        parts.append(f"tile {compact_modules(candidate.tile_names(), kinds)}")
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


def plan(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
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
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    batch_size: int | None = None,
    tile: bool = True,
    host_budget: int | float | str | None = None,
    sequence_length: int | None = None,
    seq_dim: int | None = None,
) -> Plan:
    """The lightmem configuration with the least predicted step time whose verified peak fits ``budget``.

    The space: checkpoint any set of repeated layers, offload the saved tensors of any blocks, or
    offload every saved tensor of at least ``offload``'s ``min_bytes`` anywhere in the model, alone or
    with checkpointing (see the module docstring for how it is searched). Whenever every repeated
    layer checkpointed (with or without offload) or offload alone fits, the plan fits.

    Args:
        budget: device memory for the whole step, overhead allowance included ("24GiB", bytes).
        gpu: the GPU whose speeds price every op, re-run and transfer, and whose cuBLAS
            workspaces are counted: a name ("h100", "a100", ... ``lightmem.devices.GPU_NAMES``),
            "auto" (this machine's CUDA device, else a generic A100-class GPU), or speeds measured
            on the training device (``measure_device_speeds``).
        flops_per_s: a matrix throughput to price every product at instead of the GPU's own.
        link_bytes_per_s: a host link speed per second, each way, instead of the GPU's own
            ("25GB", bytes).
        offload: the offload settings the plan searches under, as for :func:`estimate_memory`
            (a dict such as ``{"min_bytes": "4MiB", "exclude": ["lm_head"]}``, or
            ``OffloadSettings``); None: lightmem's defaults; False: plan checkpointing only. The
            modules to offload are the plan's choice: ``include`` is refused. ``Plan.offload``
            is these settings with the chosen modules (``include`` None: offload everywhere), and
            ``Plan.settings`` says what the search ran under, prices included.
        checkpoint_policy: what the blocks the plan checkpoints keep: ``"full"`` (their inputs),
            ``"save_matmuls"`` or a per-op callable, as in ``apply_checkpointing``; priced and
            verified with it, and returned in ``lightmem_kwargs()``. ``"auto"``: the faster plan of
            "full" and "save_matmuls" (``LightMem(plan="auto")`` without ``checkpoint_policy``).
        offload_optimizer: plan with gradients and optimizer state on the host. Without it the
            plan turns it on by itself when parameters + gradients + optimizer state exceed the
            budget and the parameters alone do not (``lightmem_kwargs()`` then has it). Settings
            with ``device_dtype`` (``LightMem(...).settings.optimizer_offload``, as ``plan="auto"``
            passes them) plan with bf16 device weights, and ``lightmem_kwargs()`` has
            ``offload_optimizer_device_dtype`` too.
        batch_size: plan for ``batch`` with dim 0 of its batch tensors at this size (as
            ``max_batch_size`` scales it); None: the batch as given.
        sequence_length: plan for ``batch`` with its sequence at this length (as
            ``max_sequence_length`` grows it: every batch tensor whose size along the sequence's
            dimension is the batch's length); None: as given.
        seq_dim: the sequence's dimension in the batch's tensors; None: dimension 1 of its token
            ids ``[B, T]`` or vectors ``[B, T, d]`` (``lightmem.estimate.batch.sequence_axis``).
        tile: whether the plan may run position-wise modules in sequence shards
            (``LightMem(tile=...)``): the modules the baseline's trace shows never mix positions
            (``MemoryEstimate.tile_candidates``; none in a compiled model); False: never.
        host_budget: the host memory the plan may hold in all (the offloaded activations' pool and,
            with model-state offload, the host copies of parameters, gradients and optimizer
            state): bytes, a size ("1TiB"), or a fraction of this machine's available RAM. None:
            this machine's available RAM when the plan is for this machine (``device="cpu"``, or a
            CUDA device here), else no limit. A configuration that holds more is not taken; when
            every one that fits the device does, the plan does not fit and ``limited_by`` is "host".
        Other arguments: as for :func:`estimate_memory`.

    On "cpu" only checkpointing is planned (offloading CPU memory to CPU memory saves nothing).

    Returns:
        A :class:`Plan`; ``describe()`` says what was chosen, what else fitted and why;
        ``step_seconds`` is its predicted step time. ``plan.fits`` is False with a ``reason`` when
        the parameters (and, unless they can go to the host, gradients and optimizer state)
        alone exceed the budget or no configuration in the space gets under it.

    Raises:
        ValueError: a bad argument (named in the message).
    """
    arguments = dict(locals())  # the call as made: asked again with the loss priced as chunked
    started = time.perf_counter()
    if isinstance(checkpoint_policy, str) and checkpoint_policy == AUTO_POLICY:
        result = _plan_either_policy(
            model, batch, budget, loss_fn, started, optimizer=optimizer, precision=precision, device=device, gpu=gpu,
            overhead_bytes=overhead_bytes, zero_grad=zero_grad, flops_per_s=flops_per_s,
            link_bytes_per_s=link_bytes_per_s, offload=offload, offload_optimizer=offload_optimizer,
            batch_size=batch_size, tile=tile, host_budget=host_budget, sequence_length=sequence_length, seq_dim=seq_dim,
        )  # fmt: skip
    else:
        space = plan_space(
            model, batch, loss_fn, budget=budget, fn_name="plan", optimizer=optimizer, precision=precision,
            device=device, gpu=gpu, overhead_bytes=overhead_bytes, zero_grad=zero_grad, flops_per_s=flops_per_s,
            link_bytes_per_s=link_bytes_per_s, offload=offload, checkpoint_policy=checkpoint_policy,
            offload_optimizer=offload_optimizer, batch_size=batch_size, tile=tile, host_budget=host_budget,
            sequence_length=sequence_length, seq_dim=seq_dim,
        )  # fmt: skip
        result = _plan_in(space, started)
    result.chunked_loss = plan_with_chunked_loss(result, lambda: plan(**arguments))
    result.seconds = time.perf_counter() - started
    return result


def _plan_in(space: PlanSpace, started: float, other: Plan | None = None) -> Plan:
    """``space``'s plan for its budget (``other``: as for ``PlanSpace.plan``)."""
    assert space.settings.budget_bytes is not None
    result = space.plan(space.settings.budget_bytes, other=other)
    space.base.advice = advise(space.base, space.info, space.baseline, result)
    result.seconds = time.perf_counter() - started
    return result


AUTO_POLICY = "auto"
"""``plan(checkpoint_policy="auto")``: the planner chooses what checkpointed blocks keep."""


def _plan_either_policy(model: nn.Module, batch: Any, budget: int | str, loss_fn: Any, started: float, **common: Any) -> Plan:
    """The faster of the plans under the "full" and "save_matmuls" policies (one that fits before
    one that does not). The second is searched only when the first checkpoints or does not fit:
    otherwise no block is re-run and the policy changes nothing; and then only along the walks that
    re-run something, where they could beat the first.

    One baseline step serves both: traced under "save_matmuls" (whose per-op decisions it counts),
    it is the "full" baseline without them (``as_traced_in_full``)."""
    matmuls_space = plan_space(model, batch, loss_fn, budget=budget, fn_name="plan", checkpoint_policy="save_matmuls", **common)
    full_space = plan_space(
        model, batch, loss_fn, budget=budget, fn_name="plan", checkpoint_policy="full",
        baseline=as_traced_in_full(matmuls_space.baseline), **common,
    )  # fmt: skip
    full = _plan_in(full_space, started)
    if full.fits and not full.checkpoint:
        full.seconds = time.perf_counter() - started
        return full
    try:
        matmuls = _plan_in(matmuls_space, started, other=full)
    except EstimateError:
        # A step torch's selective checkpointing refuses (a backward through a block twice, with
        # retain_graph) runs under "full" only: a configuration the dry run cannot run is no candidate.
        full.seconds = time.perf_counter() - started
        return full
    chosen, other = (matmuls, full) if _better(matmuls, full) else (full, matmuls)
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
    return chosen


def _better(candidate: Plan, than: Plan) -> bool:
    """A plan that fits beats one that does not; among those that fit, the faster one."""
    if candidate.fits != than.fits:
        return candidate.fits
    return candidate.fits and candidate.step_seconds < than.step_seconds


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
    tile: bool = True,
    host_budget: int | float | str | None = None,
    sequence_length: int | None = None,
    seq_dim: int | None = None,
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
    sequence = None
    if sequence_length is not None:
        parse_count(sequence_length, flag=f"{fn_name}(sequence_length=...)")
        sequence = sequence_axis(batch, seq_dim, fn_name=fn_name).grown(sequence_length)
    base, baseline = build_report(
        model, batch, settings, info, None, None, batch_size=batch_size, baseline=baseline, sequence=sequence
    )
    costs = costs_for(settings, baseline, offload_settings)
    if offload_settings is not None and costs.allow_offload:
        # The windows the plan hands the engine are what its link moves while a block computes.
        offload_settings = sized_windows(offload_settings, base.blocks, costs, _window_cap(base, settings))
        costs = dataclasses.replace(
            costs, inflight_bytes=offload_settings.max_inflight_bytes, prefetch_bytes=offload_settings.prefetch_bytes
        )
        costs = dataclasses.replace(costs, partial=partial_thresholds(base.blocks, costs))
    if not isinstance(tile, bool):
        raise ValueError(f"{fn_name}(tile=...): expected True (the plan may tile position-wise modules) or False; got {tile!r}")
    host = host_limit(host_budget, settings.device, flag=f"{fn_name}(host_budget=...)")
    return PlanSpace(
        model, batch, settings, info, base, costs, offload=offload_settings, batch_size=batch_size, baseline=baseline,
        tile=tile, host=host, sequence=sequence,
    )


def _window_cap(base: MemoryEstimate, settings: EstimateSettings) -> int | None:
    """The most an offload window need hold (``sized_windows``): one layer's share of what the budget
    leaves for activations, or, where that is less, one layer's input (what a checkpointed, offloaded
    layer sends); None without a budget."""
    if not settings.budget_bytes:
        return None
    layers = list(planned_blocks(base.blocks).values())
    room = settings.budget_bytes - settings.overhead_bytes - base.static_bytes
    inputs = sorted(block.input_bytes for block in layers)
    return max(room // max(len(layers), 1), inputs[len(inputs) // 2] if inputs else 0)


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
