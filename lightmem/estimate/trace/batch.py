"""The batch as the estimator sees it: its real values looked at once, then fake tensors of any size.

Values are only needed for one question (is a dense input mostly zeros?), so ``inspect_batch``
reads them from the real batch before anything is faked; everything after works on shapes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

ZERO_FRACTION_ADVICE = 0.9
"""A dense float input at least this fraction zeros is worth an embedding or a sparse layout."""
MIN_ELEMENTS_FOR_ZERO_ADVICE = 4096


@dataclass(frozen=True)
class SparseInput:
    """A floating-point batch tensor that is mostly zeros."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    zero_fraction: float
    one_hot: bool
    """Every row holds exactly one non-zero, equal to 1: a one-hot encoding."""


@dataclass(frozen=True)
class BatchInfo:
    batch_size: int | None
    """Dim 0 shared by the batch's tensors (the most common one), None without tensors."""
    nbytes: int
    sparse_inputs: tuple[SparseInput, ...]


def _leaves(batch: Any) -> tuple[list[Any], Any]:
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)  # e.g. a tokenizer's BatchEncoding: read it as the dict it is
    return tree_flatten(batch)


def _paths(batch: Any) -> list[str]:
    from torch.utils._pytree import keystr, tree_flatten_with_path

    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)
    return [keystr(path) or "batch" for path, _ in tree_flatten_with_path(batch)[0]]


def batch_shapes(batch: Any) -> tuple[tuple[int, ...], ...]:
    """The shape of each tensor of ``batch``, in its flattening order."""
    return tuple(tuple(leaf.shape) for leaf in _leaves(batch)[0] if isinstance(leaf, torch.Tensor))


def with_shapes(batch: Any, shapes: tuple[tuple[int, ...], ...]) -> Any:
    """``batch`` with its tensors grown to ``shapes`` (one per tensor, in ``batch_shapes`` order, none
    smaller): each tensor's values in its leading corner, zeros after them. The estimator reads the
    shapes; of the values, only the zero fraction of dense float inputs (for advice). A Mapping that
    is not a dict comes back as the dict the estimator reads it as."""
    if shapes == batch_shapes(batch):
        return batch
    leaves, spec = _leaves(batch)
    grown = iter(shapes)
    out = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        tensor = leaf.new_zeros(next(grown))
        tensor[tuple(slice(0, size) for size in leaf.shape)] = leaf
        out.append(tensor)
    return tree_unflatten(out, spec)


def inspect_batch(batch: Any) -> BatchInfo:
    """Sizes, the batch dimension, and mostly-zero dense inputs (read from real values)."""
    leaves, _ = _leaves(batch)
    paths = _paths(batch)
    sizes: dict[int, int] = {}
    nbytes = 0
    sparse: list[SparseInput] = []
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        nbytes += leaf.numel() * leaf.element_size()
        if leaf.dim() >= 1:
            sizes[leaf.shape[0]] = sizes.get(leaf.shape[0], 0) + 1
        found = _sparse_input(path, leaf)
        if found is not None:
            sparse.append(found)
    batch_size = max(sizes, key=lambda size: sizes[size]) if sizes else None
    return BatchInfo(batch_size, nbytes, tuple(sparse))


@dataclass(frozen=True)
class SequenceAxis:
    """Where a batch's sequence lies: dimension ``dim`` of every batch tensor whose size there is
    ``length`` (token ids ``[B, T]`` and their labels, hidden states ``[B, T, d]``)."""

    dim: int
    length: int

    def grown(self, to: int) -> tuple[int, int, int]:
        """The resize a fake step applies (``StepRequest.sequence``): (dim, length, to)."""
        return self.dim, self.length, to


def sequence_axis(batch: Any, seq_dim: int | None, *, fn_name: str) -> SequenceAxis:
    """The batch's sequence dimension: ``seq_dim`` when given, else dimension 1 of its first tensor
    with a batch dimension that holds token ids (integers, ``[B, T]``) or vectors of positions
    (floating point, ``[B, T, d]``). Refused (``ValueError`` naming ``fn_name``'s argument) when
    none does, or ``seq_dim`` is no dimension past the batch's of a batch tensor."""
    info = inspect_batch(batch)
    tensors = [t for t in batch_tensors(batch) if t.dim() >= 1 and t.shape[0] == info.batch_size]
    if seq_dim is not None:
        flag = f"{fn_name}(seq_dim=...)"
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
            raise ValueError(f"{flag}: expected a dimension after the batch's (an int >= 1); got {seq_dim!r}")
        found = next((t for t in tensors if t.dim() > seq_dim), None)
        if found is None:
            raise ValueError(f"{flag}: no tensor of the batch has a dimension {seq_dim} after its batch dimension")
        return SequenceAxis(seq_dim, found.shape[seq_dim])
    for tensor in tensors:
        integer = not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool
        if (integer and tensor.dim() >= 2) or (tensor.is_floating_point() and tensor.dim() == 3):
            return SequenceAxis(1, tensor.shape[1])
    raise ValueError(
        f"{fn_name}(batch=...): no tensor of the batch holds a sequence as token ids [B, T] or vectors [B, T, d]; "
        f"name its dimension with {fn_name}(seq_dim=...)"
    )


