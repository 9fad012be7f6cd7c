"""The estimator's words at the side: durations, policies, runs of block names, what dominates a
step's peak; every message is built from these."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import format_bytes
from lightmem.estimate.trace.blocks import ROOT_BLOCK
from lightmem.estimate.trace.logits import CHUNKED_LOSS
from lightmem.estimate.trace.step import StepTrace


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
        text += (
            f"; the loss's logits ({logits.rows:,} x {logits.classes:,}, from {logits.weight_name}), their float32 "
            f"copies and gradients take {format_bytes(logits.bytes_at_peak)}"
        )
        if logits.replaceable:
            text += (
                f": a chunked loss ({CHUNKED_LOSS}) would bring the peak to about "
                f"{format_bytes(logits.peak_bytes_chunked)}"
            )
        else:
            text += f" ({logits.change})"
    return text


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


