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

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, Spelling, TileSettings, format_bytes, parse_count
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.batch import SequenceAxis, inspect_batch, scalable_batch, sequence_axis
from lightmem.estimate.chunked_loss import dominant_logits, largest_with_chunked_loss
from lightmem.estimate.configuration import parse_settings, run_configuration
from lightmem.estimate.planner import plan_space
from lightmem.estimate.report import Plan, format_seconds
from lightmem.estimate.settings import parse_checkpoint, parse_offload
from lightmem.tables import format_table

DEFAULT_LIMIT = 1 << 20
DEFAULT_SEQUENCE_LIMIT = 1 << 24
"""The longest sequence ``max_sequence_length`` searches by default: 16M positions."""
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


@dataclass
class SequenceSearch(BatchSearch):
    """Longest sequences that fit ``budget_bytes``, without and with lightmem (``max_sequence_length``):
    ``baseline`` / ``configured`` / ``planned`` are positions along ``seq_dim`` at ``batch_size``."""

    seq_dim: int = 1
    batch_size: int = 1
    chunked_loss: SequenceSearch | None = None
    """Where the loss's logits stop the plans: the same search with the loss priced as chunked
    (``lightmem.linear_cross_entropy``)."""

    @property
    def seconds_per_token(self) -> float | None:
        """The best plan's predicted step over the tokens it trains (``batch_size`` x ``planned``)."""
        if self.plan is None or not self.planned or not self.plan.fits:
            return None
        return self.plan.step_seconds / (self.batch_size * self.planned)

    def to_text(self) -> str:
        """The answers as a short table, then the best plan in words, its host memory and time per
        token, what stopped the search, and the answer with a chunked loss where the logits did."""

        def said(answer: int) -> str:
            return f"{answer:,} (the limit searched: longer may fit)" if self.at_limit(answer) else f"{answer:,}"

        rows = [["without lightmem", said(self.baseline)]]
        if self.configured is not None:
            rows.append(["with the configuration given", said(self.configured)])
        if self.planned is not None:
            rows.append(["with the best plan", said(self.planned)])
        if self.chunked_loss is not None and self.chunked_loss.planned is not None:
            rows.append(["with the best plan and a chunked loss", said(self.chunked_loss.planned)])
        title = f"Longest sequence (batch {self.batch_size}, dimension {self.seq_dim}) that fits {format_bytes(self.budget_bytes)}" + (
            f" (the {format_bytes(self.overhead_bytes)} overhead allowance included)" if self.overhead_bytes else ""
        )
        text = format_table(rows, ("configuration", "longest sequence"), title=title, align="lr")
        for name, found in (("", self), (" with a chunked loss", self.chunked_loss)):
            if found is None or found.plan is None or not found.planned:
                continue
            per_token = found.seconds_per_token
            text += f"\nThe best plan at {found.planned:,} positions{name}: {found.plan.describe()}"
            if per_token is not None:
                text += f"\n  {format_seconds(per_token)} per token predicted"
            if found.limited_by:
                text += f"; past it the {found.limited_by}'s memory sets the limit"
        return text + "\n"

    def __repr__(self) -> str:
        found = f"baseline={self.baseline}, configured={self.configured}, planned={self.planned}"
        return f"SequenceSearch({found}, budget {format_bytes(self.budget_bytes)}; print() for the table)"

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(), "seq_dim": self.seq_dim, "batch_size": self.batch_size,
            "seconds_per_token": self.seconds_per_token,
            "chunked_loss": self.chunked_loss.to_dict() if self.chunked_loss is not None else None,
        }  # fmt: skip


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
    tile: bool | Iterable[str | type] | str = True,
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
            tiled), then :func:`lightmem.plan` at that size picks the fastest configuration that
            fits there. Each size is asked of the planner's space at that size (its extremes, with
            their offload windows), from the first size that does not fit without lightmem: the
            answer does not depend on ``batch``'s own size. The plan searches under ``offload``'s
            settings less its ``include`` (the plan picks the modules), or lightmem's defaults
            when ``offload`` is None. With ``offload_optimizer`` the extremes and the plan run with
            model-state offload too.
        gpu: the GPU estimated for, as for :func:`lightmem.plan` (its cuBLAS workspaces; with
            ``plan=True`` also its speeds).
        flops_per_s, link_bytes_per_s, tile, host_budget: as for :func:`lightmem.plan` (read with
            ``plan=True`` only; ``tile`` False: the plans never tile, anything else: they may):
            at a size where every configuration that fits the device holds more host memory than
            the host limit, the plans do not fit (``limited_by``: "host").
        Other arguments: as for :func:`estimate_memory`.

    Raises:
        ValueError: a bad argument, or a batch without tensors to scale.
    """
    info = scalable_batch(batch, flag="max_batch_size(batch=...)")
    return _search(
        _Axis("max_batch_size", info.batch_size or 1), BatchSearch, model, batch, budget, loss_fn, optimizer=optimizer,
        precision=precision, device=device, gpu=gpu, offload=offload, checkpoint=checkpoint, overhead_bytes=overhead_bytes,
        zero_grad=zero_grad, limit=limit, checkpoint_policy=checkpoint_policy, offload_optimizer=offload_optimizer,
        plan=plan, flops_per_s=flops_per_s, link_bytes_per_s=link_bytes_per_s, tile=tile, host_budget=host_budget,
    )  # fmt: skip


def max_sequence_length(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
    seq_dim: int | None = None,
    multiple_of: int = 1,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    gpu: str | DeviceSpeeds = "auto",
    offload: bool | Mapping[str, Any] | OffloadSettings | None = None,
    checkpoint: Iterable[str | type] | str | None = None,
    overhead_bytes: int | str | None = None,
    zero_grad: str = "after_forward",
    limit: int = DEFAULT_SEQUENCE_LIMIT,
    checkpoint_policy: CheckpointPolicyArg = "full",
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    plan: bool = True,
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str | None = None,
    tile: bool | Iterable[str | type] | str = True,
    host_budget: int | float | str | None = None,
) -> SequenceSearch:
    """The longest sequence whose step fits ``budget``: without lightmem, with the configuration
    given, and (by default) with the best plan. The search of :func:`max_batch_size`, along the
    batch's sequence instead of its batch dimension.

    The sequence's dimension is ``seq_dim``, or found: dimension 1 of the batch's token ids
    (``[B, T]``) or vectors (``[B, T, d]``); every batch tensor whose size there is the batch's
    length grows with it (labels too), the batch size stays. The plan at the answer (``plan``) is
    the fastest configuration verified to fit there: position-wise modules tiled, layers
    checkpointed, what checkpointed layers keep offloaded, gradients and optimizer state on the
    host where the model state leaves no room; ``seconds_per_token`` is its predicted step over
    the tokens the step trains, ``limited_by`` says whether the device's budget or the host's
    memory stopped the search. Where the loss's logits are what stops the plans and
    ``lightmem.linear_cross_entropy`` could take the loss's place, ``chunked_loss`` is the same
    search with the loss priced as chunked.

    Args:
        seq_dim: the sequence's dimension in the batch's tensors (None: found, as above).
        multiple_of: search lengths that are multiples of this only (to the token, the search
            at 500K positions takes a dozen fake steps more than to 1,024).
        limit: the longest sequence considered.
        plan: also search with the best plan (default); False: without lightmem and with the
            configuration given only.
        Other arguments: as for :func:`max_batch_size`.

    Returns:
        A :class:`SequenceSearch`: ``baseline``, ``configured``, ``planned`` in positions,
        ``print()`` for the table.

    Raises:
        ValueError: a bad argument, or a batch without a sequence to grow (then name it with ``seq_dim``).
        EstimateError: the step fails at a longer sequence (a model whose positions are capped, a
            dimension that is not the sequence).
    """
    multiple = parse_count(multiple_of, flag="max_sequence_length(multiple_of=...)")
    assert multiple is not None
    axis = _Axis(
        "max_sequence_length", 0, multiple, sequence_axis(batch, seq_dim, fn_name="max_sequence_length"),
    )  # fmt: skip
    axis = dataclasses.replace(axis, start=max(1, axis.sequence.length // multiple))  # type: ignore[union-attr]
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < multiple:
        raise ValueError(f"max_sequence_length(limit=...): expected an int of at least multiple_of ({multiple}); got {limit!r}")

    def search() -> SequenceSearch:
        found = _search(
            axis, SequenceSearch, model, batch, budget, loss_fn, optimizer=optimizer, precision=precision, device=device,
            gpu=gpu, offload=offload, checkpoint=checkpoint, overhead_bytes=overhead_bytes, zero_grad=zero_grad,
            limit=limit // multiple, checkpoint_policy=checkpoint_policy, offload_optimizer=offload_optimizer, plan=plan,
            flops_per_s=flops_per_s, link_bytes_per_s=link_bytes_per_s, tile=tile, host_budget=host_budget,
        )  # fmt: skip
        found.seq_dim, found.batch_size = axis.sequence.dim, inspect_batch(batch).batch_size or 1  # type: ignore[union-attr]
        return found

    result = search()
    if result.stopped_by_logits:
        result.chunked_loss = largest_with_chunked_loss(search)
    return result


@dataclass(frozen=True)
class _Axis:
    """The dimension a search grows: the batch's (``sequence`` None) or its sequence's, in units of
    ``multiple`` positions; ``start`` is the batch's own size in those units."""

    fn_name: str
    start: int
    multiple: int = 1
    sequence: SequenceAxis | None = None

    def step(self, size: int) -> dict[str, Any]:
        """``run_configuration``'s arguments at ``size``."""
        if self.sequence is None:
            return {"batch_size": size}
        return {"sequence": self.sequence.grown(size * self.multiple)}

    def space(self, size: int) -> dict[str, Any]:
        """``plan_space``'s arguments at ``size``."""
        if self.sequence is None:
            return {"batch_size": size}
        return {"sequence_length": size * self.multiple, "seq_dim": self.sequence.dim}


