"""``frontier``: what each batch size costs per sample with the best plan, against the largest batch
without lightmem and against the floor the device's physics allows.

For batch multiples of the largest batch that fits without lightmem (the reference), and for the
largest batch any plan fits, the planner's best plan and its predicted step time per sample. The
floor of a batch is the least time any schedule could take on this device: the step's compute, and
the bytes that must leave the device (its peak over the budget) either re-computed (priced as the
plan prices it, cheapest blocks first) or moved over the host link, whose time no schedule can take
below the bytes over the link's speed each way. The floor assumes perfect overlap and free choice
of what to move: a plan at the floor hides everything it moves.

Where steps were measured (``Frontier.measured``: ``benchmarks/frontier.py --measure``, the fits of
``benchmarks/plans_hold.py``), each row's time per sample is told against the measured 1x step, not
the predicted one (the H200 ran the GPT's 1x at 4.5 ms a sample where 5.5 ms was predicted: against
the prediction its larger batches looked 18% cheaper than they were), and the floor is taken at the
pace the 1x step measured (the floor's compute is the step's own), so each measured row's distance to
it is measured against measured.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, format_bytes, parse_count
from lightmem.config.estimator import parse_planned_offload
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.planner import plan_for
from lightmem.estimate.planning.result import Plan
from lightmem.estimate.planning.space import allocated_need
from lightmem.estimate.pricing.costs import CHECKPOINT, saves_bytes
from lightmem.estimate.pricing.timeline import step_time
from lightmem.estimate.search import largest_batches
from lightmem.estimate.sequence import longest_sequences
from lightmem.estimate.settings import AUTO_POLICY, EstimateSettings, parse_settings
from lightmem.estimate.trace.batch import inspect_batch, scalable_batch, sequence_axis
from lightmem.estimate.words import format_seconds
from lightmem.tables import format_table

DEFAULT_MULTIPLES = (1.0, 1.5, 2.0, 3.0, 5.0, 8.0)
PLAN_WIDTH = 60
"""The table's plan column wraps here: a plan in words runs to hundreds of characters."""


@dataclass(frozen=True)
class FrontierRow:
    """One batch size: the best plan there and what it costs, beside the floor."""

    batch_size: int
    label: str
    """``"1x"``, ``"1.5x"``, ... of the reference batch, or ``"largest"``."""
    fits: bool
    plan: str
    """The plan in words (``Plan.parts``), "nothing" when lightmem is not needed."""
    predicted_total_bytes: int
    """What the allocator reserves at the step's peak plus the overhead allowance: what the budget is
    compared with (the table's "total"); for a row that does not fit, the closest configuration's."""
    step_s: float
    floor_s: float
    reference_per_sample_s: float
    """The reference batch's predicted step per sample."""
    measured_step_s: float | None = None
    """The step as measured on a device (None: not measured)."""
    measured_reference_per_sample_s: float | None = None
    """The reference batch's measured step per sample (None: the reference was not measured)."""
    pace: float = 1.0
    """The reference step measured over predicted: the floor is taken at this pace beside measured steps."""
    host_bytes: int = 0
    """What the plan holds on the host (``Plan.host_total_bytes``: the offloaded activations' pool and model state)."""
    limited_by: str = ""
    """For a row that does not fit: "device" or "host" (``Plan.limited_by``)."""

    @property
    def per_sample_s(self) -> float:
        return self.step_s / self.batch_size

    @property
    def floor_per_sample_s(self) -> float:
        return self.floor_s / self.batch_size

    @property
    def vs_reference(self) -> float:
        """Time per sample over the reference batch's (1.0: as cheap per sample as without lightmem)."""
        return self.per_sample_s / self.reference_per_sample_s if self.reference_per_sample_s else 0.0

    @property
    def floor_vs_reference(self) -> float:
        return self.floor_per_sample_s / self.reference_per_sample_s if self.reference_per_sample_s else 0.0

    @property
    def measured_vs_reference(self) -> float | None:
        """Measured time per sample over the reference's measured one."""
        if self.measured_step_s is None or not self.measured_reference_per_sample_s:
            return None
        return self.measured_step_s / self.batch_size / self.measured_reference_per_sample_s

    @property
    def measured_vs_floor(self) -> float | None:
        """The measured step over the floor at the measured pace: how far a finer plan could still go."""
        if self.measured_step_s is None or not self.floor_s:
            return None
        return self.measured_step_s / (self.floor_s * self.pace)

    def to_dict(self) -> dict[str, Any]:
        """The row, JSON-ready; a row that does not fit has no step to time: its times are None."""
        times = {
            "step_seconds": self.step_s, "per_sample_seconds": self.per_sample_s, "vs_reference": self.vs_reference,
            "floor_seconds": self.floor_s, "floor_per_sample_seconds": self.floor_per_sample_s,
            "floor_vs_reference": self.floor_vs_reference,
        }  # fmt: skip
        measured = {
            "measured_step_seconds": self.measured_step_s, "measured_vs_reference": self.measured_vs_reference,
            "measured_vs_floor": self.measured_vs_floor,
        }  # fmt: skip
        return {
            "batch_size": self.batch_size, "label": self.label, "fits": self.fits, "plan": self.plan,
            "predicted_total_bytes": self.predicted_total_bytes, "host_bytes": self.host_bytes,
            "limited_by": self.limited_by, **(times if self.fits else dict.fromkeys(times)),
            **(measured if self.measured_step_s is not None else {}),
        }  # fmt: skip


