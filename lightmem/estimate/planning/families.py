"""The planner's space as walks: the configurations (``Candidate``), the per-block actions that
build them cheapest per byte first (``greedy_steps``), and the nested sequences the search walks
(``build_families``: four, and with position-wise modules to tile the tile walk), each priced by
``pricing``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightmem.config import LIGHTMEM, OffloadSettings, TileSettings
from lightmem.estimate.pricing.costs import (
    BOTH,
    CHECKPOINT,
    KEEP,
    OFFLOAD,
    PARTIAL,
    Costs,
    block_cost_s,
    saves_bytes,
)
from lightmem.estimate.pricing.timeline import StepTime, step_time, tile_s
from lightmem.estimate.trace.blocks import ROOT_BLOCK, BlockMemory
from lightmem.estimate.words import configuration_parts, natural_order

_RANK = {KEEP: 0, PARTIAL: 1, OFFLOAD: 2, CHECKPOINT: 3, BOTH: 4}  # a block only moves up this list


KINDS = ("checkpoint", "offload", "checkpoint + offload")
"""The three kinds of configuration the space holds, each searched for every model layout; a
refusal names the closest of each kind."""
TILED_KINDS = ("tile", *(f"tile + {kind}" for kind in KINDS))
"""With position-wise modules to tile, the kinds with tiling."""


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
        """What the candidate does: one of ``KINDS`` or ``TILED_KINDS``."""
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

    def describe(self, kinds: Mapping[str, str], min_bytes: int) -> str:
        """The candidate in words: "checkpoint layer1.0-2 (Bottleneck) + offload every saved tensor ..."."""
        return " + ".join(
            configuration_parts(
                self.checkpoint, kinds, min_bytes, everywhere=self.everywhere, offloaded=self.offload, partial=self.partial,
                tile=self.tile,
            )
        )

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
    (the modules it may tile) the tile walk (``lightmem.estimate.planning.space``'s docstring)."""
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
    actions: dict[str, str] = {}
    for name, action in greedy_steps(left, costs):
        actions[name] = action
        candidates.append(Candidate.from_actions(actions, thresholds=thresholds, tile=everything))
    # The predictions stop where offloading a tiled layer seems to save all it keeps, but its reloads
    # and its backward are then on the device together: the walk goes on to every layer checkpointed
    # (and its input offloaded), one layer at a time, the extreme long context needs.
    last = BOTH if costs.allow_offload else CHECKPOINT
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


def preference(price: StepTime, candidate: Candidate) -> tuple[float, int, int, bool]:
    """Order of preference: least predicted time; on a tie, fewer bytes moved, fewer re-runs, and
    offload everywhere (LightMem's default: no module list) before the same offload block by block."""
    return (price.total_s, price.moved_bytes, len(candidate.checkpoint), not candidate.everywhere)