def _search(
    axis: _Axis,
    kind: type[BatchSearch],
    model: nn.Module,
    batch: Any,
    budget: int | str,
    loss_fn: Callable[[nn.Module, Any], Any] | None,
    *,
    optimizer: str | Callable[..., Any] | None,
    precision: str | int,
    device: str,
    gpu: str | DeviceSpeeds,
    offload: bool | Mapping[str, Any] | OffloadSettings | None,
    checkpoint: Iterable[str | type] | str | None,
    overhead_bytes: int | str | None,
    zero_grad: str,
    limit: int,
    checkpoint_policy: CheckpointPolicyArg,
    offload_optimizer: bool | OptimizerOffloadSettings,
    plan: bool,
    flops_per_s: float | None,
    link_bytes_per_s: int | str | None,
    tile: bool | Iterable[str | type] | str,
    host_budget: int | float | str | None,
) -> Any:
    """The search of ``max_batch_size`` and ``max_sequence_length`` along ``axis``: one rule, one place."""
    started = time.perf_counter()
    fn_name = axis.fn_name
    settings = parse_settings(
        fn_name, model, loss_fn, optimizer=optimizer, precision=precision, device=device,
        overhead_bytes=overhead_bytes, budget=budget, zero_grad=zero_grad, checkpoint_policy=checkpoint_policy,
        offload_optimizer=offload_optimizer, gpu=gpu, flops_per_s=flops_per_s, link_bytes_per_s=link_bytes_per_s,
    )  # fmt: skip
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"{fn_name}(limit=...): expected a positive int; got {limit!r}")
    offload_config = parse_offload(offload, flag=f"{fn_name}(offload=...)")
    targets = parse_checkpoint(checkpoint, flag=f"{fn_name}(checkpoint=...)")
    info = inspect_batch(batch)
    budget_bytes = settings.budget_bytes
    assert budget_bytes is not None
    # A list of modules is a configuration to search (tiled as estimate_memory(tile=...) tiles them);
    # True or False only say whether plans may tile.
    tiles = None if isinstance(tile, bool) else TileSettings.parse(tile, spelling=Spelling(fn_name, (("modules", "tile"),)))

    def totals(
        offload_config: OffloadSettings | None, targets: tuple[Any, ...] | None, model_state: bool = False,
        tiles: TileSettings | None = None,
    ) -> Callable[[int], int]:
        """Peak + overhead of one configuration by batch size, each size estimated once."""
        seen: dict[int, int] = {}

        def total(size: int) -> int:
            if size not in seen:
                trace = run_configuration(
                    model, batch, settings, offload=offload_config, checkpoint=targets, info=info,
                    offload_optimizer=model_state, tile=tiles, **axis.step(size),
                )  # fmt: skip
                seen[size] = trace.reserved_bytes + settings.overhead_bytes
            return seen[size]

        total.seen = seen  # type: ignore[attr-defined]
        return total

    def search(
        offload_config: OffloadSettings | None, targets: tuple[Any, ...] | None, model_state: bool = False,
        tiles: TileSettings | None = None,
    ) -> tuple[int, list[tuple[int, int]]]:
        return largest_fitting(totals(offload_config, targets, model_state, tiles), budget_bytes, axis.start, limit)

    baseline_total = totals(None, None)
    baseline, baseline_evals = largest_fitting(baseline_total, budget_bytes, axis.start, limit)
    result = kind(baseline, None, budget_bytes, settings.overhead_bytes, {"baseline": baseline_evals}, limit=limit)
    if offload_config is not None or targets or settings.offload_optimizer or tiles is not None:
        configured, evals = search(offload_config, targets, settings.offload_optimizer, tiles)
        result.configured = configured
        result.evaluations["configured"] = evals
    if plan:
        common = {
            "optimizer": optimizer, "precision": precision, "device": device, "gpu": gpu, "overhead_bytes": overhead_bytes,
            "zero_grad": zero_grad, "flops_per_s": flops_per_s, "link_bytes_per_s": link_bytes_per_s,
            "checkpoint_policy": checkpoint_policy, "fn_name": fn_name, "tile": tile is not False, "host_budget": host_budget,
            "offload_optimizer": settings.optimizer_offload or False,  # as parsed: device_dtype included
            "offload": offload_config.with_choice(min_bytes=offload_config.min_bytes, include=None)
            if offload_config is not None else None,
        }  # fmt: skip
        # Whether a plan fits a size is asked of the planner's space at that size: its extremes,
        # with their offload windows, are that size's (at a small batch no saved tensor may reach
        # offload's threshold, and its space has no offload at all). So the answer is a function
        # of the size alone, whatever batch the search starts from.
        spaces: dict[int, Any] = {}
        model_state = settings.offload_optimizer
        host_stopped: set[int] = set()  # sizes whose configurations that fit the device hold too much host memory

        def space_at(size: int) -> Any:
            if size not in spaces:
                spaces[size] = plan_space(model, batch, loss_fn, **axis.space(size), **common)  # type: ignore[arg-type]
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
                total = space.reserved(verified) + space.settings.overhead_bytes
                result.evaluations.setdefault(f"plan: {space.describe(candidate)}", []).append((size, total))
                if not space.host.admits(verified.host):
                    if total <= budget_bytes:
                        host_stopped.add(size)
                    continue
                least = min(least, total)
            if least > budget_bytes:
                found = space.plan(budget_bytes)
                if found.fits:
                    least = found.predicted_reserved_bytes + found.overhead_bytes
                elif found.limited_by == "host":
                    host_stopped.add(size)
            if least <= budget_bytes:
                host_stopped.discard(size)
            return least

        # From the first size that does not fit without lightmem: where the plans start to matter.
        seed = max(1, min(baseline + 1, limit))
        # Without lightmem is one of the plans: the answer is never below it (a step's memory that
        # jumps, as a new segment does, bends the line the search starts from).
        result.planned, seen = largest_fitting(planned_total, budget_bytes, seed, limit, fits_at=baseline)
        past = [size for size, total in seen if size > result.planned and total > budget_bytes]
        if not past and result.planned < limit and planned_total(result.planned + 1) > budget_bytes:
            past = [result.planned + 1]  # a line confirmed the answer: the next size says what stopped it
        if past:  # what stopped the search: the host's limit, or the device's budget
            result.limited_by = "host" if min(past) in host_stopped else "device"
        for name, evaluations in result.evaluations.items():
            if name.startswith("plan: "):
                evaluations.sort()
        # The best plan at that size; where the allocator's replay tips it over the budget (the
        # extremes were asked their smallest reservable cap, the plan whether it runs under the
        # budget), the size below is planned (a few sizes at most).
        for _ in range(PLAN_TRIES):
            if not result.planned:
                break
            result.plan = space_at(result.planned).plan(budget_bytes)
            if result.plan.fits:
                break
            result.planned -= 1
        if past and result.limited_by == "device":
            result.stopped_by_logits = dominant_logits(space_at(min(past)).base) is not None
    result.seconds = time.perf_counter() - started
    return result.in_sizes(axis.multiple)