ROUTED_TOTALS = (
    "Totals hold each step under the worst-case routing of its experts; step times assume balanced routing "
    "(docs/moe.md)."
)


@dataclass
class Frontier:
    """The frontier of one model on one device budget (see the module docstring)."""

    budget_bytes: int
    reference_batch: int
    """The largest batch that fits without lightmem (0: not even one; the reference is then a batch
    of 1 with its plan)."""
    largest_batch: int
    """The largest batch any plan of the planner's space fits."""
    rows: list[FrontierRow] = field(default_factory=list)
    speeds: DeviceSpeeds | None = None
    plans: dict[int, Plan] = field(default_factory=dict, repr=False)
    """The plan behind each row, by batch size."""
    seconds: float = 0.0
    reason: str = ""
    """When not even a batch of 1 fits with a plan (no rows): why, as the plan at batch 1 says."""
    chunked_loss: Frontier | None = None
    """Where the loss's logits dominate the rows that do not fit: the same rows with the loss priced
    as chunked (``lightmem.linear_cross_entropy``), and the largest batch a plan then fits; per
    sample against the same reference."""
    limit: int | None = None
    """The largest batch size searched (``frontier(limit=...)``): a reference or largest batch equal to
    it is where the search stopped, not the largest that fits."""
    axis: str = "batch"
    """What the rows grow: "batch" (sizes are batch sizes) or "sequence" (sizes are sequence lengths
    at the batch's own batch size; per sample is then per position)."""
    limited_by: str = ""
    """Past the largest size: what stopped the plans, "device" or "host" (``BatchSearch.limited_by``)."""

    def measured(self, steps: Mapping[int, float]) -> Frontier:
        """This frontier with the steps measured on a device (``measured_rows``)."""
        return dataclasses.replace(self, rows=measured_rows(self.rows, steps))

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "reference_batch": self.reference_batch,
            "largest_batch": self.largest_batch,
            "speeds": self.speeds.to_dict() if self.speeds is not None else None,
            "rows": [row.to_dict() for row in self.rows],
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
            "chunked_loss": self.chunked_loss.to_dict() if self.chunked_loss is not None else None,
            "limit": self.limit,
            "axis": self.axis,
            "limited_by": self.limited_by,
        }

    def to_text(self) -> str:
        """The frontier as a table: one row per batch size, the plan in words wrapped at
        ``PLAN_WIDTH`` characters; with measured steps, their columns after the predicted ones
        (labelled "measured")."""
        where = f"Priced at {self.speeds.describe()}." if self.speeds is not None else ""
        if not self.rows:
            title = f"Frontier on {format_bytes(self.budget_bytes)}: no batch fits, not even 1 with a plan: {self.reason}"
            return title + ("\n" + where if where else "") + "\n"
        capped = self.limit is not None and self.reference_batch >= self.limit
        reference = (
            f"reference batch {self.reference_batch} (the limit searched: larger batches may fit without lightmem too)"
            if capped else f"reference batch {self.reference_batch} (the largest without lightmem)" if self.reference_batch
            else "nothing fits without lightmem (the reference is a batch of 1 with its plan)"
        )  # fmt: skip
        largest = f"{self.largest_batch}" + (
            " (the limit searched)" if not capped and self.limit is not None and self.largest_batch >= self.limit else ""
        )
        if self.axis == "sequence":
            reference = reference.replace("reference batch", "reference length").replace("a batch of 1", "a length of 1")
        host = " (past it the host's memory, not the device's, sets the limit)" if self.limited_by == "host" else ""
        title = f"Frontier on {format_bytes(self.budget_bytes)}: {reference}, largest with a plan {largest}{host}"
        if any(found.routing_bound_bytes for found in self.plans.values()):
            where = (ROUTED_TOTALS + " " + where).strip()
        text = self._table(title) + ("\n" + where if where else "") + "\n"
        if self.chunked_loss is not None:
            text += (
                f"With a chunked loss (lightmem.linear_cross_entropy; the loss's logits dominate the rows that do not "
                f"fit): largest with a plan {self.chunked_loss.largest_batch}\n{self.chunked_loss._table()}\n"
            )
        return text

    def _table(self, title: str | None = None) -> str:
        """The rows as ``to_text`` shows them, under ``title``."""
        unit = ("length", "per position", "floor / position") if self.axis == "sequence" else ("batch", "per sample", "floor / sample")
        headers = [unit[0], "", "plan", "total", "host", "step", unit[1], "vs reference", unit[2], "floor vs ref"]
        measured = any(row.measured_step_s is not None for row in self.rows)
        if measured:
            headers += ["measured step", "measured vs measured ref", "measured vs floor"]
        rows = []
        for row in self.rows:
            why = " (the host's memory)" if row.limited_by == "host" else ""
            text = row.plan if row.fits else f"does not fit{why}; closest: {row.plan}"
            first, *rest = textwrap.wrap(text, PLAN_WIDTH) or [""]
            cells = [
                str(row.batch_size), row.label, first,
                format_bytes(row.predicted_total_bytes), format_bytes(row.host_bytes) if row.host_bytes else "-",
                format_seconds(row.step_s) if row.fits else "-",
                format_seconds(row.per_sample_s) if row.fits else "-", f"{row.vs_reference:.2f}x" if row.fits else "-",
                format_seconds(row.floor_per_sample_s) if row.fits else "-",
                f"{row.floor_vs_reference:.2f}x" if row.fits else "-",
            ]  # fmt: skip
            if measured:
                ratio, floor = row.measured_vs_reference, row.measured_vs_floor
                cells += [
                    format_seconds(row.measured_step_s) if row.measured_step_s is not None else "-",
                    f"{ratio:.2f}x" if ratio is not None else "-", f"{floor:.2f}x" if floor is not None else "-",
                ]
            rows.append(cells)
            rows.extend(["", "", line] + [""] * (len(headers) - 3) for line in rest)
        return format_table(rows, headers, title=title, align="rlllrrrrrr" + "rrr" * measured)

    def print(self) -> None:
        print(self.to_text(), end="")

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return (
            f"Frontier(budget {format_bytes(self.budget_bytes)}, reference batch {self.reference_batch}, largest "
            f"with a plan {self.largest_batch}, {len(self.rows)} rows; print() for the table)"
        )


