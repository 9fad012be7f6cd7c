"""Which modules the planner may tile, read from the trace: the position-wise ones.

Tiling (``lightmem.tiling``) runs a module on shards of the sequence, each without the others, so
it is exact only for a module whose output at a position depends on its input at that position
alone. Names and shapes do not say which modules are; the ops of their forward do, and the fake
step sees every one of them. During the baseline's forward, every module called with one tensor
(its first positional argument, floating point, ``[..., T, d]``) is watched (``PositionWatch``):
its input's *rows* (every dimension but the last: the batch and the positions, ``N`` of them) are
followed through its ops, and each op that reads a tensor made from the input is held to one rule,
"nothing crosses rows":

- a view or copy that keeps the elements in order (``view``, ``reshape``, ``unsqueeze``, a dtype
  cast, ``clone``) keeps rows when some leading dimensions of its output multiply to ``N``;
  one that reorders dimensions (``transpose``, ``permute``, ``expand``) only among the others;
  one that takes part of a dimension (``slice``, ``split``, ``select``) only along the others;
- an elementwise op keeps rows when every tensor it reads is made from the input with the same
  rows or varies along none of them (a parameter, a scalar: ``x * weight``, not ``x + table[:T]``);
- a product keeps rows when the input's rows meet a tensor not made from the input and the sum
  runs along the features (``x @ W.t()``); a product of two tensors made from the input
  (attention's ``q @ k.t()``) mixes positions;
- a reduction, softmax, scan, sort or normalisation keeps rows along the features only (an
  RMSNorm's ``mean(-1)``, not a batch norm's statistics or attention's softmax over keys);
- anything else that reads the input (a convolution, an index, a gather, routing) does not keep
  rows, and neither does writing the input's values into a tensor made elsewhere (a buffer);
- a random draw not made per position (dropout's mask is: a draw on a tensor of the input's rows)
  is refused wherever it is made: each shard would draw its own number.

A module is position-wise when every op keeps rows, it reads nothing requiring grad but its input
and its own parameters (a tiled backward computes gradients for those two only), and it returns
one tensor with the input's rows in place (``[..., T, d_out]``). The rule reads only what the ops
do; where it does not know an op it refuses, so a module it takes is position-wise, and a module
it refuses may still be one (``LightMem(tile=[...])`` names it by hand, and the runtime check of
``lightmem.tiling.position_wise`` guards the real step either way).

Each watched module's forward seconds and priced ops are summed (what a tiled backward runs
again), and the storages it saved for backward (all but its input: what tiling no longer keeps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

FIXED = 0
"""A tensor not made from the watched input that the module may read while requiring grad: one of
its own parameters, or a tensor made from them (an autocast copy of a weight)."""

_IN_ORDER = {
    aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.unsqueeze, aten.squeeze,
    aten.flatten, aten.unflatten, aten.alias, aten.detach, aten.clone, aten._to_copy, aten.contiguous,
    aten.lift_fresh, aten.view_as, aten.reshape_as, aten.to, aten.type_as,
}  # fmt: skip
"""Views and copies that keep the elements in order (row-major): rows survive where leading
dimensions of the output multiply to the input's rows."""
_REORDER = {aten.permute, aten.transpose, aten.t, aten.expand, aten.movedim, aten.swapaxes, aten.swapdims}
_PART = {
    aten.select, aten.slice, aten.narrow, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
    aten.unsafe_split, aten.unsafe_split_with_sizes, aten.tensor_split,
}  # fmt: skip
_ALONG_DIM = {
    aten._softmax, aten._log_softmax, aten.softmax, aten.log_softmax, aten.cumsum, aten.cumprod,
    aten.logcumsumexp, aten.cummax, aten.cummin, aten.sort, aten.topk, aten.argsort, aten.kthvalue,
}  # fmt: skip
"""Ops that read along one dimension (``dim``): they keep rows when it is a feature dimension."""
_NORMS = {aten.native_layer_norm, aten.layer_norm, aten.rms_norm, aten._fused_rms_norm}
_LIKE = {
    aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.native_dropout, aten.fill, aten.fill_,
    aten.zero_, aten.copy_, aten.copy, aten.masked_fill, aten.masked_fill_, aten.where, aten.clamp, aten.clamp_,
}  # fmt: skip
"""Elementwise in effect though not tagged so (dropout, fills, copies)."""
_DRAWS = {aten.native_dropout, aten.bernoulli, aten.bernoulli_, aten.rand_like, aten.randn_like, aten.uniform_, aten.normal_}
"""Random draws a tiled module may make, on a tensor of its input's rows (dropout's mask): each shard
draws its own, as the untiled module's positions do (``lightmem.tiling``). A draw not made per row
(one scale per call) is refused: each shard would draw its own number."""
_PRODUCTS = {aten.mm, aten.addmm, aten.bmm, aten.matmul, aten.linear}
_CAT = {aten.cat}


