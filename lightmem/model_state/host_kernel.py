"""Which implementation of the user's optimizer steps on the host, and why.

torch chooses ``foreach``/``fused`` by itself only for accelerator tensors: an optimizer
constructed as ``AdamW(params, lr=...)`` steps CPU tensors with its for-loop, which took 4-5x
the time of torch's fused CPU kernel (``benchmarks/optimizer_offload.py``, one thread of an AMD
EPYC VM; docs/optimizer-offload.md). So where the user left the implementation unchosen
(``foreach=None`` and ``fused=None``), the host step runs the fastest implementation measured on
CPU: torch's fused kernel where the optimizer has one (Adam, AdamW, SGD, Adagrad), ``foreach``
for RAdam (about 2x faster than its for-loop once it rectifies, from step 6), and the for-loop
for the rest (``foreach`` was slower or no faster: RMSprop, NAdam, Adamax, Adadelta, ASGD, Rprop,
Adafactor; ``benchmarks/optimizer_offload.py --others``). The choice is set on the param groups
and the defaults (``fused=True`` or ``foreach=True``), so the optimizer's own step, its
``state_dict`` and the placement of its ``step`` counters all follow. An explicit choice
(``foreach=...`` or ``fused=...``) is kept.

The implementations give other last bits than the for-loop; the result is bitwise that of the
same optimizer constructed with the flag set here, stepping without lightmem. ``restore()`` gives
the optimizer back the choice the user made (``None``), as it was constructed, and a ``state_dict``
taken while offloaded says ``None`` too (``in_state_dict``): lightmem's choice is never saved as
the user's, so a fit resumed from it is given back unset as well.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

FUSED = "fused"
FOREACH = "foreach"
FOR_LOOP = "for-loop"
CUSTOM = "custom"

# torch optimizers without a fused CPU kernel whose foreach step was faster than their for-loop on
# CPU (benchmarks/optimizer_offload.py --others): RAdam 2.1-2.5x.
_FOREACH_FASTER_ON_CPU = ("RAdam",)

_WHY = {
    FUSED: "lightmem's choice: foreach/fused were unset",
    FOREACH: "lightmem's choice: foreach/fused were unset, no fused CPU kernel, foreach faster on CPU",
}


def _steps_of(classes: list[type]) -> frozenset[Any]:
    return frozenset(inspect.unwrap(cls.step) for cls in classes)


@functools.cache
def _fused_cpu_steps() -> frozenset[Any]:
    """The step functions of torch's optimizers that take ``fused`` and run it on CPU tensors."""
    if "cpu" not in _get_fused_kernels_supported_devices():
        return frozenset()
    return _steps_of([
        value
        for value in vars(torch.optim).values()
        if isinstance(value, type)
        and issubclass(value, torch.optim.Optimizer)
        and "fused" in inspect.signature(value.__init__).parameters
    ])  # fmt: skip


@functools.cache
def _foreach_cpu_steps() -> frozenset[Any]:
    names = [name for name in _FOREACH_FASTER_ON_CPU if hasattr(torch.optim, name)]
    return _steps_of([getattr(torch.optim, name) for name in names])


def host_choice(optimizer: torch.optim.Optimizer) -> str | None:
    """The kernel lightmem runs ``optimizer``'s unset groups with: ``"fused"``, ``"foreach"``, or
    None (the for-loop, or a step that is not torch's: a subclass that overrides ``step`` may not
    honour the flags)."""
    step = inspect.unwrap(type(optimizer).step)
    if step in _fused_cpu_steps():
        return FUSED
    if step in _foreach_cpu_steps():
        return FOREACH
    return None


def _torch_step(optimizer: torch.optim.Optimizer) -> bool:
    return getattr(inspect.unwrap(type(optimizer).step), "__module__", "").startswith("torch.optim")


def _unset(group_or_defaults: dict[str, Any]) -> bool:
    return group_or_defaults.get("foreach") is None and group_or_defaults.get("fused") is None


def _eligible(group: dict[str, Any], kernel: str) -> bool:
    if group.get("differentiable") or not all(torch.is_floating_point(param) for param in group["params"]):
        return False
    # foreach with a tensor lr needs capturable=True in several optimizers: not worth the risk.
    return kernel == FUSED or not isinstance(group.get("lr"), torch.Tensor)


