"""The offloaded parameters: each one's host copy and gradient buffers, and the host arenas they
are carved from.

A parameter offloaded has a ``Slot``: the device parameter, its host copy (the ``master`` the
param groups hold while offloaded), the host buffers its gradient lands in, and how lightmem last
saw the device parameter (``Written``). ``HostCopies`` keeps the slots and owns the host memory:
one arena for the copies of the parameters offloaded at the start and one per param group added
since, one for gradient buffers and one for accumulation staging (each carved the first time a
gradient needs it), and with ``device_dtype`` the narrow copies that travel to the device and the
masters' wide gradients. ``close()`` gives all of it back at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightmem.model_state import host_grads
from lightmem.model_state.device_dtype import DeviceDtype
from lightmem.model_state.stats import OptimizerOffloadStats
from lightmem.transfer.arena import HostArena
from lightmem.transfer.transport import Transport

_HOST = torch.device("cpu")


class Written:
    """A parameter's version, data pointer and storage (weakly): anything that writes it in place
    bumps the version, and replacing its ``.data`` changes the storage, even where the new one
    lands at the old address (the weak reference keeps the old storage's identity taken)."""

    __slots__ = ("version", "data_ptr", "storage")

    def __init__(self, param: torch.Tensor) -> None:
        self.version, self.data_ptr = param._version, param.data_ptr()
        self.storage = StorageWeakRef(param.untyped_storage())

    def after_own_write(self, param: torch.Tensor) -> None:
        """lightmem wrote ``param`` in place (its copy back): the storage seen stays, the version moves."""
        if param.data_ptr() == self.data_ptr:
            self.version = param._version
        else:  # replaced since it was last seen (a write that broke overlap_step's contract)
            self.__init__(param)  # type: ignore[misc]

    def still(self, param: torch.Tensor) -> bool:
        storage = self.storage
        return (
            param._version == self.version
            and param.data_ptr() == self.data_ptr
            and not storage.expired()
            and storage.cdata == param.untyped_storage()._cdata
        )


@dataclass
class Slot:
    """One offloaded parameter: the device tensor, its host copy and its gradient buffers."""

    param: nn.Parameter
    master: nn.Parameter
    grad_buffer: torch.Tensor | None = None
    staging: torch.Tensor | None = None
    landing: str | None = None  # "direct" (into grad_buffer) or "staged" (to add) while a copy runs
    group: int = 0  # index of its param group
    overlapped: bool = False  # handed to the overlapped step since the last optimizer.step()
    seen: Written | None = None  # the device parameter as lightmem last wrote or read it


def optimized_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters ``optimizer`` steps, each once, in its param groups' order."""
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            seen.setdefault(id(param), param)
    return list(seen.values())


def take_device_grad(slot: Slot) -> None:
    """The gradient on ``slot``'s device parameter joins its host copy's, in its dtype (a bf16
    one widened exactly), added as autograd would."""
    grad, slot.param.grad = slot.param.grad, None
    if grad is None:
        return
    with torch.no_grad():
        if slot.master.grad is None:
            slot.master.grad = grad.to(_HOST, dtype=slot.master.dtype, copy=True)
        else:
            slot.master.grad.add_(grad.to(_HOST))


class HostCopies:
    """The slots of the parameters offloaded (by ``id`` of the device parameter: ``by_param``; of
    its host copy: ``by_master``) and the host arenas behind them; see the module docstring.

    ``holder`` answers ``host_grad(param)`` for the parameters offloaded here (``named_grads``).
    ``stats.host_param_bytes`` follows the arenas of host copies.
    """

    def __init__(
        self, transport: Transport, device: torch.device, stats: OptimizerOffloadStats, holder: host_grads.HostGrads
    ) -> None:
        self.transport = transport
        self.device = device
        self.by_param: dict[int, Slot] = {}
        self.by_master: dict[int, Slot] = {}  # the groups hold the masters
        self._stats = stats
        self._holder = holder
        self._param_arenas: list[HostArena] = []  # the parameters at the start, then each group added
        self._grads_arena: HostArena | None = None
        self._staging_arena: HostArena | None = None
        self._device_dtype_arenas: list[HostArena] = []  # narrow copies, wide gradients

    def slots(self) -> list[Slot]:
        return list(self.by_param.values())

    def add(self, params: list[nn.Parameter], group_of: dict[int, int]) -> list[Slot]:
        """A slot per parameter: its host copy carved from a new arena, with its value, in param
        group ``group_of[id(param)]``."""
        arena = HostArena(params, self.transport, self.device)
        self._param_arenas.append(arena)
        self._stats.host_param_bytes = self.param_bytes
        slots = []
        with torch.no_grad():
            for param, host in zip(params, arena.tensors):
                host.copy_(param.detach())
                master = nn.Parameter(host, requires_grad=param.requires_grad)
                slot = self.by_param[id(param)] = self.by_master[id(master)] = Slot(param, master, group=group_of[id(param)])
                slots.append(slot)
        host_grads.hold(params, self._holder)
        return slots

    def device_dtype(self, dtype: torch.dtype) -> DeviceDtype:
        """The device side in ``dtype`` (``device_dtype``) for every slot: the narrow copies that
        travel to the device (page-locked) and the masters' fp32 gradients (host only: nothing
        copies them)."""
        slots = self.slots()
        narrow = [torch.empty(slot.master.shape, dtype=dtype, device="meta") for slot in slots]
        self._device_dtype_arenas = [
            HostArena(narrow, self.transport, self.device),
            HostArena([slot.master for slot in slots], self.transport, self.device, page_locked=False),
        ]
        self._stats.host_param_bytes = self.param_bytes
        narrow_arena, wide_arena = self._device_dtype_arenas
        return DeviceDtype(slots, dtype, narrow_arena.tensors, wide_arena.tensors)

    def grad_buffer(self, slot: Slot, like: torch.Tensor, staging: bool) -> torch.Tensor:
        """``slot``'s host gradient (or accumulation staging) buffer, carved with every other
        parameter's from one arena the first time one is needed."""
        current = slot.staging if staging else slot.grad_buffer
        if current is not None and current.shape == like.shape and current.dtype == like.dtype:
            return current
        arena = self._staging_arena if staging else self._grads_arena
        if arena is None:
            # Shaped like the device parameters: the gradients come in their dtype.
            params = [other.param for other in self.by_param.values()]
            arena = HostArena(params, self.transport, self.device)
            for other, tensor in zip(self.by_param.values(), arena.tensors):
                if staging:
                    other.staging = tensor
                else:
                    other.grad_buffer = tensor
            if staging:
                self._staging_arena = arena
            else:
                self._grads_arena = arena
            current = slot.staging if staging else slot.grad_buffer
            if current.shape == like.shape and current.dtype == like.dtype:
                return current
        # A gradient unlike its parameter (another dtype): a buffer of its own.
        return torch.empty(like.shape, dtype=like.dtype, device=_HOST, pin_memory=self.transport.pin_memory)

    @property
    def first_arena_bytes(self) -> int:
        """Bytes of the host copies of the parameters offloaded at the start."""
        return self._param_arenas[0].nbytes

    @property
    def param_bytes(self) -> int:
        """Host bytes of the parameters' copies (with ``device_dtype``: and their narrow copies)."""
        narrow = self._device_dtype_arenas[0].nbytes if self._device_dtype_arenas else 0
        return sum(arena.nbytes for arena in self._param_arenas) + narrow

    def grad_bytes(self) -> int:
        """Host bytes of gradient buffers: the arenas, buffers of their own (a gradient unlike its
        parameter, a parameter of a group added later) and with ``device_dtype`` the wide gradients."""
        arenas = [arena for arena in (self._grads_arena, self._staging_arena) if arena is not None]
        carved = {id(tensor) for arena in arenas for tensor in arena.tensors}
        loose = sum(
            buffer.nbytes
            for slot in self.by_param.values()
            for buffer in (slot.grad_buffer, slot.staging)
            if buffer is not None and id(buffer) not in carved
        )
        return sum(arena.nbytes for arena in arenas) + loose + sum(arena.nbytes for arena in self._device_dtype_arenas[1:])

    def point(self) -> tuple[set[int], int]:
        """What is offloaded now, for ``forget_since``."""
        return set(self.by_param), len(self._param_arenas)

    def forget_since(self, point: tuple[set[int], int]) -> None:
        """Forget the parameters offloaded since ``point`` (their gradients back on the device) and
        give their arenas back."""
        slots, arenas = point
        with torch.no_grad():
            for key in set(self.by_param) - slots:
                slot = self.by_param.pop(key)
                del self.by_master[id(slot.master)]
                host_grads.release([slot.param])
                if slot.master.grad is not None:
                    slot.param.grad = slot.master.grad.to(slot.param.device, copy=True)
        for arena in self._param_arenas[arenas:]:
            arena.close()
        del self._param_arenas[arenas:]
        self._stats.host_param_bytes = self.param_bytes

    def release(self) -> None:
        """The device parameters keep their gradients in ``param.grad`` again (``named_grads``)."""
        host_grads.release(slot.param for slot in self.by_param.values())

    def close(self) -> None:
        """Give every arena back now (page-locked memory included), not when the last view dies."""
        arenas = [*self._param_arenas, self._grads_arena, self._staging_arena, *self._device_dtype_arenas]
        for arena in arenas:
            if arena is not None:
                arena.close()
