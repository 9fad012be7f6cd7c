"""The loss's logits in a traced step: what they and their gradients take at the peak, the peak
that ``lightmem.linear_cross_entropy`` would leave, and the change in the user's code that gets it.

A language model's loss turns hidden states of shape (rows, in_features) into logits of shape
(rows, classes) with a weight of shape (classes, in_features), and the cross-entropy keeps a
float32 copy, its log-softmax and, in backward, gradients of the same size. With a large
vocabulary these can be the peak, and neither checkpointing nor offload reaches them.
``lightmem.linear_cross_entropy`` computes the loss and its gradients chunk by chunk, so none of
them exists whole; instead it keeps the input gradient (rows x in_features, in the products'
dtype) and the weight gradient (classes x in_features, float32) from the loss's forward to
backward, and holds one chunk of logits (and its float32 copy) at a time (``chunked_kept_bytes``).

What-if pricing: inside ``priced_as_chunked()``, every fake step is priced as if its loss were
chunked (the logits-sized storages left out, what the chunked loss keeps counted where it
holds it), so that ``plan`` and ``max_batch_size`` answer "with a chunked loss" for a loss written
without one: the batch it would reach and its step, before the user changes a line.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lightmem.estimate.call_site import CallSite
from lightmem.estimate.tracer import OTHER, PeakInfo, StorageTracer
from lightmem.loss import default_chunk_rows

LOGITS_MIN_SHARE = 0.25
"""The loss's logits must be at least this share of the peak to be worth a word (the advice, and
the message of a batch no plan fits)..."""
CHUNKED_LOSS = "lightmem.linear_cross_entropy"
HUGGING_FACE_OPT_IN = "LightMem(chunked_loss=True)"


@dataclass(frozen=True)
class LossLogits:
    """The largest log-softmax input of the forward (the cross-entropy's logits) and its cost."""

    rows: int
    classes: int
    in_features: int
    weight_name: str
    """The parameter of shape (classes, in_features) that makes the logits (``lm_head.weight``)."""
    bytes_at_peak: int
    """Storages of (about) logits size, last dimension ``classes``, alive at the peak: the logits,
    their float32 copies, the log-softmax and the gradients."""
    chunked_kept_bytes: int
    """What the chunked loss holds instead, at most (``chunked_kept_bytes``: kept and one chunk)."""
    peak_bytes_chunked: int
    """The step's predicted peak with the chunked loss: the peak without the logits-sized
    storages, with what the chunked loss holds counted where it holds it (``held``)."""
    change: str = ""
    """The change in the user's code that makes the loss chunked, in words (``loss_change``)."""
    records: frozenset[int] = frozenset()
    """The tracer's records of the logits-sized storages."""
    held: tuple[tuple[int, int, int], ...] = ()
    """What the chunked loss holds, as the tracer's ``held``: its kept gradients from the logits'
    first allocation (the loss's forward) to the loss's backward, and one chunk at that first
    allocation."""

    def dominates(self, peak_bytes: int) -> bool:
        """Whether the logits are a large enough share of ``peak_bytes`` to be worth a word."""
        return self.bytes_at_peak >= LOGITS_MIN_SHARE * peak_bytes


def chunked_kept_bytes(
    rows: int, classes: int, in_features: int, element_bytes: int, rounding: Callable[[int], int] | None = None
) -> tuple[int, int]:
    """What ``lightmem.linear_cross_entropy`` holds beside its inputs, at its default chunk: (kept,
    chunk), each allocation as ``rounding`` hands it out (the allocator's block size; None: as asked).
    Kept from its forward to its backward: the gradient of the hidden states (in the products'
    dtype, ``element_bytes`` each), the float32 gradient of the weight, and per row at most eight
    float32 figures (sums, picked logits, losses, weights and factors), a mask and (int64) the
    targets three times: the caller's flattened or shifted copy, made after the logits where the
    loss is not chunked, and the loss's own. Held while its forward runs: one chunk's logits, with
    (products in half precision) their float32 copy and the chunk's weight-gradient product, and
    the chunk's rows' figures (at most eight float32 each)."""
    chunk = default_chunk_rows(rows, in_features, classes)
    half = element_bytes != 4
    size = rounding or (lambda nbytes: nbytes)
    kept = [rows * in_features * element_bytes, classes * in_features * 4, *[rows * 4] * 8, rows, *[rows * 8] * 3]
    held = [chunk * classes * element_bytes, *[chunk * 4] * 8]
    if half:
        held += [chunk * classes * 4, classes * in_features * element_bytes]
    return sum(map(size, kept)), sum(map(size, held))


def loss_logits(
    tracer: StorageTracer,
    peak: PeakInfo,
    named: dict[str, torch.Tensor],
    repeated: set[str],
    *,
    product_dtype: torch.dtype | None = None,
    model: nn.Module | None = None,
) -> LossLogits | None:
    """The loss's logits of the traced step, or None when the forward has no log-softmax over the
    rows of a parameter (no cross-entropy over a linear layer's outputs).

    ``repeated`` names the repeated layers: the head and the loss run outside them, and storages
    made inside them are never the logits, whatever their size (an MLP as wide as the vocabulary).
    ``product_dtype``: the dtype the head's product runs in (autocast's; None: the weight's).
    ``model``: the traced model, whose local name in the user's code the change is written with.
    """
    if not tracer.log_softmax_inputs:
        return None
    index, (shape, dim) = max(enumerate(tracer.log_softmax_inputs), key=lambda item: math.prod(item[1][0]))
    if dim != len(shape) - 1:
        return None
    classes = shape[dim]
    rows = math.prod(shape) // max(classes, 1)
    weight = _classifier_weight(named, classes)
    if weight is None or rows == 0:
        return None
    weight_name, in_features, element_bytes = weight
    if product_dtype is not None:
        element_bytes = product_dtype.itemsize
    # Logits-sized: at least one byte per logit (a half-precision copy of the rows the loss
    # reads takes two), so the class-sized bias and its gradient never count.
    logits_sized = frozenset(
        rid
        for rid, record in enumerate(tracer.records)
        if record.last_dim == classes
        and record.role == OTHER
        and record.nbytes >= rows * classes
        and record.alloc_event >= tracer.window.start
        and tracer.block_at(record.alloc_event) not in repeated
    )
    alive = set(tracer.alive_at(peak.event))
    bytes_at_peak = sum(tracer.records[rid].nbytes for rid in logits_sized & alive)
    kept, chunk = chunked_kept_bytes(rows, classes, in_features, element_bytes, tracer.block_bytes)
    forward = min(tracer.records[rid].alloc_event for rid in logits_sized)
    backward = min(
        (tracer.records[rid].alloc_event for rid in logits_sized if tracer.records[rid].alloc_event >= tracer.window.forward_end),
        default=tracer.window.end,
    )
    held = ((forward, backward, kept), (forward, forward, chunk))
    chunked = tracer.peak_bytes_without(set(logits_sized), list(held))
    change = loss_change(tracer.log_softmax_sites[index], weight_name, model)  # appended with each input
    return LossLogits(rows, classes, in_features, weight_name, bytes_at_peak, kept + chunk, chunked, change, logits_sized, held)


def _classifier_weight(named: dict[str, torch.Tensor], classes: int) -> tuple[str, int, int] | None:
    """(name, in_features, element size) of the 2-D parameter with ``classes`` rows; the last name
    of a tied one (the output head comes after the embedding it shares a weight with). The hidden
    states that meet it have its dtype (float32 under mixed precision, bf16 under "bf16-true")."""
    found = None
    for name, tensor in named.items():
        if isinstance(tensor, torch.nn.Parameter) and tensor.dim() == 2 and tensor.shape[0] == classes:
            found = (name, tensor.shape[1], tensor.element_size())
    return found


def loss_change(site: CallSite | None, weight_name: str, model: nn.Module | None) -> str:
    """The change that makes the loss chunked, in the user's words: for a Hugging Face model that
    computes its own loss, the opt-in; otherwise the statement that calls the cross-entropy and
    what to write instead (its targets and options kept, ``weight=`` renamed ``class_weight=``),
    the head's weight named through a local name of the user's frame where one holds its owner."""
    if site is not None and site.library == "transformers":
        return (
            f"the model computes its own loss (labels=...): {HUGGING_FACE_OPT_IN} (in plain PyTorch "
            "lightmem.chunked_causal_lm_loss(model)) makes it chunked, with no change to the training step"
        )
    weight = _local_path(site, weight_name, model) if site is not None and model is not None else weight_name
    head = weight.rsplit(".", 1)[0] if "." in weight else weight
    arguments = "targets"
    if site is not None and site.call is not None:
        arguments = site.source(site.call.args[1])
        for keyword in site.call.keywords:
            if keyword.arg in ("ignore_index", "reduction", "label_smoothing", "weight"):
                name = "class_weight" if keyword.arg == "weight" else keyword.arg
                arguments += f", {name}={site.source(keyword.value)}"
    replacement = f"{CHUNKED_LOSS}(hidden, {weight}, {arguments})"
    where = f"in {site.where}, `{site.statement}`, " if site is not None else ""
    return (
        f"{where}compute the loss as `{replacement}`, where hidden is what {head} reads (have the model "
        f"return it in place of the logits)"
    )


def _local_path(site: CallSite, weight_name: str, model: nn.Module) -> str:
    """``weight_name`` (qualified in ``model``) through the local name of the user's frame that
    holds its closest owner: ``model.lm_head.weight`` in ``gpt_loss(model, tokens)``."""
    qualified = {id(module): name for name, module in model.named_modules()}
    best: tuple[int, str] | None = None
    for local, ident in site.modules:
        owner = qualified.get(ident)
        if owner is None or (owner and not weight_name.startswith(owner + ".")):
            continue
        rest = weight_name[len(owner) + 1 :] if owner else weight_name
        if best is None or len(owner) > best[0]:
            best = (len(owner), f"{local}.{rest}")
    return best[1] if best is not None else weight_name


# -- what-if pricing -------------------------------------------------------------------------------

_PRICED_AS_CHUNKED: contextvars.ContextVar[bool] = contextvars.ContextVar("lightmem_priced_as_chunked", default=False)


@contextlib.contextmanager
def priced_as_chunked() -> Iterator[None]:
    """Every fake step run inside is priced as if its loss were chunked (module docstring)."""
    token = _PRICED_AS_CHUNKED.set(True)
    try:
        yield
    finally:
        _PRICED_AS_CHUNKED.reset(token)


def pricing_chunked() -> bool:
    """Whether fake steps are priced as if their loss were chunked now."""
    return _PRICED_AS_CHUNKED.get()


def price_as_chunked(tracer: StorageTracer, logits: LossLogits) -> PeakInfo:
    """The step's peak with the loss chunked: the logits-sized storages left out and what the
    chunked loss holds counted where it holds it, for good (later questions to the tracer see the
    chunked step); the held bytes are temporaries."""
    tracer.excluded.update(logits.records)
    tracer.held.extend(logits.held)
    return tracer.peak()