def measured_rows(rows: Sequence[FrontierRow], steps: Mapping[int, float]) -> list[FrontierRow]:
    """``rows`` with the steps measured on a device (seconds by batch size): each row's time per
    sample told against the reference's (the "1x" row) measured step, when it ran, and the floor taken
    at the pace that step measured (module docstring)."""
    reference = next((row for row in rows if row.label == "1x"), None)
    measured = steps.get(reference.batch_size) if reference is not None else None
    per_sample, pace = None, 1.0
    if reference is not None and measured:
        per_sample = measured / reference.batch_size
        pace = measured / reference.step_s if reference.step_s else 1.0
    return [
        dataclasses.replace(row, measured_step_s=steps.get(row.batch_size), measured_reference_per_sample_s=per_sample, pace=pace)
        for row in rows
    ]


def labelled_batches(reference: int, multiples: Sequence[float]) -> dict[int, str]:
    """Batch size -> label (``"1.5x"``) for ``multiples`` of ``reference``, by size: each multiple's
    batch is ``reference * multiple`` rounded half up, at least 1; a batch that several multiples
    give is labelled by the one nearest its own ratio to ``reference`` (the smaller on a tie), so
    with a reference of 1, 1.5x and 2x are one row, batch 2, labelled "2x"."""
    given: dict[int, list[float]] = {}
    for multiple in multiples:
        given.setdefault(max(1, math.floor(reference * multiple + 0.5)), []).append(multiple)
    return {
        size: f"{min(near, key=lambda multiple: (abs(multiple - size / reference), multiple)):g}x"
        for size, near in sorted(given.items())
    }


