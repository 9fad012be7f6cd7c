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

What-if pricing: a step asked with ``StepRequest.loss_as_chunked`` (``EstimateSettings.loss_as_chunked``)
is priced as if its loss were chunked (``price_as_chunked``: the logits-sized storages left out,
what the chunked loss keeps counted where it holds it), so that ``plan`` and ``max_batch_size``
answer "with a chunked loss" for a loss written without one: the batch it would reach and its
step, before the user changes a line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from lightmem.estimate.trace.call_site import CallSite
from lightmem.estimate.trace.op_chain import Product, is_parameter, product_before, through_copies
from lightmem.estimate.trace.records import INPUT, OTHER, PeakInfo
from lightmem.estimate.trace.tracer import StorageTracer
from lightmem.logit_transform import LogitTransform, aten, read_transform
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
    """The parameter the logits' product read (``lm_head.weight``), tied or not; written ``.t()``
    where it is stored (in_features, classes)."""
    bytes_at_peak: int
    """Storages of (about) logits size, last dimension ``classes``, alive at the peak: the logits,
    their float32 copies, the log-softmax and the gradients."""
    chunked_kept_bytes: int
    """What the chunked loss holds instead, at most (``chunked_kept_bytes``: kept and one chunk)."""
    peak_bytes_chunked: int
    """The step's predicted peak with the chunked loss: the peak without the logits-sized
    storages, with what the chunked loss holds counted where it holds it (``held``)."""
    change: str = ""
    """The change in the user's code that makes the loss chunked, in words (``loss_change``); why
    none is proposed where the chunked loss cannot take the loss's place (``replaceable``)."""
    records: frozenset[int] = frozenset()
    """The tracer's records of the logits-sized storages."""
    held: tuple[tuple[int, int, int], ...] = ()
    """What the chunked loss holds, as the tracer's ``held``: its kept gradients from the logits'
    first allocation (the loss's forward) to the loss's backward, and one chunk at that first
    allocation."""
    bias_name: str | None = None
    """The parameter the logits' product added (``addmm``'s, or added to its output), if any."""
    hidden_module: str | None = None
    """The block that made the hidden states the product read (``transformer.ln_f``); None: made
    outside every block, or the batch's own tensor (``hidden_from_batch``)."""
    hidden_from_batch: bool = False
    head_module: str | None = None
    """The block whose forward ran the product, where it owns the weight (``lm_head``); None: the
    product ran elsewhere (a weight read by the model's own code, ``x @ self.wte.weight.t()``)."""
    transform: LogitTransform = field(default_factory=LogitTransform)
    """What the model does to the product's output before the loss reads it."""
    chunks: int = 1
    """Products of the weight whose outputs the loss reads, one log-softmax each: more than one where
    the model chunks its own head and loss (LitGPT's ``lm_head_chunk_size`` with ``chunked_cross_entropy``)."""

    def dominates(self, peak_bytes: int) -> bool:
        """Whether the logits are a large enough share of ``peak_bytes`` to be worth a word."""
        return self.bytes_at_peak >= LOGITS_MIN_SHARE * peak_bytes

    @property
    def replaceable(self) -> bool:
        """Whether ``lightmem.linear_cross_entropy`` computes the loss the model computes: one product
        of the weight, and nothing between it and the loss that the chunked loss leaves out."""
        return self.transform.carried and self.chunks == 1


