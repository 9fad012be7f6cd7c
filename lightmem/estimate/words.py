"""The estimator's words at the side: durations, policies, runs of block names, a configuration,
the loss's logits, what dominates a step's peak and why a plan does or does not fit. Every message
of the estimate, the plan, the frontier and the advice is built from these; none is written twice.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import format_bytes
from lightmem.estimate.trace.blocks import ROOT_BLOCK
from lightmem.estimate.trace.logits import CHUNKED_LOSS, LossLogits
from lightmem.estimate.trace.step import StepTrace


def logits_share(logits: LossLogits) -> str:
    """The loss's logits and what they take: "the loss's logits (33,792 x 32,000, from
    lm_head.weight), their float32 copies and gradients take 12.09 GiB"."""
    return (
        f"the loss's logits ({logits.rows:,} x {logits.classes:,}, from {logits.weight_name}), their float32 "
        f"copies and gradients take {format_bytes(logits.bytes_at_peak)}"
    )


def dominant_part(trace: StepTrace) -> str:
    """What dominates a traced step's peak, in words, for a message about a step that does not fit:
    where the peak is, its largest part, and the loss's logits with what a chunked loss would
    leave and the change that gets it when they are a large share of it (``LossLogits.dominates``)."""
    peak = trace.peak
    part, part_bytes = max(peak.breakdown.items(), key=lambda item: item[1])
    where = f"{peak.phase}: {peak.op}" + (f" in {peak.block}" if peak.block else "")
    text = f"{format_bytes(peak.bytes)} at {where}, {part.replace('_', ' ')} {format_bytes(part_bytes)} of it"
    logits = trace.loss_logits
    if logits is not None and logits.dominates(peak.bytes):
        text += "; " + logits_share(logits)
        if logits.replaceable:
            text += (
                f": a chunked loss ({CHUNKED_LOSS}) would bring the peak to about "
                f"{format_bytes(logits.peak_bytes_chunked)}"
            )
        else:
            text += f" ({logits.change})"
    return text


def configuration_parts(
    checkpoint: Iterable[str],
    kinds: Mapping[str, str],
    min_bytes: int,
    *,
    everywhere: bool = False,
    offloaded: Iterable[str] = (),
    partial: Iterable[tuple[str, int]] = (),
    policy: CheckpointPolicyArg = "full",
    model_state: str | None = None,
    in_full: bool = False,
    tile: Iterable[str] = (),
) -> list[str]:
    """A lightmem configuration in words, one phrase per technique: "checkpoint blocks.0-3
    (Bottleneck)", "offload every saved tensor of at least 1.00 MiB", "offload blocks.0-3
    (Bottleneck)", "offload the tensors of at least 4.00 MiB of stem.0". ``offloaded``: blocks
    whose saved tensors of at least ``min_bytes`` move, ``partial``: (block, threshold) whose
    largest ones only; ``everywhere``: every saved tensor anywhere. ``in_full``, as a chosen plan
    says itself (``Plan.parts``): a checkpoint policy other than "full", the offload threshold after
    the blocks, "saved tensors"; and first, with ``model_state`` (what lies on the device besides:
    "" or ", bf16 parameters on the device"), model-state offload. ``tile``: the modules run in
    sequence shards ("tile model.layers.0-15.mlp (LlamaMLP)", after model-state offload)."""
    parts = []
    if model_state is not None:
        parts.append(f"offload_optimizer (gradients and optimizer state on the host{model_state})")
    tiled = sorted(tile, key=natural_order)
    if tiled:
        parts.append(f"tile {compact_modules(tiled, kinds)}")
    checkpoint = sorted(checkpoint, key=natural_order)
    if checkpoint:
        said = f" (policy {policy_name(policy)})" if in_full and policy != "full" else ""
        parts.append(f"checkpoint {compact_names(checkpoint, kinds)}{said}")
    if everywhere:
        parts.append(f"offload every saved tensor of at least {format_bytes(min_bytes)}")
        return parts
    offloaded = sorted(offloaded, key=natural_order)
    if offloaded:
        threshold = f" (min_bytes {format_bytes(min_bytes)})" if in_full else ""
        parts.append(f"offload {compact_names(offloaded, kinds)}{threshold}")
    partial = list(partial)
    tensors = "saved tensors" if in_full else "tensors"
    for threshold in sorted({size for _, size in partial if size or not in_full}):
        names = sorted((name for name, size in partial if size == threshold), key=natural_order)
        parts.append(f"offload the {tensors} of at least {format_bytes(threshold)} of {compact_names(names, kinds)}")
    return parts


def budget_left(budget_bytes: int, overhead_bytes: int) -> str:
    """What a budget leaves for the step: "the 16.00 GiB budget", or with an overhead allowance
    "the 15.00 GiB the 16.00 GiB budget leaves after the 1.00 GiB overhead allowance"."""
    if not overhead_bytes:
        return f"the {format_bytes(budget_bytes)} budget"
    return (
        f"the {format_bytes(budget_bytes - overhead_bytes)} the {format_bytes(budget_bytes)} budget leaves after the "
        f"{format_bytes(overhead_bytes)} overhead allowance"
    )


def static_reason(static_parts: str, static_bytes: int, budget_bytes: int, overhead_bytes: int) -> str:
    """Why no plan fits when the model state alone is over the budget."""
    return (
        f"{static_parts} alone take {format_bytes(static_bytes)}, over {budget_left(budget_bytes, overhead_bytes)}; "
        "no activation technique helps (see the advice)"
    )


