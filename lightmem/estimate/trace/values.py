"""Values the dry run cannot see, stood in for under stated assumptions.

Fake tensors have shapes but no values, so an op whose output depends on values (``.item()``,
``bool(t)``, ``.tolist()``, ``torch.equal``, ``nonzero``, boolean-mask indexing, ``unique``,
``bincount``) cannot run on them. ``StandIns`` answers those ops in the tracer, from what it
assumes of the values, and records each answer with the user's statement that asked for it
(``StandIns.notes``), so the estimate can say where it stood in and what that can get wrong.

What is assumed:

- **Routing.** A tensor of indices chosen by ``topk`` (or ``argmax``, ``max``) over a dimension of
  E categories is a routing: each row picks k distinct categories out of E. Masks and counts made of
  it (``indices == e``, ``one_hot`` with E or more classes, their copies and sums, ``bincount``, the
  categories with rows, ``nonzero`` of them and each one read back) are followed, and the sizes they
  give follow the routing assumption of the step: **balanced** (each category gets rows x k / E) for
  the prediction, or **worst** for the bound on the transient peak: a category's mask read on its own
  (``torch.where(indices == e)``) is as large as a routing can make it, every row for the first k
  categories asked for and one row for each other (an expert that runs at all pays what it costs
  whatever its rows: a step that runs fewer experts can peak lower), while counts read together
  (``bincount``, a mask summed over its rows) add up to rows x k exactly, the first categories taking
  all they can. Under balanced routing the sum over the categories is exact, so the activations saved
  across all experts do not depend on the assumption; the worst case counts one row more for each
  category past the first k.
- **Checks.** ``all`` holds, ``any`` does not, ``isnan`` / ``isinf`` find nothing, ``isfinite``
  everything, ``torch.equal`` / ``allclose`` hold: the step takes its usual path, not its error
  or special-case branch. A comparison of unknown values reads as False.
- **Numbers.** A float reads as 1.0 (a loss logged, a closure's loss compared); an integer read of
  a count that is followed reads its value, any other integer 0.
- **Sizes of unknown masks.** A mask that is not followed (``labels != -100``) is taken as all true:
  the largest size, so memory is not under-counted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lightmem.estimate.trace.call_site import call_site

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
        """How many rows the next category asked for gets (its mask's true elements).

        Worst case: all rows for each of the first ``picks`` categories asked for, one row for every
        other (a category that runs costs what it costs, however few its rows): each mask as large
        as a routing can make it, the total past the exact one by a row per category after the first
        ``picks``."""
        if self.mode == WORST:
            count = self.rows if self.slices < self.picks else min(1, self.rows)
        else:
            base, extra = divmod(self.assignments, self.categories)
            count = base + (1 if self.slices % self.categories < extra else 0)
        self.given += count
        self.slices += 1
        return count

    def category_counts(self) -> list[int]:
        """Rows per category, read all at once (``bincount``, a mask summed over its rows): the
        counts add up to ``assignments`` exactly (a split by them must cover every row). Worst case:
        as many rows as each category can take, in order, keeping one for every category after it."""
        if self.mode != WORST:
            base, extra = divmod(self.assignments, self.categories)
            return [base + (1 if c < extra else 0) for c in range(self.categories)]
        counts: list[int] = []
        for category in range(self.categories):
            remaining = self.assignments - sum(counts)
            later = self.categories - category - 1
            counts.append(0 if remaining <= 0 else min(self.rows, remaining - min(later, remaining - 1)))
        return counts


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
    classes: int = 0
    """A routing mask's size along its category dimension: the routing's categories, or more
    (``one_hot(indices, num_classes=E + 1)``: a class no row picks)."""
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
        found = _elements(tensor, known)
        if found is not None and len(found) == 1:  # followed: a count, an expert index, a comparison of them
            return bool(found[0]) if tensor.dtype == torch.bool else found[0]
        if tensor.dtype == torch.bool:
            value = known is not None and known.density >= 0.5
            self.note("a tensor read as a bool (`if t:`, bool(t))", value)
            return value
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
            count = min(routing.slice_count(), numel)
            self.note(f"the rows a top-{routing.picks} routing of {routing.rows} rows sends to one of "
                      f"{routing.categories} experts ({what})", f"{count} ({routing.mode} routing)")  # fmt: skip
            return count
        found = _elements(mask, known)
        if found is not None:
            return sum(1 for value in found if value)
        return min(numel, round(numel * known.density))

    def _positions(self, mask: torch.Tensor, known_of: Any) -> Known | None:
        """What ``nonzero(mask)`` holds, where each true element's index is known (a 1-D mask of counts)."""
        found = _elements(mask, known_of(mask)) if mask.dim() == 1 else None
        if found is None:
            return None
        return Known(values=[i for i, value in enumerate(found) if value])

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


def _elements(tensor: torch.Tensor, known: Known | None) -> list[Any] | None:
    """The values of ``tensor``'s elements, where its storage's are known (a view of them included)."""
    values = known.values if known is not None else None
    if values is None:
        return None
    if tensor.numel() == len(values) and tensor.storage_offset() == 0 and tensor.is_contiguous():
        return values
    if tensor.numel() > _ELEMENTS_READ:
        return None
    offsets = [tensor.storage_offset()]
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = [offset + index * stride for offset in offsets for index in range(size)]
    if any(offset >= len(values) for offset in offsets):
        return None
    return [values[offset] for offset in offsets]


_ELEMENTS_READ = 4096
"""The most elements of a view of known values read one by one (counts and indices are few)."""


def _category_dim(tensor: torch.Tensor, known: Known) -> int | None:
    """The dimension of ``tensor`` (a view of a routing mask) that runs over the categories."""
    for dim in range(tensor.dim()):
        if tensor.stride(dim) == known.category_stride and tensor.shape[dim] == known.classes:
            return dim
    return None


def _equal(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    """``indices == e`` (one category's mask), ``indices[..., None] == arange(C)`` (every category's,
    as ``one_hot`` runs on fake tensors), or a comparison of known values (``expert_index == E``)."""
    left, right = args[0], args[1]
    known = known_of(left) if isinstance(left, torch.Tensor) else None
    other = right
    if known is None or not known.categorical:
        known = known_of(right) if isinstance(right, torch.Tensor) else None
        other = left
    if known is None or not known.categorical or known.routing is None:
        _compare_counts(self, args, kwargs, out, known_of, mark, test=lambda v, t: v == t)
        return
    routing = known.routing
    if isinstance(other, torch.Tensor) and other.numel() >= routing.categories and out.numel() > 0:
        # The other side runs over the categories (and maybe more classes): the mask's category axis.
        dims = [d for d in range(out.dim()) if out.shape[d] == other.numel() and (other.dim() + d - out.dim()) >= 0
                and other.shape[other.dim() + d - out.dim()] == other.numel()]  # fmt: skip
        if dims:
            classes = out.shape[dims[-1]]
            mark(out, Known(density=1 / classes, routing=routing, category_stride=out.stride(dims[-1]), classes=classes))
            return
    mark(out, Known(density=1 / routing.categories, routing=routing))


def _one_hot(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    known = known_of(args[0])
    if known is None or not known.categorical or known.routing is None:
        return
    classes = out.shape[-1]
    mark(out, Known(density=1 / classes, routing=known.routing, category_stride=out.stride(-1), classes=classes))


def _copy(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    """A copy (``.to(dtype)``, ``.clone()``; ``one_hot``'s cast on fake tensors) holds what its source held."""
    source = args[0]
    if source.is_floating_point() or not isinstance(out, torch.Tensor):
        return
    known = known_of(source)
    if known is None:
        return
    stride = known.category_stride
    if stride is not None:
        dim = _category_dim(source, known)
        stride = out.stride(dim) if dim is not None else None
    values = _elements(source, known) if known.values is not None else None
    mark(out, dataclasses.replace(known, category_stride=stride, values=values, classes=known.classes if stride is not None else 0))


def _sum(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any) -> None:
    source = args[0]
    known = known_of(source)
    if known is None or known.categorical or not isinstance(out, torch.Tensor):
        return
    routing = known.routing
    summed_to_categories = known.category_stride is not None and out.numel() == known.classes
    if routing is not None and summed_to_categories and _category_dim(source, known) is not None:
        # Summed over all but the category axis: rows per category (none for a class past them).
        self.routed = True
        counts = routing.category_counts()
        mark(out, Known(values=counts + [0] * (known.classes - len(counts))))
        return
    each = source.numel() / max(out.numel(), 1) * known.density
    value = round(each) if not source.is_floating_point() else each
    mark(out, Known(density=1.0 if each else 0.0, values=[value] * out.numel()))


def _compare_counts(self: StandIns, args: tuple, kwargs: dict, out: Any, known_of: Any, mark: Any, test: Any) -> None:
    threshold = args[1] if len(args) > 1 else None
    if not isinstance(threshold, (int, float)) or not isinstance(out, torch.Tensor):
        return
    found = _elements(args[0], known_of(args[0]))
    if found is None or out.numel() != len(found):
        return
    values = [bool(test(value, threshold)) for value in found]
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
    aten.lt: lambda *a: _compare_counts(*a, test=lambda v, t: v < t),
    aten.le: lambda *a: _compare_counts(*a, test=lambda v, t: v <= t),
    aten.ne: lambda *a: _compare_counts(*a, test=lambda v, t: v != t),
    aten._to_copy: _copy,
    aten.clone: _copy,
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