def floor_seconds(chosen: Plan) -> float:
    """The least time any schedule takes for ``chosen``'s batch on its device (module docstring):
    the compute, and the bytes over the budget re-computed or moved, whichever mix costs least."""
    estimate, costs = chosen.estimate, chosen.costs
    if estimate is None or chosen.speeds is None or costs is None:
        return chosen.baseline_step_seconds
    base = chosen.baseline_step_seconds
    baseline = estimate.scenarios["baseline"]
    available = chosen.budget_bytes - chosen.overhead_bytes
    if baseline.reserved <= available:
        return base
    need = allocated_need(baseline.peak_bytes, baseline.reserved, available)  # allocated bytes to take off the peak
    link = chosen.speeds.link_bytes_per_s
    # Re-computation, cheapest seconds per byte first: a piecewise-linear cost of bytes saved. A
    # block's re-run costs what it adds to the step as the plan prices it (the host's launches too).
    layers = [block for block in estimate.blocks.values() if block.repeated] or list(estimate.blocks.values())
    pieces = sorted(
        (
            (step_time(estimate.blocks, {block.name: CHECKPOINT}, costs).recompute_s, saves_bytes(block, CHECKPOINT, costs))
            for block in layers
        ),
        key=lambda piece: piece[0] / piece[1] if piece[1] else float("inf"),
    )
    movable = sum(block.offloadable_bytes(costs.min_bytes) for block in estimate.blocks.values())
    if not costs.allow_offload:
        movable = 0

    def recompute_for(nbytes: float) -> float | None:
        seconds = 0.0
        for piece_s, piece_bytes in pieces:
            if nbytes <= 0:
                break
            if piece_bytes <= 0:
                continue
            taken = min(nbytes, piece_bytes)
            seconds += piece_s * taken / piece_bytes
            nbytes -= taken
        return seconds if nbytes <= 0 else None

    best = float("inf")
    steps = 256
    for index in range(steps + 1):
        moved = min(need, movable) * index / steps
        rerun = recompute_for(need - moved)
        if rerun is None:
            continue
        best = min(best, max(base + rerun, moved / link))
    return best if best != float("inf") else chosen.step_seconds


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def frontier(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
    multiples: Sequence[float] = DEFAULT_MULTIPLES,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    gpu: str | DeviceSpeeds = "auto",
    overhead_bytes: int | str | None = None,
    zero_grad: str = "after_forward",
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str | None = None,
    offload: bool | Mapping[str, Any] | OffloadSettings | None = None,
    checkpoint_policy: CheckpointPolicyArg = AUTO_POLICY,
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    limit: int = 1 << 16,
    axis: str = "batch",
    seq_dim: int | None = None,
    multiple_of: int = 1,
    tile: bool | None = None,
    host_budget: int | float | str | None = None,
) -> Frontier:
    """For batch ``multiples`` of the largest batch without lightmem, and the largest batch any plan
    fits, the best plan's predicted time per sample against that reference and against the floor
    this device allows (module docstring). Arguments as for :func:`lightmem.plan` (its prices
    ``flops_per_s`` and ``link_bytes_per_s`` included: every row and its floor are priced at them);
    ``checkpoint_policy`` defaults to ``"auto"`` (the planner chooses). A multiple's batch and its
    label: :func:`labelled_batches` (with a reference of 3, 1.5x is batch 5).

    ``axis="sequence"``: the rows are sequence lengths instead, multiples of the longest without
    lightmem and the longest any plan fits (:func:`lightmem.max_sequence_length`, ``seq_dim`` and
    ``multiple_of`` as there, ``limit`` in positions), at the batch's own batch size; per sample is
    then per position, and the plans may tile (``tile``, None: along the sequence only, as for
    :func:`lightmem.max_sequence_length`; True or False: as for :func:`lightmem.plan`). Each row shows the host memory its plan holds, and the title says when the
    host's memory, not the device's, stops the plans past the largest (``host_budget``: as for
    :func:`lightmem.plan`).

    Returns:
        A :class:`Frontier`: ``print()`` for the table, ``to_dict()`` for programs.

    Raises:
        ValueError: a bad argument, or a batch without a batch dimension to scale, named as
            ``frontier(argument=...)`` before any search.
    """
    started = time.perf_counter()
    if not multiples or not all(map(_positive_number, multiples)):
        raise ValueError(f"frontier(multiples=...): expected positive numbers; got {multiples!r}")
    settings = parse_settings(
        "frontier", model, loss_fn, optimizer=optimizer, precision=precision, device=device,
        overhead_bytes=overhead_bytes, budget=budget, zero_grad=zero_grad, checkpoint_policy=checkpoint_policy,
        gpu=gpu, offload_optimizer=offload_optimizer, flops_per_s=flops_per_s, link_bytes_per_s=link_bytes_per_s,
        auto_policy=True, tile=axis == "sequence" if tile is None else tile, host_budget=host_budget,
    )  # fmt: skip
    parse_count(limit, flag="frontier(limit=...)")
    if axis not in ("batch", "sequence"):
        raise ValueError(f"frontier(axis=...): expected 'batch' or 'sequence'; got {axis!r}")
    multiple = parse_count(multiple_of, flag="frontier(multiple_of=...)") or 1
    # The offload settings as parsed here, so that an error found later (a pattern that matches no
    # module) names frontier's argument.
    settings = settings.searching(parse_planned_offload(True if offload is None else offload, flag="frontier(offload=...)"))
    info = scalable_batch(batch, flag="frontier(batch=...)") if axis == "batch" else inspect_batch(batch)
    sequence = sequence_axis(batch, seq_dim, fn_name="frontier") if axis == "sequence" else None
    budget_bytes = settings.budget_bytes
    assert budget_bytes is not None
    # The largest sizes are searched under "full" where the plans choose their policy ("auto").
    searched = settings.with_policy("full") if settings.checkpoint_policy == AUTO_POLICY else settings

    def largest_of(searched: EstimateSettings) -> Any:
        """The search along ``axis``: the largest size without lightmem and with the best plan."""
        if sequence is None:
            return largest_batches(model, batch, searched, info, plan=True, limit=limit)
        return longest_sequences(model, batch, searched, info, sequence, multiple=multiple, limit=limit)

    def plan_at(size: int, settings: EstimateSettings = settings) -> Plan:
        """The best plan for a row of ``size`` along ``axis``."""
        if sequence is None:
            return plan_for(model, batch, settings, batch_size=size)
        return plan_for(model, batch, settings, sequence=sequence.grown(size))

    search = largest_of(searched)
    reference = max(search.baseline, 1)
    sizes = labelled_batches(reference, multiples)
    largest = search.planned or 0
    if largest and largest not in sizes:
        sizes[largest] = "largest"
    result = Frontier(budget_bytes, search.baseline, largest, limit=limit, axis=axis, limited_by=search.limited_by)
    if not largest:  # not even a batch of 1 fits: no rows, what the plan there says instead
        at_one = plan_at(1)
        result.plans[1], result.speeds, result.reason = at_one, at_one.speeds, at_one.reason
        result.seconds = time.perf_counter() - started
        return result
    reference_plan = plan_at(reference)
    reference_per_sample = reference_plan.step_seconds / reference
    result.speeds = reference_plan.speeds
    for size in sorted(sizes):
        found = reference_plan if size == reference else plan_at(size)
        result.plans[size] = found
        result.rows.append(_row(found, size, sizes[size], reference_per_sample))
    chunked = {size: found.chunked_loss for size, found in result.plans.items() if found.chunked_loss is not None}
    if chunked:  # the rows a plan does not fit because of the logits, again with the loss priced as chunked
        # The sequence's search did it already where the logits stopped its plans.
        what_if = getattr(search, "chunked_loss", None) or largest_of(searched.priced_as_chunked())
        section = Frontier(
            budget_bytes, search.baseline, what_if.planned or 0, speeds=result.speeds, axis=axis, limited_by=what_if.limited_by
        )  # fmt: skip
        if section.largest_batch and section.largest_batch not in chunked:
            chunked[section.largest_batch] = plan_at(section.largest_batch, settings.priced_as_chunked())
        for size in sorted(chunked):
            section.plans[size] = chunked[size]
            section.rows.append(_row(chunked[size], size, sizes.get(size, "largest"), reference_per_sample))
        result.chunked_loss = section
    result.seconds = time.perf_counter() - started
    return result


def _row(found: Plan, size: int, label: str, reference_per_sample: float) -> FrontierRow:
    """The frontier's row for ``found``, the plan at batch ``size`` (its closest configuration
    when it does not fit)."""
    parts, total = "; ".join(found.parts()) or "nothing", found.predicted_total_bytes
    if not found.fits:
        closest = min(found.alternatives, key=lambda option: option.predicted_total_bytes, default=None)
        if closest is not None:
            parts, total = closest.description, closest.predicted_total_bytes
        else:
            parts = found.reason
    return FrontierRow(
        size, label, found.fits, parts, total,
        found.step_seconds if found.fits else found.baseline_step_seconds, floor_seconds(found),
        reference_per_sample, host_bytes=found.host_total_bytes, limited_by="" if found.fits else found.limited_by,
    )  # fmt: skip
