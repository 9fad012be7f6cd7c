"""``max_batch_size``: the largest batch whose step fits a budget, found with the estimator alone.

Peak memory is affine in the batch size for most models, so two estimates give a line and one
estimate at the size the line picks confirms it: three estimates when that size fits and the next
one is over the budget even at the smallest slope seen, less how far the step fell off the line.
Otherwise the search brackets the answer (a size that fits, the next one that does not)
with secant steps that fall back to bisection. The answer is always an estimated size that fits;
the next size is either estimated not to fit or, on a confirmed line, predicted not to.

What must fit is what the caching allocator reserves for the step (its requests replayed:
``caching_allocator``), which follows the line in steps of its segments, a few MiB at a time: a size
past the answer can fit again where a segment size comes out even, so the answer is the crossing
the search lands on, not a promise about every larger size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, Spelling, TileSettings, format_bytes
from lightmem.config.estimator import parse_checkpoint, parse_offload
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.chunked_loss import dominant_logits
from lightmem.estimate.planning.result import Plan
from lightmem.estimate.planning.space import PlanSpace, space_for
from lightmem.estimate.settings import EstimateSettings, parse_settings
from lightmem.estimate.steps import run_configuration
from lightmem.estimate.trace.batch import BatchInfo, SequenceAxis, inspect_batch, scalable_batch
from lightmem.tables import format_table

DEFAULT_LIMIT = 1 << 20
PLAN_TRIES = 4
"""Sizes ``max_batch_size(plan=True)`` plans at, from the largest an extreme configuration fits down,
until the best plan at one fits."""


@dataclass
class BatchSearch:
    """Largest batch sizes that fit ``budget_bytes`` (peak + overhead), without and with lightmem.

    ``baseline`` / ``configured`` / ``planned`` are 0 when not even a batch of 1 fits, and ``limit``
    when the search stopped there. ``evaluations`` lists (batch size, total bytes) per configuration.
    """

    baseline: int
    configured: int | None
    budget_bytes: int
    overhead_bytes: int
    evaluations: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    seconds: float = 0.0
    planned: int | None = None
    """With ``plan=True``: the largest batch at which a configuration of the planner's space fits."""
    plan: Plan | None = None
    """With ``plan=True``: the best plan at ``planned`` (None when not even a batch of 1 fits)."""
    limit: int | None = None
    """The largest batch size searched: an answer equal to it is a floor, not the largest that fits."""
    limited_by: str = ""
    """With ``plan=True``: what stopped the plans past ``planned``: "device" (no configuration's peak
    fits the budget there) or "host" (those whose peak fits hold more host memory than the host
    limit, ``lightmem.estimate.host``); empty when the search stopped at ``limit``."""
    stopped_by_logits: bool = False
    """With ``plan=True``: past ``planned``, the loss's logits dominate the step and a chunked loss
    could take the loss's place (``lightmem.estimate.chunked_loss.dominant_logits``)."""

    def in_sizes(self, multiple: int) -> BatchSearch:
        """This search, whose sizes are in units of ``multiple``, in sizes."""
        if multiple == 1:
            return self
        self.baseline *= multiple
        self.configured, self.planned, self.limit = (
            None if size is None else size * multiple for size in (self.configured, self.planned, self.limit)
        )
        self.evaluations = {name: [(size * multiple, total) for size, total in items] for name, items in self.evaluations.items()}
        return self

    def at_limit(self, answer: int | None) -> bool:
        """Whether ``answer`` is where the search stopped rather than the largest batch that fits."""
        return answer is not None and self.limit is not None and answer >= self.limit

    def to_text(self) -> str:
        """The answers as a short table: the largest batch without lightmem, with the configuration
        given, and with the best plan (then that plan in words); an answer at the search's limit
        says so."""

        def said(answer: int) -> str:
            return f"{answer} (the limit searched: larger may fit)" if self.at_limit(answer) else str(answer)

        rows = [["without lightmem", said(self.baseline)]]
        if self.configured is not None:
            rows.append(["with the configuration given", said(self.configured)])
        if self.planned is not None:
            rows.append(["with the best plan", said(self.planned)])
        title = f"Largest batch that fits {format_bytes(self.budget_bytes)}" + (
            f" (the {format_bytes(self.overhead_bytes)} overhead allowance included)" if self.overhead_bytes else ""
        )
        text = format_table(rows, ("configuration", "largest batch"), title=title, align="lr")
        if self.plan is not None:
            text += f"\nThe best plan at batch {self.planned}: {self.plan.describe()}"
        return text + "\n"

    def print(self) -> None:
        print(self.to_text(), end="")

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        found = f"baseline={self.baseline}, configured={self.configured}, planned={self.planned}"
        return f"BatchSearch({found}, budget {format_bytes(self.budget_bytes)}; print() for the table)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "configured": self.configured,
            "planned": self.planned,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "budget_bytes": self.budget_bytes,
            "overhead_bytes": self.overhead_bytes,
            "evaluations": {name: [list(item) for item in items] for name, items in self.evaluations.items()},
            "seconds": round(self.seconds, 3),
            "limit": self.limit,
            "limited_by": self.limited_by,
        }


