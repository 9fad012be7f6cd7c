"""The loss's logits in a traced step: what they and their gradients take at the peak, and the
peak that ``torch.nn.functional.linear_cross_entropy`` would leave.

A language model's loss turns hidden states of shape (rows, in_features) into logits of shape
(rows, classes) with a weight of shape (classes, in_features), and the cross-entropy keeps a
float32 copy, its log-softmax and, in backward, gradients of the same size. With a large
vocabulary these can be the peak, and neither checkpointing nor offload reaches them.
``linear_cross_entropy`` with ``LinearCrossEntropyOptions`` computes the loss and both input
gradients chunk by chunk, so none of them exists whole; instead it keeps the input gradient
(rows x in_features) and the weight gradient (classes x in_features) from the loss's forward to
backward, plus one chunk of float32 logits sized like the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightmem.estimate.tracer import OTHER, PeakInfo, StorageTracer

LOGITS_MIN_SHARE = 0.25
"""The loss's logits must be at least this share of the peak to be worth a word (the advice, and
the message of a batch no plan fits)..."""


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
    """What the chunked op holds instead: input and weight gradients, one float32 chunk."""
    peak_bytes_chunked: int
    """The step's predicted peak with the chunked loss: the peak without the logits-sized
    storages, plus ``chunked_kept_bytes`` throughout."""


def loss_logits(
    tracer: StorageTracer, peak: PeakInfo, named: dict[str, torch.Tensor], repeated: set[str]
) -> LossLogits | None:
    """The loss's logits of the traced step, or None when the forward has no log-softmax over the
    rows of a parameter (no cross-entropy over a linear layer's outputs).

    ``repeated`` names the repeated layers: the head and the loss run outside them, and storages
    made inside them are never the logits, whatever their size (an MLP as wide as the vocabulary).
    """
    if not tracer.log_softmax_inputs:
        return None
    shape, dim = max(tracer.log_softmax_inputs, key=lambda item: math.prod(item[0]))
    if dim != len(shape) - 1:
        return None
    classes = shape[dim]
    rows = math.prod(shape) // max(classes, 1)
    weight = _classifier_weight(named, classes)
    if weight is None or rows == 0:
        return None
    weight_name, in_features, element_bytes = weight
    # Logits-sized: at least one byte per logit (a half-precision copy of the rows the loss
    # reads takes two), so the class-sized bias and its gradient never count.
    logits_sized = {
        rid
        for rid, record in enumerate(tracer.records)
        if record.last_dim == classes
        and record.role == OTHER
        and record.nbytes >= rows * classes
        and record.alloc_event >= tracer.window.start
        and tracer.block_at(record.alloc_event) not in repeated
    }
    alive = set(tracer.alive_at(peak.event))
    bytes_at_peak = sum(tracer.records[rid].nbytes for rid in logits_sized & alive)
    kept = (
        rows * in_features * element_bytes  # input gradient, in the hidden states' dtype
        + classes * in_features * element_bytes  # weight gradient, likewise
        + rows * in_features * 4  # one float32 chunk of logits, sized like the input
    )
    chunked = tracer.peak_bytes_without(logits_sized) + kept
    return LossLogits(rows, classes, in_features, weight_name, bytes_at_peak, kept, chunked)


def _classifier_weight(named: dict[str, torch.Tensor], classes: int) -> tuple[str, int, int] | None:
    """(name, in_features, element size) of the 2-D parameter with ``classes`` rows; the last name
    of a tied one (the output head comes after the embedding it shares a weight with). The hidden
    states that meet it have its dtype (float32 under mixed precision, bf16 under "bf16-true")."""
    found = None
    for name, tensor in named.items():
        if isinstance(tensor, torch.nn.Parameter) and tensor.dim() == 2 and tensor.shape[0] == classes:
            found = (name, tensor.shape[1], tensor.element_size())
    return found
