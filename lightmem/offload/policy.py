"""Which saved tensors move to host memory: the one decision, run by the engine and the estimator.

The offload engine (``hooks.py``) calls it on real tensors in its pack hook; the estimator
(``lightmem/estimate/trace/offload_sim.py``) calls the same code on fake tensors, so a predicted
``offloaded_bytes`` is what the engine moves. The two differ only in what a plain tensor is
(``torch.Tensor`` or ``FakeTensor``) and how a storage is named (its data pointer, or the
identity of its Python object: fake storages have no data).

For one saved tensor, in this order:

1. Left alone (``LEAVE``): a device type not offloaded, a tensor subclass or a ``Parameter``, no
   accessible storage (sparse, mkldnn) or a nested layout, a view of a parameter, a storage of size
   0 (nothing to move, or freed by ``resize_(0)`` as FSDP does), a parameter or buffer storage (by
   storage, so views and compiled graphs are covered).
2. A storage already saved in this forward by the same tensor (or a view of it) at the same
   version is not decided again: the earlier decision holds (``same_save``).
3. Kept on the device (``KEEP``): the storage it keeps alive is under ``min_bytes``, the module
   scope (``include`` / ``exclude``, and the module's own threshold where ``include`` gives one)
   forbids it, it is complex, or it is an autocast (``.to()``)
   copy of a parameter (moving it every step would move the weights; it is device memory the
   graph holds, so it counts as kept).
4. Otherwise moved (``MOVE``), if the host budget has room for its host block
   (``fits_host_budget``); past the budget it stays on the device.

Backward reloads ahead of need in reverse pack order while ``prefetch_admits`` (the walk is
``protocol.py``'s, also shared by the engine and the estimator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightmem.offload.scope import ModuleScope
from lightmem.transfer.pool import size_class

LEAVE = 0
"""Not the offloader's to move: parameters, buffers, other devices, no plain storage, empty storages."""
KEEP = 1
"""Stays on the device by policy: under ``min_bytes``, out of scope, complex, or a parameter copy."""
MOVE = 2
"""Goes to host memory, if the host budget has room."""

Decision = tuple[int, Any, Any, int, int]
"""``(verdict, alias, storage, nbytes, key)``; only ``verdict`` is meaningful for ``LEAVE``."""

_LEFT_ALONE: Decision = (LEAVE, None, None, 0, 0)
_TO_COPY_BACKWARD = type(torch.zeros(1, device="cpu", requires_grad=True).double().grad_fn)  # autocast's and .to()'s node


