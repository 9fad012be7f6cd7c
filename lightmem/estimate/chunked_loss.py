"""What a chunked loss would give where the loss's logits dominate a step: the same questions
(does a plan fit this batch, the largest batch) asked again with the loss priced as chunked
(``EstimateSettings.priced_as_chunked``), so that ``estimate_memory``, ``plan``, ``frontier`` and
``plan="auto"``'s refusal put the answer with ``lightmem.linear_cross_entropy`` beside the answer as
the loss is written, before the user changes a line.

The questions are the callers' own (each asks its own search again with the settings priced as
chunked); this module says when to ask them (``dominant_logits``) and words the answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightmem.config import format_bytes
from lightmem.estimate.planning.result import Plan
from lightmem.estimate.report import MemoryEstimate
from lightmem.estimate.trace.logits import LossLogits
from lightmem.estimate.words import format_seconds

SEARCH_MULTIPLE = 16
"""``plan="auto"``'s refusal searches the largest batch a chunked loss reaches up to this multiple
of the batch refused."""


def dominant_logits(estimate: MemoryEstimate | None, *, priced_as_chunked: bool = False) -> LossLogits | None:
    """The loss's logits of ``estimate``'s baseline step when they dominate its peak and the chunked
    loss can take the loss's place (``LossLogits.replaceable``), else None; None too for a step
    already ``priced_as_chunked``."""
    if estimate is None or priced_as_chunked:
        return None
    logits = estimate.loss_logits
    baseline = estimate.scenarios.get("baseline")
    if logits is None or baseline is None or not logits.replaceable or not logits.dominates(baseline.peak_bytes):
        return None
    return logits


@dataclass(frozen=True)
class ChunkedLossReach:
    """The largest batch that fits a budget without lightmem, as the loss is written and with it
    chunked (``estimate_memory``'s answer where the logits dominate)."""

    budget_bytes: int
    batch_size: int
    """With the loss chunked."""
    as_written_batch_size: int

    def to_dict(self) -> dict[str, int]:
        return {
            "budget_bytes": self.budget_bytes, "batch_size": self.batch_size,
            "as_written_batch_size": self.as_written_batch_size,
        }  # fmt: skip


def no_fit_sentence(chosen: Plan, largest: int | None, limit: int | None = None) -> str:
    """For ``plan="auto"``'s refusal: the change that chunks the loss, whether this batch then fits
    (its plan and step) and the largest batch a plan then fits (``largest``, searched up to
    ``limit``; None: not searched). Empty when the logits do not dominate."""
    logits = dominant_logits(chosen.estimate)
    if logits is None:
        return ""
    text = f"To chunk the loss: {logits.change}"
    chunked = chosen.chunked_loss
    fits = chunked is not None and chunked.fits
    if fits:
        what = "; ".join(chunked.parts()) or "without lightmem"  # type: ignore[union-attr]
        text += f". With it this batch fits ({what}, predicted step {format_seconds(chunked.step_seconds)})"  # type: ignore[union-attr]
    if largest:
        reach = f"batches up to {largest}" + (" (as far as it was searched)" if largest == limit else "")
        text += f" and plans fit {reach}" if fits else f". With it plans fit {reach}"
    return text


def reach_sentence(reach: ChunkedLossReach | None) -> str:
    """The advice's words for ``estimate_memory``'s reach (empty without one)."""
    if reach is None or not reach.batch_size:  # not a batch fits even chunked: other advice says why
        return ""
    written = f"up to {reach.as_written_batch_size}" if reach.as_written_batch_size else "not even 1"
    return (
        f" Under the {format_bytes(reach.budget_bytes)} budget without lightmem, batches up to "
        f"{reach.batch_size} would fit with it, {written} as written."
    )


__all__ = [
    "SEARCH_MULTIPLE", "ChunkedLossReach", "dominant_logits", "no_fit_sentence", "reach_sentence",
]  # fmt: skip