def scalable_batch(batch: Any, *, flag: str) -> BatchInfo:
    """``inspect_batch`` for a search over batch sizes: a batch with no batch dimension is refused."""
    info = inspect_batch(batch)
    if info.batch_size is None:
        raise ValueError(f"{flag}: the batch holds no tensor with a batch dimension to scale")
    return info


CHECK_PIECE_SHARE = 100
"""The check reads a tensor in pieces of at most 1/CHECK_PIECE_SHARE of its elements, so what it
allocates (masks, per-row counts) stays a few percent of the batch, never a copy of it."""


def _sparse_input(path: str, tensor: torch.Tensor) -> SparseInput | None:
    if (
        not tensor.is_floating_point()
        or tensor.is_meta
        or _is_fake(tensor)
        or tensor.layout != torch.strided
        or tensor.numel() < MIN_ELEMENTS_FOR_ZERO_ADVICE
    ):
        return None
    values = tensor.detach()
    piece = max(MIN_ELEMENTS_FOR_ZERO_ADVICE, values.numel() // CHECK_PIECE_SHARE)
    nonzeros = 0
    one_hot = values.dim() >= 2
    for rows in _row_pieces(values, piece):
        counts = torch.zeros(rows.shape[0], dtype=torch.int64, device=values.device)
        ones = torch.zeros(rows.shape[0], dtype=torch.int64, device=values.device)
        for start in range(0, rows.shape[1], piece):
            columns = rows[:, start : start + piece]
            counts += torch.count_nonzero(columns, dim=1)
            if one_hot:
                ones += torch.count_nonzero(columns == 1, dim=1)
        nonzeros += int(counts.sum())
        # One non-zero per row, and it is a 1.
        one_hot = one_hot and bool((counts == 1).all()) and bool((ones == 1).all())
    zeros = 1.0 - nonzeros / values.numel()
    if zeros < ZERO_FRACTION_ADVICE:
        return None
    return SparseInput(
        path, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
        tensor.numel() * tensor.element_size(), zeros, one_hot,
    )  # fmt: skip


def _row_pieces(values: torch.Tensor, piece: int) -> Iterator[torch.Tensor]:
    """Views of ``values`` as (rows, last dim) matrices of about ``piece`` elements each; a tensor
    that cannot be viewed as rows is walked along its first dim instead of copied."""
    if values.dim() < 2:
        values = values.reshape(1, -1) if values.is_contiguous() else values.unsqueeze(0)
    try:
        rows = values.view(-1, values.shape[-1])
    except RuntimeError:  # not viewable as one matrix: one leading index at a time
        for inner in values:
            yield from _row_pieces(inner if inner.dim() >= 2 else inner.unsqueeze(0), piece)
        return
    step = max(1, piece // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        yield rows[start : start + step]


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def fake_batch(
    batch: Any,
    *,
    device: str | torch.device,
    batch_size: int | None = None,
    original_batch_size: int | None = None,
    float_dtype: torch.dtype | None = None,
    sequence: tuple[int, int, int] | None = None,
) -> Any:
    """The batch rebuilt with empty tensors; call under ``FakeTensorMode`` so nothing is allocated.

    ``batch_size`` replaces dim 0 of every tensor whose dim 0 is ``original_batch_size``;
    ``sequence`` (dim, length, new length: ``SequenceAxis.grown``) replaces that dim of every tensor
    whose size there is length; ``float_dtype`` converts floating-point tensors (Lightning's "-true"
    precisions do the same).
    """
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)
    leaves, spec = tree_flatten(batch)
    out = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        shape = list(leaf.shape)
        if batch_size is not None and shape and shape[0] == original_batch_size:
            shape[0] = batch_size
        if sequence is not None and len(shape) > sequence[0] and shape[sequence[0]] == sequence[1]:
            shape[sequence[0]] = sequence[2]
        dtype = float_dtype if float_dtype is not None and leaf.is_floating_point() else leaf.dtype
        out.append(torch.empty(shape, dtype=dtype, device=device, requires_grad=leaf.requires_grad))
    return tree_unflatten(out, spec)


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    leaves, _ = _leaves(batch)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