def chunked_kept_bytes(
    rows: int, classes: int, in_features: int, element_bytes: int, rounding: Callable[[int], int] | None = None,
    *, softcap: bool = False,
) -> tuple[int, int]:
    """What ``lightmem.linear_cross_entropy`` holds beside its inputs, at its default chunk: (kept,
    chunk), each allocation as ``rounding`` hands it out (the allocator's block size; None: as asked).
    Kept from its forward to its backward: the gradient of the hidden states (in the products'
    dtype, ``element_bytes`` each), the float32 gradient of the weight, and per row at most eight
    float32 figures (sums, picked logits, losses, weights and factors), a mask and (int64) the
    targets three times: the caller's flattened or shifted copy, made after the logits where the
    loss is not chunked, and the loss's own. Held while its forward runs: one chunk's logits, with
    (products in half precision) their float32 copy and the chunk's weight-gradient product, and
    the chunk's rows' figures (at most eight float32 each); with ``softcap``, the chunk's capped
    logits beside them."""
    chunk = default_chunk_rows(rows, in_features, classes)
    half = element_bytes != 4
    size = rounding or (lambda nbytes: nbytes)
    kept = [rows * in_features * element_bytes, classes * in_features * 4, *[rows * 4] * 8, rows, *[rows * 8] * 3]
    held = [chunk * classes * element_bytes, *[chunk * 4] * 8]
    if half:
        held += [chunk * classes * 4, classes * in_features * element_bytes]
    if softcap:
        held.append(chunk * classes * element_bytes)
    return sum(map(size, kept)), sum(map(size, held))


_ADDS = frozenset({aten.add.Tensor, aten.add_.Tensor})


@dataclass(frozen=True)
class _Head:
    """A log-softmax input of the forward and the product it was made from, as the trace shows them."""

    index: int
    """Its place among the tracer's ``log_softmax_inputs``."""
    rows: int
    classes: int
    weight: int
    """Record id of the parameter the product read."""
    bias: int
    """Record id of the parameter it added (-1: none)."""
    hidden: int
    """Record id of the other matrix it read: the hidden states."""
    product: Product
    transform: LogitTransform