def fits_as_it_is(model_state: bool, peak_bytes: int, overhead_bytes: int, routed: bool) -> str:
    """Why the step needs no activation technique: it fits already, or with model-state offload."""
    return (
        f"with offload_optimizer the peak is {format_bytes(peak_bytes)} + overhead {format_bytes(overhead_bytes)}"
        if model_state
        else "the baseline step already fits"
    ) + (" under the worst-case routing of its experts" if routed else "")


def nothing_to_plan(min_bytes: int) -> str:
    return (
        "the model has no blocks to checkpoint and saves no tensor of at least "
        f"{format_bytes(min_bytes)} to offload"
    )


def nothing_fits(refused: Sequence[Any], budget_bytes: int, overhead_bytes: int, dominant: str) -> str:
    """Why no configuration fits: the closest verified one of each kind (``PlanOption``s), with
    what it reserves, and what dominates the closest one's peak."""
    return "no configuration in the planner's space fits: " + "; ".join(
        f"{option.description}: {format_bytes(option.predicted_total_bytes - overhead_bytes)} reserved"
        for option in refused
    ) + (
        f", over the {format_bytes(budget_bytes - overhead_bytes)} available after the overhead "
        f"allowance; what remains is parameters, gradients, optimizer state, temporaries and the tensors "
        f"below the offload threshold (the closest peak is {dominant})"
    )


def verified_fit(peak_bytes: int, reserved_bytes: int, overhead_bytes: int, routing_bound: Any) -> str:
    """Why a chosen configuration fits: its verified peak, reserved, overhead (and the worst-case
    routing's for a mixture of experts)."""
    return (
        f"verified peak {format_bytes(peak_bytes)} allocated, "
        f"{format_bytes(reserved_bytes)} reserved + overhead {format_bytes(overhead_bytes)}"
    ) + (
        f"; under the worst-case routing of its experts {format_bytes(routing_bound.peak_bytes)} allocated, "
        f"{format_bytes(routing_bound.reserved_bytes)} reserved" if routing_bound is not None else ""
    )  # fmt: skip


def format_seconds(seconds: float) -> str:
    """A predicted cost as people read it: '3.20 s', '41.0 ms', '12.5 us', '0 s'."""
    if seconds <= 0:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"


def policy_name(policy: CheckpointPolicyArg) -> str:
    """A policy as JSON and people read it: its name, or the callable's name."""
    return policy if isinstance(policy, str) else getattr(policy, "__qualname__", repr(policy))


def natural_order(name: str) -> list[object]:
    """Sort key for block names: "blocks.2" before "blocks.10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def compact_names(names: list[str], kinds: Mapping[str, str] | None = None) -> str:
    """'blocks.0', 'blocks.1', 'blocks.2', 'head' -> 'blocks.0-2, head'.

    With ``kinds`` (class name per block), each run is followed by its class:
    'transformer.h.0-7 (GPT2Block), lm_head (Linear)'.
    """
    kinds = kinds or {}
    groups: dict[str, list[int]] = defaultdict(list)
    order: list[str] = []
    for name in names:
        match = re.fullmatch(r"(.*\.)(\d+)", name)
        if match is None:
            order.append(name)
            continue
        prefix = match.group(1)
        if prefix not in groups:
            order.append(prefix)
        groups[prefix].append(int(match.group(2)))

    def labelled(text: str, members: list[str]) -> str:
        classes = {kinds[member] for member in members if kinds.get(member)}
        return f"{text} ({classes.pop()})" if len(classes) == 1 else text

    parts = []
    for key in order:
        if key not in groups:
            if key == ROOT_BLOCK:
                continue
            parts.append(labelled(key, [key]))
            continue
        numbers = sorted(groups[key])
        start = previous = numbers[0]
        runs = []
        for number in numbers[1:] + [None]:  # type: ignore[list-item]
            if number is not None and number == previous + 1:
                previous = number
                continue
            runs.append((start, previous))
            if number is not None:
                start = previous = number
        for first, last in runs:
            members = [f"{key}{n}" for n in range(first, last + 1)]
            text = f"{key}{first}" if first == last else f"{key}{first}-{last}"
            parts.append(labelled(text, members))
    return ", ".join(parts)




def compact_modules(names: list[str], kinds: Mapping[str, str] | None = None) -> str:
    """Modules inside repeated layers, by their first index: 'model.layers.0.mlp' ... 'model.layers.15.mlp',
    'model.norm' -> 'model.layers.0-15.mlp (LlamaMLP), model.norm (LlamaRMSNorm)' (with ``kinds``,
    the class name per module)."""
    kinds = kinds or {}
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    order: list[tuple[str, str]] = []
    for name in names:
        match = re.fullmatch(r"(.*?\.)(\d+)((?:\..*)?)", name)
        key = (match.group(1), match.group(3)) if match else (name, "")
        if key not in groups and key not in order:
            order.append(key)
        if match:
            groups[key].append(int(match.group(2)))
    parts = []
    for prefix, suffix in order:
        numbers = sorted(groups.get((prefix, suffix), []))
        if not numbers:
            parts.append(f"{prefix} ({kinds[prefix]})" if kinds.get(prefix) else prefix)
            continue
        runs, start = [], numbers[0]
        for previous, number in zip(numbers, [*numbers[1:], None]):
            if number is None or number != previous + 1:  # a run ends at previous
                runs.append((start, previous))
                start = number
        members = [f"{prefix}{n}{suffix}" for n in numbers]
        classes = {kinds[member] for member in members if kinds.get(member)}
        text = ", ".join(f"{prefix}{a}{suffix}" if a == b else f"{prefix}{a}-{b}{suffix}" for a, b in runs)
        parts.append(f"{text} ({classes.pop()})" if len(classes) == 1 else text)
    return ", ".join(parts)
