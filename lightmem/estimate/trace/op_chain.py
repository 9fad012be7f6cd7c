"""What made a tensor of a traced forward, read back from the trace: the ops between two storages,
the parameter a matrix product read and the storage it multiplied it with.

The tracer keeps, for each storage a forward op makes, that op, the records of the tensors it read
and its plain number arguments (``StorageRecord.made_by``), and the in-place ops that wrote it later
(``changed_by``). Advice reads these chains (the loss's logits and what lies between them and the
log-softmax, attention scores) and never guesses from names, registration order or shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightmem.estimate.trace.records import BUFFER, PARAMETER, OpStep
from lightmem.estimate.trace.tracer import StorageTracer
from lightmem.logit_transform import COPIES, aten

PRODUCTS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
"""Matrix products as a traced forward runs them (``F.linear`` and ``@`` come apart into these)."""
WALK_LIMIT = 32
"""The most ops a walk follows back from a storage to a product."""


@dataclass(frozen=True)
class Product:
    """A matrix product of the forward and the ops that lie between it and a later storage."""

    output: int
    """Record id of the product's output."""
    operands: tuple[int, int]
    """Record ids of the two matrices it multiplied, each followed back through copies (the
    parameter behind an autocast copy of a weight, the hidden states behind a contiguous copy)."""
    bias: int
    """Record id of what ``addmm`` added (-1: none)."""
    between: tuple[OpStep, ...]
    """The ops from the product to the storage the walk started at, in the order they ran; copies
    left out."""
    records: tuple[int, ...]
    """Record ids the walk passed through, the product's output included."""

    def parameter(self, tracer: StorageTracer) -> tuple[int, int] | None:
        """(parameter, other operand) when exactly one operand is a parameter, else None."""
        first, second = (is_parameter(tracer, rid) for rid in self.operands)
        if first == second:
            return None
        return self.operands if first else (self.operands[1], self.operands[0])


def is_parameter(tracer: StorageTracer, rid: int) -> bool:
    return rid >= 0 and tracer.records[rid].role in (PARAMETER, BUFFER)


def through_copies(tracer: StorageTracer, rid: int) -> int:
    """The storage ``rid`` was copied from, copy after copy (itself when it is no copy)."""
    records = tracer.records
    for _ in range(WALK_LIMIT):
        if rid < 0:
            return rid
        record = records[rid]
        step = record.made_by
        if step is None or step[0] not in COPIES or record.changed_by or not step[1]:
            return rid
        rid = step[1][0]
    return rid


def product_before(tracer: StorageTracer, rid: int) -> Product | None:
    """The matrix product ``rid`` was made from in the forward, following each op's largest tensor
    input back (a mask or a bias added is the smaller), with the ops met on the way; None when the
    walk meets a storage no op of the forward made (the batch, a parameter) first."""
    records = tracer.records
    between: list[OpStep] = []
    passed: list[int] = []
    for _ in range(WALK_LIMIT):
        if rid < 0:
            return None
        record = records[rid]
        passed.append(rid)
        if record.changed_by:
            between.extend(reversed(record.changed_by))
        step = record.made_by
        if step is None:
            return None
        func, inputs, _ = step
        if func in PRODUCTS:
            bias = -1
            if func is aten.addmm.default or func is aten.baddbmm.default:
                bias, inputs = inputs[0], inputs[1:]
            if len(inputs) != 2:
                return None
            operands = (through_copies(tracer, inputs[0]), through_copies(tracer, inputs[1]))
            return Product(rid, operands, bias, tuple(reversed(between)), tuple(reversed(passed)))
        if func not in COPIES:
            between.append(step)
        tensors = [index for index in inputs if index >= 0]
        if not tensors:
            return None
        rid = max(tensors, key=lambda index: records[index].requested)
    return None


def attention_scores(tracer: StorageTracer) -> set[int]:
    """Record ids of attention scores: every storage from a product of two activations (query and
    key, neither a parameter) to the softmax it feeds, the softmax's output, and what the forward
    makes from that output before its next product (dropout and its mask, a cast)."""
    records = tracer.records
    scores: set[int] = set()
    for softmax_input, softmax_output in tracer.softmaxes:
        product = product_before(tracer, softmax_input)
        if product is None or any(is_parameter(tracer, rid) for rid in product.operands):
            continue
        found = {*product.records, softmax_output}
        for rid in range(softmax_output + 1, min(softmax_output + WALK_LIMIT, len(records))):
            step = records[rid].made_by
            if step is None or not any(index in found for index in step[1]):
                continue
            if step[0] in PRODUCTS:  # the scores times the values: past the scores
                break
            found.add(rid)
        scores |= found
    return scores