def _heads(tracer: StorageTracer) -> list[_Head]:
    """Every log-softmax input over its last dimension that a product of a parameter made."""
    found = []
    for index, (shape, dim, made) in enumerate(tracer.log_softmax_inputs):
        if dim != len(shape) - 1 or made < 0:
            continue
        product = product_before(tracer, made)
        pair = None if product is None else product.parameter(tracer)
        if product is None or pair is None:
            continue
        weight, hidden = pair
        bias, between = product.bias, list(product.between)
        if bias < 0 and between and between[0][0] in _ADDS and len(between[0][1]) == 2:
            first, second = between[0][1]
            added = second if first in product.records else first
            if is_parameter(tracer, through_copies(tracer, added)):  # F.linear's bias, added after a 3-D product
                bias, between = added, between[1:]
        if bias >= 0:
            bias = through_copies(tracer, bias)
            if not is_parameter(tracer, bias):  # addmm added something else: a change of the logits
                between.insert(0, (aten.add.Tensor, (), ()))
                bias = -1
        transform = read_transform([(step[0]._overloadpacket.__name__, step[2]) for step in between])
        classes = shape[dim]
        found.append(_Head(index, math.prod(shape) // max(classes, 1), classes, weight, bias, hidden, product, transform))
    return found



def loss_logits(
    tracer: StorageTracer,
    peak: PeakInfo,
    named: dict[str, torch.Tensor],
    repeated: set[str],
    *,
    product_dtype: torch.dtype | None = None,
    model: nn.Module | None = None,
) -> LossLogits | None:
    """The loss's logits of the traced step, or None when no log-softmax of the forward reads the
    output of a product with a parameter (no cross-entropy over a linear layer's outputs).

    The logits are the largest such input; their weight, bias and hidden states are what that
    product read, and what lies between it and the log-softmax is read from the trace
    (``lightmem.estimate.trace.op_chain``). ``repeated`` names the repeated layers: the head and the loss
    run outside them, and storages made inside them are never the logits, whatever their size (an
    MLP as wide as the vocabulary). ``product_dtype``: the dtype the head's product runs in
    (autocast's; None: the weight's). ``model``: the traced model, whose local name in the user's
    code the change is written with.
    """
    heads = _heads(tracer) if tracer.log_softmax_inputs else []
    if not heads:
        return None
    head = max(heads, key=lambda item: item.rows * item.classes)
    # Several log-softmaxes over one weight's products: one product's logits split into row chunks
    # (LitGPT's chunked_cross_entropy), or the model's own chunked head (several products).
    siblings = [item for item in heads if item.weight == head.weight and item.classes == head.classes]
    rows, classes = sum(item.rows for item in siblings), head.classes
    products = len({item.product.output for item in siblings})
    names = _parameter_names(tracer, named)
    weight_block = tracer.block_at(tracer.records[head.product.output].alloc_event)
    weight_name, weight_tensor = _name(names.get(head.weight, []), weight_block)
    if weight_tensor is None or rows == 0:
        return None
    if weight_tensor.dim() != 2 or classes not in weight_tensor.shape:
        return None
    transposed = weight_tensor.shape[0] != classes
    in_features = weight_tensor.shape[1 - int(transposed)]
    element_bytes = product_dtype.itemsize if product_dtype is not None else weight_tensor.element_size()
    bias_name = _name(names.get(head.bias, []), weight_block)[0] if head.bias >= 0 else None
    hidden = tracer.records[head.hidden]
    hidden_module = tracer.block_at(hidden.alloc_event) if hidden.role == OTHER else None
    # Logits-sized: at least one byte per logit of the largest log-softmax input (a half-precision copy
    # of the rows the loss reads takes two), so the class-sized bias and its gradient never count.
    logits_sized = frozenset(
        rid
        for rid, record in enumerate(tracer.records)
        if record.last_dim == classes
        and record.role == OTHER
        and record.nbytes >= head.rows * classes
        and record.alloc_event >= tracer.window.start
        and tracer.block_at(record.alloc_event) not in repeated
    )
    alive = set(tracer.alive_at(peak.event))
    bytes_at_peak = sum(tracer.records[rid].nbytes for rid in logits_sized & alive)
    kept, chunk = chunked_kept_bytes(
        rows, classes, in_features, element_bytes, tracer.block_bytes, softcap=head.transform.softcap is not None
    )
    forward = min(tracer.records[rid].alloc_event for rid in logits_sized)
    backward = min(
        (tracer.records[rid].alloc_event for rid in logits_sized if tracer.records[rid].alloc_event >= tracer.window.forward_end),
        default=tracer.window.end,
    )
    held = ((forward, backward, kept), (forward, forward, chunk))
    chunked = tracer.peak_bytes_without(set(logits_sized), list(held))
    found = LossLogits(
        rows, classes, in_features, weight_name + (".t()" if transposed else ""), bytes_at_peak, kept + chunk, chunked,
        "", logits_sized, held, bias_name, hidden_module, hidden.role == INPUT,
        weight_block if weight_block is not None and weight_name.startswith(weight_block + ".") else None,
        head.transform, products,
    )  # fmt: skip
    return replace(found, change=loss_change(tracer.log_softmax_sites[head.index], found, model))


def _parameter_names(tracer: StorageTracer, named: dict[str, torch.Tensor]) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """Every name of each parameter and buffer, by its record id (tied weights: several names)."""
    names: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named.items():
        names.setdefault(tracer.track(tensor), []).append((name, tensor))
    return names


def _name(names: list[tuple[str, torch.Tensor]], block: str | None) -> tuple[str, torch.Tensor | None]:
    """The name of a parameter that several may share (tied weights): the one under the block
    whose forward read it (``lm_head.weight``, not ``transformer.wte.weight``), else the first."""
    if not names:
        return "", None
    for name, tensor in names:
        if block is not None and name.startswith(block + "."):
            return name, tensor
    return names[0]


def loss_change(site: CallSite | None, logits: LossLogits, model: nn.Module | None) -> str:
    """The change that makes the loss chunked, in the user's words: for a Hugging Face model that
    computes its own loss, the opt-in; otherwise the statement that calls the cross-entropy and
    what to write instead (its targets and options kept, ``weight=`` renamed ``class_weight=``,
    the model's soft-cap as ``softcap=``), the head's weight, bias and input named through a local
    name of the user's frame where one holds their owner. Where the chunked loss cannot take the
    loss's place (``LossLogits.replaceable``), why, and no change."""
    if logits.chunks > 1:
        return (
            f"the model makes its logits in {logits.chunks} products of {logits.weight_name}, each with its own loss "
            "(a chunked head: LitGPT's lm_head_chunk_size with chunked_cross_entropy): the loss is chunked already, "
            "so no change is proposed"
        )
    transform = logits.transform
    if not transform.carried:
        return (
            f"the model changes the logits of {logits.weight_name} before its loss reads them "
            f"({', '.join(transform.others)}), which {CHUNKED_LOSS} would leave out: no change is proposed"
        )
    if site is not None and site.library == "transformers":
        return (
            f"the model computes its own loss (labels=...): {HUGGING_FACE_OPT_IN} (in plain PyTorch "
            "lightmem.chunked_causal_lm_loss(model)) makes it chunked, with no change to the training step"
        )
    local = (lambda name: _local_path(site, name, model)) if site is not None and model is not None else (lambda name: name)
    weight = local(logits.weight_name.removesuffix(".t()")) + (".t()" if logits.weight_name.endswith(".t()") else "")
    arguments = "targets"
    if site is not None and site.call is not None:
        arguments = site.source(site.call.args[1])
        for keyword in site.call.keywords:
            if keyword.arg in ("ignore_index", "reduction", "label_smoothing", "weight"):
                name = "class_weight" if keyword.arg == "weight" else keyword.arg
                arguments += f", {name}={site.source(keyword.value)}"
    if logits.bias_name is not None:
        arguments += f", bias={local(logits.bias_name)}"
    if transform.softcap is not None:
        arguments += f", softcap={transform.softcap!r}"
    replacement = f"{CHUNKED_LOSS}(hidden, {weight}, {arguments})"
    where = f"in {site.where}, `{site.statement}`, " if site is not None else ""
    reads = f"{local(logits.head_module)} reads" if logits.head_module is not None else "the head's product reads"
    if logits.hidden_from_batch:
        hidden = f"the batch's tensor {reads}"
    elif logits.hidden_module is not None:
        hidden = f"the output of {local(logits.hidden_module)}, which {reads}"
    else:
        hidden = f"what {reads}"
    return (
        f"{where}compute the loss as `{replacement}`, where hidden is {hidden} (have the model return it in place "
        "of the logits)"
    )


def _local_path(site: CallSite, qualified: str, model: nn.Module) -> str:
    """``qualified`` (a parameter's or a module's name in ``model``) through the local name of the
    user's frame that holds its closest owner: ``model.lm_head.weight`` in ``gpt_loss(model, tokens)``."""
    owners = {id(module): name for name, module in model.named_modules()}
    best: tuple[int, str] | None = None
    for local, ident in site.modules:
        owner = owners.get(ident)
        if owner is None or (owner and qualified != owner and not qualified.startswith(owner + ".")):
            continue
        rest = qualified[len(owner) + 1 :] if owner else qualified
        path = f"{local}.{rest}" if rest else local
        if best is None or len(owner) > best[0]:
            best = (len(owner), path)
    return best[1] if best is not None else qualified


# -- what-if pricing -------------------------------------------------------------------------------

def price_as_chunked(tracer: StorageTracer, logits: LossLogits) -> PeakInfo:
    """The step's peak with the loss chunked: the logits-sized storages left out and what the
    chunked loss holds counted where it holds it, for good (later questions to the tracer see the
    chunked step); the held bytes are temporaries."""
    tracer.excluded.update(logits.records)
    tracer.held.extend(logits.held)
    return tracer.peak()