def largest_fitting(
    total_bytes: Callable[[int], int], budget_bytes: int, start: int, limit: int, fits_at: int = 0
) -> tuple[int, list[tuple[int, int]]]:
    """Largest ``b`` in [1, limit] with ``total_bytes(b) <= budget_bytes`` (0 if none).

    Assumes ``total_bytes`` does not decrease with ``b``. ``fits_at``: a size known to fit (the
    answer is never below it). Returns the answer and every (size, total) evaluated, in size order.
    """
    seen: dict[int, int] = {}
    low, high = min(fits_at, limit), limit + 1  # largest size known to fit, smallest known not to

    def evaluate(size: int) -> bool:
        nonlocal low, high
        if size not in seen:
            seen[size] = total_bytes(size)
        fits = seen[size] <= budget_bytes
        if fits:
            low = max(low, size)
        else:
            high = min(high, size)
        return fits

    start = max(1, min(start, limit))
    if not evaluate(start) and start == 1:
        return 0, sorted(seen.items())  # nothing fits: a larger size would not either
    other = start * 2 if start * 2 <= limit else start // 2
    if other >= 1 and other != start:
        evaluate(other)
        line = _line(seen)
        if line is not None:
            # Memory is affine in the batch size for most models: one step at the size the
            # line gives confirms it (the step lands exactly on the line) and ends the search.
            intercept, slope = line
            guess = min(limit, max(1, int((budget_bytes - intercept) // slope))) if slope > 0 else limit
            if guess not in seen and evaluate(guess):
                # The step at the guess fits. The next size is over the budget if it would be
                # even when memory grew by the smallest slope seen, less how far the guess
                # itself fell off the line (allocator rounding, a peak that moves).
                off_line = abs(seen[guess] - (intercept + slope * guess))
                points = sorted(seen.items())
                slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in zip(points, points[1:])]
                if guess >= low and (guess == limit or seen[guess] + min(slopes) - off_line > budget_bytes):
                    return guess, sorted(seen.items())
    nudged = False
    while high - low > 1:
        guess = _affine_guess(seen, budget_bytes, low, high)
        if guess is not None and guess <= low < high - 1:  # the line crosses just above the size that fits
            # Once, then bisect: a staircase (reserved bytes at exactly the budget over a range of
            # sizes) keeps the line there, and nudging by one each time scanned the whole range.
            guess = None if nudged else low + 1
            nudged = not nudged
        if guess is None or not low < guess < high:
            guess = min(limit, max(1, 2 * low)) if high == limit + 1 else (low + high) // 2
        if evaluate(guess):
            if guess + 1 < high:
                evaluate(guess + 1)  # an exact affine guess is confirmed by its neighbour
        elif guess - 1 > low:
            evaluate(guess - 1)
    return low, sorted(seen.items())


def _line(seen: dict[int, int]) -> tuple[float, float] | None:
    """Intercept and slope of the line through the two evaluations (None if not two)."""
    if len(seen) != 2:
        return None
    (x1, y1), (x2, y2) = sorted(seen.items())
    slope = (y2 - y1) / (x2 - x1)
    return y1 - slope * x1, slope


def _affine_guess(seen: dict[int, int], budget: int, low: int, high: int) -> int | None:
    """Where a line through the two evaluations nearest the budget crosses it."""
    if low in seen and high in seen:
        (x1, y1), (x2, y2) = (low, seen[low]), (high, seen[high])
    else:
        points = sorted(seen.items())[-2:] if high not in seen else sorted(seen.items())[:2]
        if len(points) < 2:
            return None
        (x1, y1), (x2, y2) = points
    if y2 == y1:
        return None
    return int(x1 + (budget - y1) * (x2 - x1) // (y2 - y1))


def max_batch_size(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    gpu: str | DeviceSpeeds = "auto",
    offload: bool | Mapping[str, Any] | OffloadSettings | None = None,
    checkpoint: Iterable[str | type] | str | None = None,
    overhead_bytes: int | str | None = None,
    zero_grad: str = "after_forward",
    limit: int = DEFAULT_LIMIT,
    checkpoint_policy: CheckpointPolicyArg = "full",
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    plan: bool = False,
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str | None = None,
    tile: bool | Iterable[str | type] | str = False,
    host_budget: int | float | str | None = None,
) -> BatchSearch:
    """The largest batch size whose step fits ``budget``, without lightmem and with a configuration.

    Dim 0 of every batch tensor whose dim 0 is the batch's batch size is scaled (values are not
    needed: the step runs on fake tensors). No out-of-memory trial is made; a handful of
    estimates suffice (about five per configuration when memory is affine in the batch size).

    Args:
        budget: device memory for the step including the overhead allowance ("24GiB", bytes).
        offload, checkpoint, offload_optimizer: the lightmem configuration for ``configured``
            (none of them: baseline only); ``tile`` as a list of modules (``estimate_memory(tile=...)``)
            is part of it too.
        limit: the largest batch size considered.
        checkpoint_policy: what the ``checkpoint`` blocks keep, as for :func:`estimate_memory`
            (and the blocks a plan checkpoints, with ``plan=True``).
        plan: also search the largest batch that fits with the best plan (``planned``, and the
            plan at that size in ``plan``): the largest size at which one of the planner's
            extreme configurations fits (every repeated layer checkpointed, with and without
            offload, offload alone, and, where the trace finds position-wise modules, everything
            tiled), then :func:`lightmem.plan` at that size picks the
            fastest configuration that fits there. Each size is asked of the planner's space at
            that size (its extremes, with their offload windows), from the first size that does
            not fit without lightmem: the answer does not depend on ``batch``'s own size.
            The plan searches under ``offload``'s settings less its ``include`` (the plan picks
            the modules), or lightmem's defaults when ``offload`` is None.
            With ``offload_optimizer`` the extremes and the plan run with model-state offload too.
        gpu: the GPU estimated for, as for :func:`lightmem.plan` (its cuBLAS workspaces; with
            ``plan=True`` also its speeds).
        flops_per_s, link_bytes_per_s, tile, host_budget: as for :func:`lightmem.plan` (read with
            ``plan=True`` only; ``tile`` True or a list: the plans may tile, False: never):
            at a size where every configuration that fits the device holds more host memory than
            the host limit, the plans do not fit (``limited_by``: "host").
        Other arguments: as for :func:`estimate_memory`.

    Raises:
        ValueError: a bad argument, or a batch without tensors to scale.
    """
    started = time.perf_counter()
    found = search_arguments(
        model, batch, budget, loss_fn, optimizer=optimizer, precision=precision, device=device, gpu=gpu, offload=offload,
        checkpoint=checkpoint, overhead_bytes=overhead_bytes, zero_grad=zero_grad, limit=limit,
        checkpoint_policy=checkpoint_policy, offload_optimizer=offload_optimizer, flops_per_s=flops_per_s,
        link_bytes_per_s=link_bytes_per_s, tile=tile, host_budget=host_budget,
    )  # fmt: skip
    return largest_batches(
        model, batch, found.settings, found.info, offload=found.offload, checkpoint=found.checkpoint, tile=found.tile,
        limit=limit, plan=plan, started=started,
    )  # fmt: skip


@dataclass(frozen=True)
class Axis:
    """The dimension a search grows: the batch's (``sequence`` None) or its sequence's, in units of
    ``multiple`` positions; ``start`` is the batch's own size in those units."""

    fn_name: str
    start: int
    multiple: int = 1
    sequence: SequenceAxis | None = None

    def at(self, size: int) -> dict[str, Any]:
        """``run_configuration``'s and ``space_for``'s arguments at ``size``."""
        if self.sequence is None:
            return {"batch_size": size}
        return {"sequence": self.sequence.grown(size * self.multiple)}


@dataclass(frozen=True)
class SearchArguments:
    """A search's arguments, parsed once (``search_arguments``)."""

    settings: EstimateSettings
    info: BatchInfo
    offload: OffloadSettings | None
    """The offload configuration searched without a plan (None: none)."""
    checkpoint: tuple[Any, ...] | None
    tile: TileSettings | None
    """The modules ``tile=[...]`` names, searched without a plan (None: none)."""


def search_arguments(
    model: nn.Module, batch: Any, budget: int | str, loss_fn: Callable[[nn.Module, Any], Any] | None, *, limit: int,
    offload: bool | Mapping[str, Any] | OffloadSettings | None, checkpoint: Iterable[str | type] | str | None,
    tile: bool | Iterable[str | type] | str = False, fn_name: str = "max_batch_size", scales_batch: bool = True,
    **flags: Any,
) -> SearchArguments:  # fmt: skip
    """A search's arguments parsed, each named as ``fn_name(argument=...)`` in an error: the settings
    (a plan searches under ``offload`` less its ``include``, or lightmem's defaults; it may tile
    when ``tile`` is True or a list), the batch (with a batch dimension to scale, unless
    ``scales_batch`` is False: a search along the sequence), the offload, checkpoint and tiling
    configuration searched without a plan (``tile`` as a list of modules, tiled as
    ``estimate_memory(tile=...)`` tiles them). ``flags``: the arguments ``parse_settings`` takes."""
    settings = parse_settings(fn_name, model, loss_fn, budget=budget, tile=tile is not False and tile is not None, **flags)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"{fn_name}(limit=...): expected a positive int; got {limit!r}")
    offload_config = parse_offload(offload, flag=f"{fn_name}(offload=...)")
    targets = parse_checkpoint(checkpoint, flag=f"{fn_name}(checkpoint=...)")
    tiles = None if isinstance(tile, bool) else TileSettings.parse(tile, spelling=Spelling(fn_name, (("modules", "tile"),)))
    info = scalable_batch(batch, flag=f"{fn_name}(batch=...)") if scales_batch else inspect_batch(batch)
    if offload_config is not None:  # the plan searches under it, choosing the modules itself
        settings = settings.searching(offload_config.with_choice(min_bytes=offload_config.min_bytes, include=None))
    return SearchArguments(settings, info, offload_config, targets, tiles)


def largest_batches(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    info: BatchInfo,
    *,
    offload: OffloadSettings | None = None,
    checkpoint: tuple[Any, ...] | None = None,
    tile: TileSettings | None = None,
    limit: int = DEFAULT_LIMIT,
    plan: bool = False,
    started: float | None = None,
    axis: Axis | None = None,
    kind: type[BatchSearch] = BatchSearch,
) -> Any:
    """``max_batch_size`` with its arguments parsed (``settings``; ``info``: the batch, with a batch
    dimension to scale): the largest batch without lightmem, with ``offload``, ``checkpoint`` and
    ``tile`` (or the settings' model-state offload) when given, and with ``plan`` the largest a plan
    of the planner's space fits and that plan. ``axis``: the dimension grown (None: the batch's;
    ``max_sequence_length`` grows the sequence, its sizes in units of ``axis.multiple``), the answer
    a ``kind``."""
    started = time.perf_counter() if started is None else started
    axis = axis if axis is not None else Axis("max_batch_size", info.batch_size or 1)
    budget_bytes = settings.budget_bytes
    assert budget_bytes is not None

    def totals(
        offload_config: OffloadSettings | None, targets: tuple[Any, ...] | None, model_state: bool = False,
        tiles: TileSettings | None = None,
    ) -> Callable[[int], int]:  # fmt: skip
        """Peak + overhead of one configuration by size, each size estimated once."""
        seen: dict[int, int] = {}

        def total(size: int) -> int:
            if size not in seen:
                trace = run_configuration(
                    model, batch, settings, offload=offload_config, checkpoint=targets, info=info,
                    offload_optimizer=model_state, tile=tiles, **axis.at(size),
                )  # fmt: skip
                seen[size] = trace.bound_bytes + settings.overhead_bytes
            return seen[size]

        total.seen = seen  # type: ignore[attr-defined]
        return total

    baseline_total = totals(None, None)
    baseline, baseline_evals = largest_fitting(baseline_total, budget_bytes, axis.start, limit)
    result = kind(baseline, None, budget_bytes, settings.overhead_bytes, {"baseline": baseline_evals}, limit=limit)
    if offload is not None or checkpoint or settings.offload_optimizer or tile is not None:
        result.configured, result.evaluations["configured"] = largest_fitting(
            totals(offload, checkpoint, settings.offload_optimizer, tile), budget_bytes, axis.start, limit
        )
    if plan:
        _largest_planned(model, batch, settings, result, baseline_total, limit, axis)
    result.seconds = time.perf_counter() - started
    return result.in_sizes(axis.multiple)


def _largest_planned(
    model: nn.Module, batch: Any, settings: EstimateSettings, result: BatchSearch, baseline_total: Callable[[int], int],
    limit: int, axis: Axis,
) -> None:  # fmt: skip
    """The largest size a configuration of the planner's space fits, and the best plan there
    (``result.planned``, ``result.plan``), with what stopped the plans past it (``limited_by``,
    ``stopped_by_logits``).

    Whether a plan fits a size is asked of the planner's space at that size: its extremes, with
    their offload windows, are that size's (at a small batch no saved tensor may reach offload's
    threshold, and its space has no offload at all). So the answer is a function of the size alone,
    whatever batch the search starts from."""
    budget_bytes = result.budget_bytes
    spaces: dict[int, PlanSpace] = {}
    model_state = settings.offload_optimizer
    host_stopped: set[int] = set()  # sizes whose configurations that fit the device hold too much host memory

    def space_at(size: int) -> PlanSpace:
        if size not in spaces:
            spaces[size] = space_for(model, batch, settings, **axis.at(size))
            # Along the sequence the activations fill the device: model state may leave it too.
            spaces[size].model_state_when_needed = axis.sequence is not None
        return spaces[size]

    def planned_total(size: int) -> int:
        """The least of the step without lightmem and the extremes of the space at ``size``:
        what the allocator must reserve, plus the overhead allowance. Where none of them fits,
        the plan at ``size`` decides: a configuration between the extremes can fit where they
        do not (offloading every saved tensor holds more in flight than offloading most). An
        extreme holding more host memory than the space's host limit does not fit."""
        space = space_at(size)
        least = baseline_total(size)
        for candidate in space.extremes():
            verified = space.verify(candidate, model_state)
            total = verified.held_bytes + settings.overhead_bytes
            result.evaluations.setdefault(f"plan: {space.describe(candidate)}", []).append((size, total))
            if not space.host.admits(verified.host):
                if total <= budget_bytes:
                    host_stopped.add(size)
                continue
            least = min(least, total)
        if least > budget_bytes:
            found = space.plan(budget_bytes)
            if found.fits:
                least = found.predicted_total_bytes
            elif found.limited_by == "host":
                host_stopped.add(size)
        if least <= budget_bytes:
            host_stopped.discard(size)
        return least

    # From the first size that does not fit without lightmem: where the plans start to matter.
    seed = max(1, min(result.baseline + 1, limit))
    # Without lightmem is one of the plans: the answer is never below it (a step's memory that
    # jumps, as a new segment does, bends the line the search starts from).
    planned, seen = largest_fitting(planned_total, budget_bytes, seed, limit, fits_at=result.baseline)
    past = [size for size, total in seen if size > planned and total > budget_bytes]
    if not past and planned < limit and planned_total(planned + 1) > budget_bytes:
        past = [planned + 1]  # a line confirmed the answer: the next size says what stopped it
    if past:  # what stopped the search: the host's limit, or the device's budget
        result.limited_by = "host" if min(past) in host_stopped else "device"
    for name, evaluations in result.evaluations.items():
        if name.startswith("plan: "):
            evaluations.sort()
    # The best plan at that size; where the allocator's replay tips it over the budget (the
    # extremes were asked their smallest reservable cap, the plan whether it runs under the
    # budget), the size below is planned (a few sizes at most).
    chosen = None
    for _ in range(PLAN_TRIES):
        if not planned:
            break
        chosen = space_at(planned).plan(budget_bytes)
        if chosen.fits:
            break
        planned -= 1
    result.planned, result.plan = planned, chosen
    if past and result.limited_by == "device":
        result.stopped_by_logits = dominant_logits(space_at(min(past)).base, priced_as_chunked=settings.loss_as_chunked) is not None
