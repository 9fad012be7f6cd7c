"""Is a module position-wise? Read from its behaviour on a few positions of its real input.

Tiling runs each shard of the sequence without the others, so it is exact only for a module whose
output at a position depends on its input at that position alone (an MLP). Attention, a convolution
along the sequence, a normalisation over positions and routing with capacity limits mix positions;
so does a module that adds positional information by index. Names do not say which is which; this
check asks the module itself, once, on the first call with at least two positions:

1. its output must depend on nothing that requires grad but its input and its own parameters (a
   tiled backward computes gradients for those two only);
2. its output on ``PROBE_POSITIONS`` positions must be the output of each position run alone;
3. changing one position of the input must change no other position's output, nor any buffer the
   forward writes (a buffer written from the input's values would be written from one shard).

It runs on a slice of the real input (the first ``PROBE_POSITIONS`` positions of each sequence of
the batch): ``PROBE_POSITIONS + 2`` forwards of a few positions, with the RNG forked and
restored, dropout off, the buffers on scratch copies, and saved tensors kept out of any hook (offload,
an enclosing checkpoint), so the training step is the same with or without it.

What it can miss: mixing that needs more than ``PROBE_POSITIONS`` positions to show (a dilated
convolution, a window wider than the probe), routing with capacity limits whose probed tokens never
compete for a slot, and behaviour that changes after the first call (only the first is checked).
A module drawing random numbers other than through dropout may be refused wrongly (each position
run alone draws other numbers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightmem.checkpoint import BufferSnapshots
from lightmem.tiling.function import rng_state, set_rng_state

PROBE_POSITIONS = 4
"""Positions of the input the check runs on."""
CHANGED_POSITION = 1
"""The position the check changes: it has neighbours on both sides, so mixing either way shows."""

_DROPOUTS = frozenset({
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
})  # fmt: skip


class _NoDropout(TorchFunctionMode):
    """Dropout returns its input: a position run alone draws another mask than within the probe."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        return func(*args, **kwargs)


def _tolerance(dtype: torch.dtype) -> float:
    """Differences up to this share of the largest output are rounding (a matrix product of one row
    and of four rounds differently), not mixing."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


@contextlib.contextmanager
def _quiet(x: torch.Tensor) -> Iterator[None]:
    """The RNG forked and restored, dropout off, saved tensors kept out of any enclosing hooks."""
    devices = [x.get_device()] if x.device.type not in ("cpu", "meta") else []
    with (
        torch.random.fork_rng(devices=devices, device_type=x.device.type),
        _NoDropout(),
        torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor),
    ):  # fmt: skip
        yield


def _probe(x: torch.Tensor) -> torch.Tensor:
    """The first ``PROBE_POSITIONS`` positions of every sequence of the batch (the module's other
    arguments may have the batch's leading dimensions)."""
    return x.detach().narrow(-2, 0, min(PROBE_POSITIONS, x.shape[-2])).clone()


def _foreign_inputs(output: torch.Tensor, allowed: set[int]) -> list[torch.Tensor]:
    """Leaves that require grad which ``output`` depends on, other than those in ``allowed`` (ids)."""
    found: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            if id(variable) not in allowed:
                found.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _largest_difference(a: torch.Tensor, b: torch.Tensor, positions: list[int]) -> tuple[float, int]:
    """The largest difference of ``a`` and ``b`` over ``positions`` and the position where it is."""
    worst, where = 0.0, -1
    for position in positions:
        difference = (a.narrow(-2, position, 1).float() - b.narrow(-2, position, 1).float()).abs().max().item()
        if difference > worst:
            worst, where = difference, position
    return worst, where


def check_position_wise(
    module: nn.Module, function: Callable[[torch.Tensor], Any], x: torch.Tensor, buffers: BufferSnapshots,
    describe: str,
) -> bool:  # fmt: skip
    """Raise ``ValueError`` when ``function`` (``module``'s forward with the call's other arguments)
    is not position-wise on ``x``; ``describe`` opens the message (the flag and the module). False
    when nothing could be seen: ``x`` has fewer than two positions, or inference mode forbids the
    graph the first question needs (Lightning's validation sanity check); a later call asks again."""
    if x.shape[-2] < 2 or torch.is_inference_mode_enabled():
        return False
    probe = _probe(x)
    positions = list(range(probe.shape[-2]))
    refused = (
        f"{describe} cannot be tiled: a tiled forward runs each shard of the sequence without the others, "
        "which is exact only for a module whose output at a position depends on its input at that position "
        "alone (an MLP), not attention, a convolution along the sequence, a normalisation over positions or "
        "routing with capacity limits. Seen on "
        f"{len(positions)} positions of its first input: "
    )
    with _quiet(x):
        state = rng_state(x)
        leaf = probe.clone().requires_grad_(True)
        with torch.enable_grad(), buffers.scratch() as written:
            whole = function(leaf)
        if not isinstance(whole, torch.Tensor) or whole.dim() < 2 or whole.shape[-2] != len(positions):
            return True  # the tiled forward says what is wrong with the output, with the real shapes
        if whole.requires_grad:
            allowed = {id(leaf)} | {id(param) for param in module.parameters()}
            foreign = _foreign_inputs(whole, allowed)
            if foreign:
                shapes = ", ".join(f"{list(t.shape)} ({str(t.dtype).removeprefix('torch.')})" for t in foreign[:3])
                raise ValueError(
                    f"{describe} cannot be tiled: its output depends on {len(foreign)} tensor(s) that require grad "
                    f"besides its input and its own parameters ({shapes}); a tiled backward computes the gradients "
                    "of those two only, so theirs would be lost. Make such a tensor a parameter of the module, or "
                    "tile a module that owns it."
                )
        whole = whole.detach()
        scale = max(whole.float().abs().max().item(), 1e-30)
        tolerance = _tolerance(whole.dtype) * scale
        with torch.no_grad():
            alone = []
            for position in positions:
                set_rng_state(state, x.device.type)
                try:
                    with buffers.scratch():
                        alone.append(function(probe.narrow(-2, position, 1)))
                except Exception as error:  # e.g. BatchNorm: one value per channel is not a batch
                    raise ValueError(
                        f"{refused}run one position at a time, it raised {type(error).__name__}: {error}"
                    ) from error
            difference, where = _largest_difference(whole, torch.cat(alone, dim=-2), positions)
            if difference > tolerance:
                raise ValueError(
                    f"{refused}run one position at a time, its output at position {where} differs by "
                    f"{difference:.3g} from its output with the {len(positions)} positions together (outputs up "
                    f"to {scale:.3g})."
                )
            changed = probe.clone()
            slot = changed.narrow(-2, CHANGED_POSITION, 1)
            # Every entry moves, its sign flips (a router choosing by sign chooses otherwise), zeros too.
            slot.mul_(-4).add_(probe.float().abs().mean().item() + 1.0)
            set_rng_state(state, x.device.type)
            with buffers.scratch() as written_changed:
                other = function(changed)
            others = [position for position in positions if position != CHANGED_POSITION]
            difference, where = _largest_difference(whole, other, others)
            if difference > tolerance:
                raise ValueError(
                    f"{refused}changing position {CHANGED_POSITION} of its input changed its output at position "
                    f"{where} by {difference:.3g} (outputs up to {scale:.3g})."
                )
            for name, value in written.items():
                if not torch.equal(value, written_changed[name]):
                    raise ValueError(
                        f"{describe} cannot be tiled: its forward writes buffer {name!r} from its input's values "
                        f"(changing position {CHANGED_POSITION} of {len(positions)} changed what it wrote); a tiled "
                        "forward would write it from the first shard alone."
                    )
    return True