class HostKernel:
    """The implementation that runs ``optimizer``'s step on host tensors, per param group.

    ``select()`` sets every group that left the choice unset to the fastest implementation on CPU
    (``fused=True`` or ``foreach=True``; see the module docstring; the defaults are left alone), at
    offload start, for a group added while offloaded (``select(added=index)``), and after
    ``load_state_dict``, whose groups are the checkpoint's: a choice written there is kept.
    ``restore()`` puts ``None`` back in the groups it set (``name`` and ``str()`` go on naming what
    stepped). ``name`` is what runs (``"fused"``, ``"foreach"``, ``"for-loop"``, ``"custom"`` for
    a step not torch's, or the groups' kernels joined by ``"+"`` when they differ); ``str()`` adds
    why, for the line at fit start.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # id(group) -> (the group, the flag set to True here): by the group itself, which keeps it
        # through groups reordered (the group is held, so its id is not reused)
        self._switched: dict[int, tuple[dict[str, Any], str]] = {}
        self._ran: tuple[str, str] | None = None  # after restore(): (name, str) of what stepped

    def select(self, added: int | None = None) -> None:
        """Every group (``added``: only the group of that index, just added while offloaded)."""
        optimizer = self.optimizer
        if added is None:
            self._switched = {}  # after load_state_dict the groups are the checkpoint's, with its choice
        kernel = host_choice(optimizer)
        if kernel is None:
            return
        for index, group in enumerate(optimizer.param_groups):
            if added is not None and index != added:
                continue
            if _unset(group) and _eligible(group, kernel):
                group[kernel] = True
                self._switched[id(group)] = (group, kernel)
                for param in group["params"] if kernel == FUSED else ():
                    step = optimizer.state.get(param, {}).get("step")
                    if isinstance(step, torch.Tensor):  # fused kernels keep a float32 counter
                        optimizer.state[param]["step"] = step.to(torch.float32)

    def restore(self) -> None:
        self._ran = (self.name, str(self))
        for group, kernel in self._switched.values():
            group[kernel] = None
        self._switched = {}

    def in_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """A ``state_dict`` post-hook: the groups switched here say ``None`` in the saved state."""
        saved = state.get("param_groups", [])
        for index, group in enumerate(self.optimizer.param_groups):
            switched = self._switched.get(id(group))
            if switched is not None and index < len(saved):
                saved[index][switched[1]] = None
        return state

    def _kernels(self) -> list[tuple[str, str]]:
        """(kernel, why) for each param group, as the optimizer's step on host tensors runs it."""
        name = type(self.optimizer).__name__
        if not _torch_step(self.optimizer):  # a step of its own: what it runs is its business
            return [(CUSTOM, f"{name}'s own step, as constructed")] * len(self.optimizer.param_groups)
        choice = host_choice(self.optimizer)
        kernels = []
        for group in self.optimizer.param_groups:
            switched = self._switched.get(id(group))
            if switched is not None:
                kernels.append((switched[1], _WHY[switched[1]]))
            elif group.get("fused"):
                kernels.append((FUSED, "fused=True in its param groups"))
            elif group.get("foreach"):
                kernels.append((FOREACH, "foreach=True in its param groups"))
            elif not _unset(group):  # on CPU tensors torch runs the for-loop unless told otherwise
                chosen = "foreach=False" if group.get("foreach") is False else "fused=False"
                kernels.append((FOR_LOOP, f"{chosen} in its param groups"))
            elif choice is None:
                kernels.append((FOR_LOOP, f"{name} has no fused CPU kernel and foreach is not faster on CPU"))
            else:
                kernels.append((FOR_LOOP, f"{choice} is not used for differentiable or non-float parameters"))
        return kernels

    @property
    def name(self) -> str:
        if self._ran is not None:
            return self._ran[0]
        return "+".join(dict.fromkeys(kernel for kernel, _ in self._kernels()))

    def __str__(self) -> str:
        if self._ran is not None:
            return self._ran[1]
        kernels = self._kernels()
        unique = list(dict.fromkeys(kernels))
        step = f"{type(self.optimizer).__name__} step"
        if len(unique) == 1:
            kernel, why = unique[0]
            return f"{step}: {kernel}, {why}"
        parts = []
        for kernel, why in unique:
            groups = ", ".join(str(index) for index, each in enumerate(kernels) if each == (kernel, why))
            parts.append(f"{kernel} in group {groups}, {why}")
        return f"{step}: {'; '.join(parts)}"