@dataclass
class ModuleForward:
    """One watched module's forward in the baseline step (every call summed)."""

    name: str
    kind: str
    """Its class name."""
    block: str | None
    """The top-level block its forward ran in (None: outside every block)."""
    input_shape: tuple[int, ...]
    """Its input's shape at the first call: ``[..., T, d]``."""
    input_bytes: int = 0
    """Its input's bytes at the first call: what a tiled forward keeps."""
    forward_s: float = 0.0
    """Device seconds of its forward, priced op by op."""
    forward_ops: int = 0
    """Priced ops of its forward."""
    costs: list[tuple[Any, ...]] = field(default_factory=list, repr=False)
    """Each priced op's cost (``devices.op_cost``): what prices it again at other speeds."""
    saved_sizes: list[int] = field(default_factory=list)
    """Storages its forward saved for backward besides its input (what a tiled forward does not keep)."""
    why_not: str = ""
    """Why it is not position-wise (empty: it is)."""

    @property
    def position_wise(self) -> bool:
        return not self.why_not

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved_sizes)


@dataclass
class _Frame:
    """One call of a watched module, while it runs."""

    name: str
    module: nn.Module
    rows: int
    input_shape: tuple[int, ...]
    input_storage: int
    start_event: int
    known: dict[tuple[Any, ...], int]
    """A tensor (``PositionWatch.key``) -> how many of its leading dimensions are the input's rows
    (>= 1), or ``FIXED``."""
    why_not: str = ""
    seconds: float = 0.0
    costs: list[tuple[Any, ...]] = field(default_factory=list)
    saved: dict[int, int] = field(default_factory=dict)


