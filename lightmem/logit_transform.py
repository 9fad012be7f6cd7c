"""What a model does to its output head's logits before its loss reads them, and whether
``lightmem.linear_cross_entropy`` can do the same chunk by chunk.

The ops are read where they ran (the estimator's trace, or the first forward of a chunked causal
LM's loss), from the head's product to the loss's input, copies and views left out: none (the loss
reads the head's output), soft-capping (``tanh(logits / c) * c``, Gemma-2's
``final_logit_softcapping``: ``linear_cross_entropy(..., softcap=c)`` carries it), or anything else
(a logit scale, a mask, a slice that makes a copy), which a chunked loss from the hidden states
would leave out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten
COPIES = frozenset({aten._to_copy.default, aten.clone.default, aten.copy.default, aten.lift_fresh_copy.default})
"""Ops that copy values into a new storage (a dtype cast, a contiguous copy): no change of the
values a loss reads beyond a cast's rounding, which the chunked loss makes as the loss does."""
SOFTCAP_OPS = ("div", "tanh", "mul")


@dataclass(frozen=True)
class LogitTransform:
    """The ops between a head's product and its loss, as the chunked loss can take them."""

    softcap: float | None = None
    """``c`` of a soft-cap ``tanh(logits / c) * c`` (None: none)."""
    others: tuple[str, ...] = ()
    """The ops the chunked loss cannot carry, by their ``aten`` names (empty: it carries them all)."""

    @property
    def carried(self) -> bool:
        return not self.others


def read_transform(steps: Sequence[tuple[str, Sequence[Any]]]) -> LogitTransform:
    """The transform of ``steps``: each op's ``aten`` name (in place or not) and its plain number
    arguments, in the order they ran."""
    names = tuple(name.rstrip("_") for name, _ in steps)
    if not names:
        return LogitTransform()
    if names == SOFTCAP_OPS:
        divisor, multiplier = steps[0][1], steps[2][1]
        if len(divisor) == 1 and tuple(multiplier) == tuple(divisor) and not steps[1][1] and divisor[0] > 0:
            return LogitTransform(softcap=float(divisor[0]))
    return LogitTransform(others=names)


def is_view(func: Any) -> bool:
    """Whether an ``aten`` op returns a view of an input (no new values: ``view``, ``detach``, a slice)."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
