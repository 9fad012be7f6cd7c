"""``max_sequence_length``: the longest sequence whose step fits a budget, found with the estimator
alone: ``max_batch_size``'s search (``lightmem.estimate.search``) along the batch's sequence."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, TileSettings, format_bytes, parse_count
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.search import Axis, BatchSearch, largest_batches, search_arguments
from lightmem.estimate.settings import EstimateSettings
from lightmem.estimate.trace.batch import BatchInfo, SequenceAxis, sequence_axis
from lightmem.estimate.words import format_seconds
from lightmem.tables import format_table

DEFAULT_SEQUENCE_LIMIT = 1 << 24
"""The longest sequence ``max_sequence_length`` searches by default: 16M positions."""


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
        tile: True (default): the plans may tile position-wise modules (exact within 1e-6, not
            bitwise; :func:`lightmem.plan`); a list: those modules tiled in the configuration given
            too; False: the plans never tile.
        Other arguments: as for :func:`max_batch_size`.

    Returns:
        A :class:`SequenceSearch`: ``baseline``, ``configured``, ``planned`` in positions,
        ``print()`` for the table.

    Raises:
        ValueError: a bad argument, or a batch without a sequence to grow (then name it with ``seq_dim``).
        EstimateError: the step fails at a longer sequence (a model whose positions are capped, a
            dimension that is not the sequence).
    """
    started = time.perf_counter()
    fn_name = "max_sequence_length"
    multiple = parse_count(multiple_of, flag=f"{fn_name}(multiple_of=...)")
    assert multiple is not None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < multiple:
        raise ValueError(f"{fn_name}(limit=...): expected an int of at least multiple_of ({multiple}); got {limit!r}")
    found = search_arguments(
        model, batch, budget, loss_fn, optimizer=optimizer, precision=precision, device=device, gpu=gpu, offload=offload,
        checkpoint=checkpoint, overhead_bytes=overhead_bytes, zero_grad=zero_grad, limit=limit // multiple,
        checkpoint_policy=checkpoint_policy, offload_optimizer=offload_optimizer, flops_per_s=flops_per_s,
        link_bytes_per_s=link_bytes_per_s, tile=tile, host_budget=host_budget, fn_name=fn_name,
        scales_batch=False,
    )  # fmt: skip
    return longest_sequences(
        model, batch, found.settings, found.info, sequence_axis(batch, seq_dim, fn_name=fn_name), multiple=multiple,
        limit=limit, offload=found.offload, checkpoint=found.checkpoint, tile=found.tile, plan=plan, started=started,
    )  # fmt: skip


def longest_sequences(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    info: BatchInfo,
    sequence: SequenceAxis,
    *,
    multiple: int = 1,
    limit: int = DEFAULT_SEQUENCE_LIMIT,
    offload: OffloadSettings | None = None,
    checkpoint: tuple[Any, ...] | None = None,
    tile: TileSettings | None = None,
    plan: bool = True,
    started: float | None = None,
) -> SequenceSearch:
    """``max_sequence_length`` with its arguments parsed (``settings``, the batch's ``info`` and
    ``sequence``): the search along the sequence in units of ``multiple`` positions up to ``limit``,
    and where the loss's logits stop the plans, the same search with the loss priced as chunked."""
    started = time.perf_counter() if started is None else started
    axis = Axis("max_sequence_length", max(1, sequence.length // multiple), multiple, sequence)

    def search(searched: EstimateSettings) -> SequenceSearch:
        result = largest_batches(
            model, batch, searched, info, offload=offload, checkpoint=checkpoint, tile=tile,
            limit=limit // multiple, plan=plan, started=started, axis=axis, kind=SequenceSearch,
        )  # fmt: skip
        result.seq_dim, result.batch_size = sequence.dim, info.batch_size or 1
        return result

    result = search(settings)
    if result.stopped_by_logits and not settings.loss_as_chunked:  # the same search with the loss priced as chunked
        result.chunked_loss = search(settings.priced_as_chunked())
        result.seconds = time.perf_counter() - started
    return result


__all__ = ["DEFAULT_SEQUENCE_LIMIT", "SequenceSearch", "longest_sequences", "max_sequence_length"]