def _bound(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The op's arguments by name, defaults filled in."""
    bound: dict[str, Any] = {}
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _dims(value: Any, ndim: int) -> list[int] | None:
    """``dim`` arguments normalised to non-negative; None: every dimension (a full reduction)."""
    if value is None:
        return None
    values = [value] if isinstance(value, int) else list(value)
    if not values:
        return None
    return [v % max(ndim, 1) for v in values]


def _rows_in(shape: Iterable[int], rows: int) -> int:
    """The fewest leading dimensions of ``shape`` that multiply to ``rows`` (0: none do)."""
    product = 1
    for index, size in enumerate(shape):
        product *= size
        if product == rows:
            return index + 1
        if product > rows:
            return 0
    return 0


def _writes(func: Any) -> list[str]:
    return [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


class PositionWatch:
    """Follows the rows of every watched module's input through its forward (module docstring).

    ``names`` maps ``id(module)`` to its qualified name; ``tracer`` is the step's
    ``StorageTracer`` (records and events, for what a module saved)."""

    def __init__(self, names: Mapping[int, str], tracer: Any) -> None:
        self.names = names
        self.tracer = tracer
        self.frames: list[_Frame] = []
        self.modules: dict[str, ModuleForward] = {}

    # -- calls -------------------------------------------------------------------------------------

    def enter(self, module: nn.Module, args: tuple[Any, ...], block: str | None) -> None:
        """A module's forward starts (called for every module in the forward phase)."""
        if not args:
            return
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
            return
        if any(isinstance(arg, torch.Tensor) for arg in args[1:]):
            return
        name = self.names.get(id(module))
        if name is None:
            return
        storage = self.tracer.track(x)
        known = {self.key(x): x.dim() - 1}
        for param in module.parameters():
            known[self.key(param)] = FIXED
        rows = math.prod(x.shape[:-1])
        self.frames.append(_Frame(name, module, rows, tuple(x.shape), storage, self.tracer.now(), known))
        if name not in self.modules:
            self.modules[name] = ModuleForward(
                name, type(module).__name__, block, tuple(x.shape), x.numel() * x.element_size()
            )

    def exit(self, module: nn.Module, output: Any) -> None:
        """A module's forward ends: a watched call is judged and summed into its module."""
        if not self.frames or self.frames[-1].module is not module:
            return
        frame = self.frames.pop()
        entry = self.modules[frame.name]
        why = frame.why_not or self._returns(frame, output)
        if why and not entry.why_not:
            entry.why_not = why
        entry.forward_s += frame.seconds
        entry.forward_ops += len(frame.costs)
        entry.costs.extend(frame.costs)
        entry.saved_sizes.extend(nbytes for rid, nbytes in frame.saved.items() if rid != frame.input_storage)

    def key(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        """What identifies a tensor to the rule: its storage's record (one per allocation) and its
        geometry. Not the Python object: autograd hands the user another object than the op made
        for every view (the one an op's record sees is below autograd)."""
        rid = self.tracer.live_record(tensor)
        return (rid, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())

    def _returns(self, frame: _Frame, output: Any) -> str:
        if not isinstance(output, torch.Tensor):
            return f"returns {type(output).__name__}, not one tensor"
        k = frame.known.get(self.key(output))
        if not k or tuple(output.shape[:-1]) != frame.input_shape[:-1]:
            return f"returns shape {list(output.shape)} for an input of shape {list(frame.input_shape)}, not its rows in place"
        return ""

    # -- what happens inside -----------------------------------------------------------------------

    def priced(self, cost: tuple[Any, ...]) -> None:
        """A priced op of the forward ran: it is part of every watched call running (its seconds are
        the fold's, at a device's speeds: ``lightmem.estimate.pricing.fold``)."""
        for frame in self.frames:
            frame.costs.append(cost)

    def saved(self, rid: int, nbytes: int, alloc_event: int) -> None:
        """Autograd saved a storage first: a watched call made it (after it started) and keeps it."""
        for frame in self.frames:
            if alloc_event >= frame.start_event:
                frame.saved[rid] = nbytes

    def op(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> None:
        """A forward op ran: each watched call still position-wise holds it to the rule."""
        for frame in self.frames:
            if not frame.why_not:
                frame.why_not = self._judge(frame, func, args, kwargs, out)

    def _judge(self, frame: _Frame, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> str:
        known = frame.known
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        rowed = [known.get(self.key(t)) for t in read]
        op = func.__name__
        if torch.Tag.nondeterministic_seeded in func.tags and (func._overloadpacket not in _DRAWS or not any(rowed)):
            return f"draws random numbers not per position ({op}): each shard would draw its own"
        for tensor, k in zip(read, rowed):
            if k is None and tensor.requires_grad:
                return f"reads a tensor that requires grad and is neither its input nor its own parameter ({op})"
        if not any(rowed):
            # Made from its own parameters (an autocast copy of a weight): gradients reach them.
            if any(k == FIXED for k in rowed):
                for tensor in outs:
                    known[self.key(tensor)] = FIXED
            return ""
        bound = _bound(func, args, kwargs)
        for name in _writes(func):
            written = bound.get(name)
            if isinstance(written, torch.Tensor) and not known.get(self.key(written)):
                return f"writes its input's values into a tensor made elsewhere ({op}: a buffer, an output given)"
        k, why = self._rows_out(frame, func, bound, read, rowed, outs)
        if why:
            return f"{why} ({op})"
        for tensor in outs:
            known[self.key(tensor)] = k
        return ""

    def _rows_out(
        self, frame: _Frame, func: Any, bound: dict[str, Any], read: list[torch.Tensor], rowed: list[Any],
        outs: list[torch.Tensor],
    ) -> tuple[int, str]:  # fmt: skip
        """How many leading dimensions of the op's outputs are rows, or why the op crosses rows."""
        packet = func._overloadpacket
        first = read[0]
        k = rowed[0] or 0
        if packet in _IN_ORDER:
            if not k:
                return 0, "reads its input as the second argument of a view"
            found = _rows_in(outs[0].shape, frame.rows) if outs else 0
            return (found, "") if found else (0, "reshapes its positions into its features")
        if packet in _REORDER:
            if not k:
                return 0, "expands a tensor to its input's positions"
            if packet is aten.expand:
                size = list(bound.get("size") or [])
                same = len(size) == first.dim() and all(s in (-1, first.shape[i]) for i, s in enumerate(size[:k]))
                return (k, "") if same else (0, "expands along its positions")
            if packet is aten.permute:
                order = _dims(bound.get("dims"), first.dim()) or []
                return (k, "") if order[:k] == list(range(k)) else (0, "moves its positions among its features")
            if packet is aten.t:
                return (k, "") if first.dim() < 2 else (0, "moves its positions among its features")
            pair = [bound.get(n) for n in ("dim0", "dim1", "source", "destination", "axis0", "axis1") if n in bound]
            dims = _dims([d for d in pair if isinstance(d, int)], first.dim()) or []
            return (k, "") if all(d >= k for d in dims) else (0, "moves its positions among its features")
        if packet in _PART:
            if not k:
                return 0, "reads its input as a second argument"
            dim = _dims(bound.get("dim", 0), first.dim())
            return (k, "") if dim is not None and dim[0] >= k else (0, "takes some positions only")
        if packet in _PRODUCTS:
            return self._product(packet, read, rowed, outs)
        if packet in _ALONG_DIM:
            dim = _dims(bound.get("dim", -1), first.dim())
            return (k, "") if k and dim is not None and dim[0] >= k else (0, "reads along its positions")
        if packet in _NORMS:
            shape = bound.get("normalized_shape") or []
            return (k, "") if k and first.dim() - len(shape) >= k else (0, "normalises over its positions")
        if packet in _CAT:
            dim = _dims(bound.get("dim", 0), outs[0].dim() if outs else 1)
            same = all(r == k for r in rowed) and dim is not None and dim[0] >= k
            return (k, "") if same else (0, "joins tensors along its positions")
        if torch.Tag.reduction in func.tags:
            dims = _dims(bound.get("dim"), first.dim())
            if not k or dims is None:
                return 0, "reduces over its positions"
            return (k, "") if all(d >= k for d in dims) else (0, "reduces over its positions")
        if torch.Tag.pointwise in func.tags or packet in _LIKE or packet in _DRAWS:
            return self._elementwise(read, rowed, outs)
        return 0, "runs an op on its input that the rule does not read as position-wise"

    def _elementwise(self, read: list[torch.Tensor], rowed: list[Any], outs: list[torch.Tensor]) -> tuple[int, str]:
        if not outs:
            return 0, ""
        shape = outs[0].shape
        ks = {k for k in rowed if k}
        if len(ks) != 1:
            return 0, "combines tensors whose positions lie differently"
        k = ks.pop()
        for tensor, rows in zip(read, rowed):
            if rows:
                if tensor.dim() != len(shape) or tuple(tensor.shape[:k]) != tuple(shape[:k]):
                    return 0, "broadcasts its input along its positions"
                continue
            offset = len(shape) - tensor.dim()
            if any(size != 1 for index, size in enumerate(tensor.shape) if index + offset < k):
                return 0, "combines its input with a tensor that varies along its positions"
        return k, ""

    def _product(self, packet: Any, read: list[torch.Tensor], rowed: list[Any], outs: list[torch.Tensor]) -> tuple[int, str]:
        """``x @ W``: the input's rows times a tensor not made from it, summed along the features."""
        if packet is aten.addmm:
            bias, read, rowed = (read[0], rowed[0]), read[1:], rowed[1:]
            if bias[1] or (bias[0].dim() == 2 and bias[0].shape[0] != 1):
                return 0, "adds a tensor that varies along its positions to a product"
        elif packet is aten.linear and len(read) == 3:
            read, rowed = read[:2], rowed[:2]
        if len(read) < 2:
            return 0, "multiplies its input by itself"
        (a, b), (ka, kb) = read[:2], rowed[:2]
        if kb:
            return 0, "multiplies two tensors made from its input (as attention does)" if ka else (
                "sums along its positions in a product"
            )
        if packet is aten.mm or packet is aten.addmm:
            return (1, "") if ka == 1 else (0, "multiplies its positions")
        if packet is aten.bmm:
            return (2, "") if ka == 2 else (0, "multiplies its positions")
        if b.dim() != 2 or not outs:
            return 0, "multiplies its input by a tensor of more than two dimensions"
        return (ka, "") if ka < a.dim() else (0, "multiplies its positions")


def tile_candidates(
    modules: Mapping[str, ModuleForward], exclude: Iterable[str] = (),
) -> dict[str, ModuleForward]:
    """The modules the planner may tile: position-wise, whose forward saved more besides its input
    than its input (what a tiled forward keeps instead), and none of whose ancestors is position-wise
    (the outermost: tiling it tiles what is inside), leaving out the model itself and ``exclude``
    (the blocks checkpointing acts on: a module is tiled or checkpointed, not both)."""
    excluded = set(exclude) | {""}
    wise = {name for name, module in modules.items() if module.position_wise}
    found = {}
    for name, module in modules.items():
        if name in excluded or name not in wise or module.saved_bytes <= module.input_bytes:
            continue
        parts = name.split(".")
        if any(".".join(parts[:i]) in wise and ".".join(parts[:i]) not in excluded for i in range(1, len(parts))):
            continue
        found[name] = module
    return found
