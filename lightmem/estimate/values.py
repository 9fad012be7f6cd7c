"""Values the dry run cannot see, stood in for under stated assumptions.

Fake tensors have shapes but no values, so an op whose output depends on values (``.item()``,
``bool(t)``, ``.tolist()``, ``torch.equal``, ``nonzero``, boolean-mask indexing, ``unique``,
``bincount``) cannot run on them. ``StandIns`` answers those ops in the tracer, from what it
assumes of the values, and records each answer with the user's statement that asked for it
(``StandIns.notes``), so the estimate can say where it stood in and what that can get wrong.

What is assumed:

- **Routing.** A tensor of indices chosen by ``topk`` (or ``argmax``, ``max``) over a dimension of
  E categories is a routing: each row picks k distinct categories out of E. Masks and counts made of
  it (``indices == e``, ``one_hot``, their sums, ``bincount``) are followed, and the sizes they give
  follow the routing assumption of the step: **balanced** (each category gets rows x k / E) for the
  prediction, or **worst** (every row to the same categories: the first k categories asked for get
  every row, the rest none) for the bound on the transient peak. The sum over the categories is
  exact either way, so the activations saved across all experts do not depend on the assumption.
- **Checks.** ``all`` holds, ``any`` does not, ``isnan`` / ``isinf`` find nothing, ``isfinite``
  everything, ``torch.equal`` / ``allclose`` hold: the step takes its usual path, not its error
  or special-case branch. A comparison of unknown values reads as False.
- **Numbers.** A float reads as 1.0 (a loss logged, a closure's loss compared); an integer read of
  a count that is followed reads its value, any other integer 0.
- **Sizes of unknown masks.** A mask that is not followed (``labels != -100``) is taken as all true:
  the largest size, so memory is not under-counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lightmem.estimate.call_site import call_site

aten = torch.ops.aten

BALANCED, WORST = "balanced", "worst"


@dataclass(eq=False)
class Routing:
    """Rows that each pick ``picks`` distinct categories out of ``categories`` (a top-k routing)."""

    categories: int
    picks: int
    rows: int
    mode: str
    given: int = 0
    """Assignments handed to category slices so far (the worst case hands them out greedily)."""
    slices: int = 0
    """Category slices sized so far (the balanced case spreads the remainder over the first ones)."""

    @property
    def assignments(self) -> int:
        return self.rows * self.picks

    def slice_count(self) -> int:
        """How many rows the next category asked for gets."""
        if self.mode == WORST:
            count = max(0, min(self.rows, self.assignments - self.given))
        else:
            base, extra = divmod(self.assignments, self.categories)
            count = base + (1 if self.slices % self.categories < extra else 0)
        self.given += count
        self.slices += 1
        return count

    def category_counts(self) -> list[int]:
        """Rows per category: even (balanced), or all rows on the first ``picks`` categories (worst)."""
        if self.mode == WORST:
            return [self.rows if c < self.picks else 0 for c in range(self.categories)]
        base, extra = divmod(self.assignments, self.categories)
        return [base + (1 if c < extra else 0) for c in range(self.categories)]


@dataclass(eq=False)
class Known:
    """What is assumed of a storage's values: its density of true (non-zero) elements, the routing
    it comes from, and, where known, each element's value (in storage order)."""

    density: float = 1.0
    routing: Routing | None = None
    categorical: bool = False
    """Holds category indices of ``routing`` (not a mask of it)."""
    category_stride: int | None = None
    """A routing mask's element stride along its category dimension (None: one category's mask)."""
    values: list[Any] | None = None


@dataclass
class StandInNote:
    """One kind of stand-in at one statement of the user's code."""

    what: str
    where: str
    value: str
    times: int = 1