class OffloadPolicy:
    """The offload decision for saved tensors (see the module doc for the rules and their order).

    Args:
        min_bytes: move a saved tensor only if the storage it keeps alive has at least this many bytes.
        devices: device types whose saved tensors may move.
        plain_type: the type of an ordinary tensor; any other type (``Parameter``, subclasses) is
            left alone. ``FakeTensor`` for the estimator, whose parameters are recognised by storage.
        storage_key: names a storage for ``protected`` and for dedupe.

    ``scope`` (a ``ModuleScope``) and ``protected`` (keys of parameter and buffer storages) are
    set by the owner before each forward.
    """

    __slots__ = (
        "_on_cpu", "_on_cuda", "_on_other", "devices", "key", "min_bytes", "plain", "protected", "scope",
    )  # fmt: skip

    def __init__(
        self,
        *,
        min_bytes: int,
        devices: tuple[str, ...],
        plain_type: type = Tensor,
        storage_key: Callable[[torch.UntypedStorage], int] = torch.UntypedStorage.data_ptr,
    ) -> None:
        self.min_bytes = min_bytes
        self.devices = devices
        self._on_cuda = "cuda" in devices
        self._on_cpu = "cpu" in devices
        self._on_other = any(d not in ("cuda", "cpu") for d in devices)
        self.plain = plain_type
        self.key = storage_key
        self.scope: ModuleScope | None = None
        self.protected: set[int] = set()

    def decide(self, tensor: Tensor) -> Decision:
        """``(verdict, alias, storage, nbytes, key)`` for one saved tensor.

        ``alias`` is the tensor whose identity stands for the storage (the view's base, or the
        tensor itself); ``nbytes`` is the size of the whole storage the save keeps alive.
        """
        # Checks run cheapest first: on a GPU this runs on the thread that launches kernels.
        plain = self.plain
        if type(tensor) is not plain or not (  # parameters and tensor subclasses stay where they are
            (self._on_cuda and tensor.is_cuda)
            or (self._on_cpu and tensor.is_cpu)
            or (self._on_other and tensor.device.type in self.devices)
        ):
            return _LEFT_ALONE
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:  # sparse, mkldnn: no plain storage to move (cheaper than .layout)
            return _LEFT_ALONE
        if tensor.is_nested:
            return _LEFT_ALONE
        alias = tensor._base
        if alias is None:
            alias = tensor
        elif type(alias) is not plain:  # a view of a parameter, known at enter or not (FSDP)
            return _LEFT_ALONE
        nbytes = storage.nbytes()
        if nbytes == 0:  # nothing to move; or freed by resize_(0) (FSDP): never touch its pointer
            return _LEFT_ALONE
        key = self.key(storage)
        if key in self.protected:
            return _LEFT_ALONE
        if nbytes < self.min_bytes:
            return (KEEP, alias, storage, nbytes, key)
        scope = self.scope
        if (scope is None or nbytes >= scope.threshold) and not tensor.is_complex():
            # Read last: a tensor's grad_fn is a new Python object on most reads (its node's wrapper).
            grad_fn = alias.grad_fn
            if type(grad_fn) is not _TO_COPY_BACKWARD or not self._is_parameter_copy(grad_fn):
                return (MOVE, alias, storage, nbytes, key)
        return (KEEP, alias, storage, nbytes, key)

    def _is_parameter_copy(self, grad_fn: Any) -> bool:
        """Whether ``grad_fn`` (a ``ToCopyBackward0``) made an autocast (or .to()) copy of a
        parameter: moving it every step would move the weights."""
        source = grad_fn.next_functions[0][0]
        variable = getattr(source, "variable", None)  # AccumulateGrad of a leaf
        if variable is None:
            return False
        if type(variable) is not self.plain:  # a parameter, also one created after enter (FSDP)
            return True
        storage = variable.untyped_storage()
        return storage.nbytes() > 0 and self.key(storage) in self.protected


def same_save(known: Any, alias: Tensor, version: int) -> bool:
    """Whether ``known``, the record of an earlier save of the same storage key in this forward,
    stands for this save too (then the earlier decision holds and nothing moves twice).

    A record (``.alias``: a weak reference, ``.version``) counts only for the same alias at the
    same version: a storage key can be reused once its storage is freed, and an in-place change
    in between makes it different data. Callers look the key up themselves (a miss, the common
    case, then costs no call).
    """
    return known.alias() is alias and known.version == version


def host_bytes(nbytes: int) -> int:
    """Host bytes one moved storage of ``nbytes`` holds (the pool's size class)."""
    return size_class(nbytes)


def fits_host_budget(in_use_bytes: int, nbytes: int, budget_bytes: int | None) -> bool:
    """Whether a storage of ``nbytes`` may move while ``in_use_bytes`` of host blocks hold others.

    The engine's pool gives a block only within its budget (free cached blocks are trimmed to
    make room); its other floor, the machine's available RAM, belongs to the machine, not the
    policy, and the estimator does not model it.
    """
    return budget_bytes is None or in_use_bytes + host_bytes(nbytes) <= budget_bytes


def prefetch_admits(inflight_bytes: int, nbytes: int, window_bytes: int) -> bool:
    """Whether a reload of ``nbytes`` may start ahead of need with ``inflight_bytes`` in flight.

    One reload is always admitted when none is in flight, so a storage larger than the window
    still prefetches alone. The window holds in the device's order of execution too, not only on
    the host: reloads are allocated on the compute stream that reads them and copied only once
    compute has reached that point (``hooks.py``), so the device holds at most the window plus
    what the running backward node reads, however far the host runs ahead.
    """
    return inflight_bytes == 0 or inflight_bytes + nbytes <= window_bytes