@dataclass
class StandIns:
    """Answers value-dependent ops in the tracer (module docstring)."""

    mode: str = BALANCED
    notes: dict[tuple[str, str], StandInNote] = field(default_factory=dict)
    routed: bool = False
    """A routing's sizes were stood in for: the step's peak depends on the routing assumption."""

    def note(self, what: str, value: Any) -> None:
        site = call_site()
        where = site.where if site is not None else "the library's code"
        key = (what, where)
        found = self.notes.get(key)
        if found is None:
            self.notes[key] = StandInNote(what, where, str(value))
        else:
            found.times += 1

    def summary(self) -> list[str]:
        """One line per kind of stand-in and statement: ``.item() at train.py:42 read as 1.0 (x3)``."""
        return [
            f"{note.what} at {note.where} read as {note.value}" + (f" (x{note.times})" if note.times > 1 else "")
            for note in self.notes.values()
        ]

    # -- answering value-dependent ops -----------------------------------------------------------

    def answer(self, func: Any, args: tuple, kwargs: dict, known_of: Any, mark: Any) -> Any:
        """The output of ``func`` (an op whose fake kernel needs values), or ``NotImplemented``.
        ``known_of(tensor)`` gives what is assumed of a tensor's values; ``mark(tensor, known)``
        records it for an output."""
        packet = func._overloadpacket
        if packet is aten._local_scalar_dense:
            return self._scalar(args[0], known_of)
        if packet in (aten.equal, aten.allclose):
            self.note(f"torch.{packet.__name__}", True)
            return True
        if packet is aten.is_nonzero:
            return bool(self._scalar(args[0], known_of))
        if packet is aten.nonzero:
            mask = args[0]
            count = self._count(mask, known_of, "nonzero")
            out = torch.empty((count, mask.dim()), dtype=torch.long, device=mask.device)
            mark(out, self._positions(mask, known_of))
            return out
        if packet is aten.masked_select:
            source, mask = args[0], args[1]
            count = self._count(mask, known_of, "masked_select")
            return torch.empty((count,), dtype=source.dtype, device=source.device)
        if packet is aten.index and any(i is not None and i.dtype == torch.bool for i in args[1]):
            indices = [
                tuple(torch.empty((self._count(i, known_of, "boolean-mask indexing"),), dtype=torch.long, device=i.device) for _ in range(i.dim()))
                if i is not None and i.dtype == torch.bool else (i,)
                for i in args[1]
            ]  # fmt: skip
            return func(args[0], [index for group in indices for index in group])
        if packet is aten._unique2:
            return self._unique(func, args, kwargs, known_of)
        if packet is aten.bincount:
            return self._bincount(args, kwargs, known_of, mark)
        return NotImplemented

    def _scalar(self, tensor: torch.Tensor, known_of: Any) -> Any:
        known = known_of(tensor)
        if tensor.dtype == torch.bool:
            value = known is not None and known.density >= 0.5
            self.note("a tensor read as a bool (`if t:`, bool(t))", value)
            return value
        if known is not None and known.values is not None:
            offset = tensor.storage_offset()
            if offset < len(known.values):
                return known.values[offset]
        if tensor.is_floating_point() or tensor.is_complex():
            self.note("a float read (.item(), float(t))", 1.0)
            return 1.0
        self.note("an integer read (.item(), int(t), .tolist())", 0)
        return 0

    def _count(self, mask: torch.Tensor, known_of: Any, what: str) -> int:
        """How many elements of ``mask`` are true (non-zero)."""
        known = known_of(mask)
        numel = mask.numel()
        if known is None:
            self.note(f"{what} of a mask not followed (taken as all true)", numel)
            return numel
        routing = known.routing
        if routing is not None and not known.categorical:
            self.routed = True
            expected = numel * known.density
            if math.isclose(expected, routing.assignments):  # every category: exact either way
                return routing.assignments
            count = routing.slice_count()
            return min(count, numel)
        if known.values is not None and numel == len(known.values):
            return sum(1 for value in known.values if value)
        return min(numel, round(numel * known.density))

    def _positions(self, mask: torch.Tensor, known_of: Any) -> Known | None:
        """What ``nonzero(mask)`` holds, where each true element's index is known (a 1-D mask of counts)."""
        known = known_of(mask)
        if known is None or known.values is None or mask.dim() != 1 or len(known.values) != mask.numel():
            return None
        return Known(values=[i for i, value in enumerate(known.values) if value])

    def _unique(self, func: Any, args: tuple, kwargs: dict, known_of: Any) -> Any:
        source = args[0]
        names = ("sorted", "return_inverse", "return_counts")
        options = dict(zip(names, args[1:]))
        options.update(kwargs)
        known = known_of(source)
        count = known.routing.categories if known is not None and known.categorical and known.routing else source.numel()
        count = min(count, source.numel())
        self.note("torch.unique (as many distinct values as it may hold)", count)
        values = torch.empty((count,), dtype=source.dtype, device=source.device)
        inverse = torch.empty(source.shape if options.get("return_inverse") else (0,), dtype=torch.long, device=source.device)
        counts = torch.empty((count,) if options.get("return_counts") else (0,), dtype=torch.long, device=source.device)
        return values, inverse, counts

    def _bincount(self, args: tuple, kwargs: dict, known_of: Any, mark: Any) -> Any:
        source = args[0]
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
        known = known_of(source)
        routing = known.routing if known is not None and known.categorical else None
        length = max(minlength, routing.categories if routing is not None else 0)
        if routing is None:
            self.note("torch.bincount of values not followed (minlength bins)", length)
        else:
            self.routed = True
        dtype = weights.dtype if weights is not None else torch.long
        out = torch.empty((length,), dtype=dtype, device=source.device)
        if routing is not None:
            counts = routing.category_counts()
            mark(out, Known(values=counts + [0] * (length - len(counts))))
        return out

    # -- following values through the ops that make them ----------------------------------------

    def follow(self, func: Any, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
        """What ``out`` holds, for the few ops routing and checks are made of."""
        rule = _RULES.get(func._overloadpacket)
        if rule is not None:
            rule(self, args, kwargs, out, known_of, mark)


def _topk(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    source = args[0]
    if source.dim() == 0:
        return
    k = args[1] if len(args) > 1 else kwargs["k"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    categories = source.shape[dim]
    indices = out[1]
    rows = indices.numel() // max(k, 1)
    mark(indices, Known(routing=Routing(categories, k, rows, self.mode), categorical=True))


def _arg_max(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    source = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or source.dim() == 0:
        return
    indices = out[1] if isinstance(out, (tuple, list)) else out
    mark(indices, Known(routing=Routing(source.shape[dim], 1, indices.numel(), self.mode), categorical=True))


def _equal(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    """``indices == e`` (one category's mask) or ``indices[..., None] == arange(E)`` (every category's)."""
    left, right = args[0], args[1]
    known = known_of(left) if isinstance(left, torch.Tensor) else None
    other = right
    if known is None or not known.categorical:
        known = known_of(right) if isinstance(right, torch.Tensor) else None
        other = left
    if known is None or not known.categorical or known.routing is None:
        return
    routing = known.routing
    stride = None
    if isinstance(other, torch.Tensor) and other.numel() == routing.categories and out.numel() > 0:
        # The dimension along which the other side runs over the categories: the mask's category axis.
        dims = [d for d in range(out.dim()) if out.shape[d] == routing.categories and (other.dim() + d - out.dim()) >= 0
                and other.shape[other.dim() + d - out.dim()] == routing.categories]  # fmt: skip
        stride = out.stride(dims[-1]) if dims else None
    mark(out, Known(density=1 / routing.categories, routing=routing, category_stride=stride))


def _one_hot(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    known = known_of(args[0])
    if known is None or not known.categorical or known.routing is None:
        return
    mark(out, Known(density=1 / known.routing.categories, routing=known.routing, category_stride=out.stride(-1)))


def _sum(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    source = args[0]
    known = known_of(source)
    if known is None or known.categorical or not isinstance(out, torch.Tensor):
        return
    routing = known.routing
    if routing is not None and known.category_stride is not None and out.numel() == routing.categories:
        # Summed over all but the category axis: rows per category.
        kept = [d for d in range(source.dim()) if source.stride(d) == known.category_stride and source.shape[d] == routing.categories]
        if kept:
            self.routed = True
            mark(out, Known(values=routing.category_counts()))
            return
    each = source.numel() / max(out.numel(), 1) * known.density
    value = round(each) if not source.is_floating_point() else each
    mark(out, Known(density=1.0 if each else 0.0, values=[value] * out.numel()))


def _compare_counts(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any, test: Any) -> None:
    known = known_of(args[0])
    threshold = args[1] if len(args) > 1 else None
    if known is None or known.values is None or not isinstance(threshold, (int, float)) or out.numel() != len(known.values):
        return
    values = [bool(test(value, threshold)) for value in known.values]
    mark(out, Known(density=sum(values) / max(len(values), 1), values=values))


def _density(value: float) -> Any:
    def rule(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
        mark(out, Known(density=value))

    return rule


def _not(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    known = known_of(args[0])
    mark(out, Known(density=1 - (known.density if known is not None else 0.0)))


def _reduce_any(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    """``any``: an unknown check finds nothing; a followed mask holds something where it expects one."""
    known = known_of(args[0])
    found = known is not None and (known.routing is not None or args[0].numel() * known.density >= 0.5)
    mark(out, Known(density=1.0 if found else 0.0))


def _reduce_all(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    """``all``: an unknown check holds; a followed mask holds everywhere only when wholly true."""
    known = known_of(args[0])
    mark(out, Known(density=1.0 if known is None or known.density >= 1.0 else 0.0))


_RULES = {
    aten.topk: _topk,
    aten.max: _arg_max,
    aten.argmax: _arg_max,
    aten.eq: _equal,
    aten.one_hot: _one_hot,
    aten.sum: _sum,
    aten.gt: lambda *a: _compare_counts(*a, test=lambda v, t: v > t),
    aten.ge: lambda *a: _compare_counts(*a, test=lambda v, t: v >= t),
    aten.ne: lambda *a: _compare_counts(*a, test=lambda v, t: v != t),
    aten.isnan: _density(0.0),
    aten.isinf: _density(0.0),
    aten.isposinf: _density(0.0),
    aten.isneginf: _density(0.0),
    aten.isfinite: _density(1.0),
    aten.logical_not: _not,
    aten.bitwise_not: _not,
    aten.any: _reduce_any,
    aten.all: _reduce_all,
}

FOLLOWED = frozenset(_RULES)
"""The ops ``StandIns.follow`` reads (the tracer asks it of no other)."""
