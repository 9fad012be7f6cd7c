"""Which implementation of the user's optimizer steps on the host, and why.

torch chooses ``foreach``/``fused`` by itself only for accelerator tensors: an optimizer
constructed as ``AdamW(params, lr=...)`` steps CPU tensors with its for-loop, which took 4-5x
the time of torch's fused CPU kernel (``benchmarks/optimizer_offload.py``, one thread of an AMD
EPYC VM; docs/optimizer-offload.md). So where the user left the implementation unchosen
(``foreach=None`` and ``fused=None``) and torch has a fused CPU kernel for the optimizer (Adam,
AdamW, SGD, Adagrad), the host step runs that kernel: ``fused=True`` is set on the param groups
and the defaults, so the optimizer's own step, its ``state_dict`` and the placement of its
``step`` counters all follow. An explicit choice (``foreach=...`` or ``fused=...``) is kept.
Where no fused kernel exists, the for-loop that torch runs on CPU tensors is kept too: ``foreach``
was slower than it on CPU for every such optimizer measured (RMSprop, NAdam, RAdam, Adamax,
Adadelta, ASGD, Rprop, Adafactor).

The fused kernel gives other last bits than the for-loop; the result is bitwise that of the same
optimizer constructed with ``fused=True`` stepping without lightmem. ``restore()`` gives the
optimizer back the choice the user made (``None``), as it was constructed.
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

_LIGHTMEMS_CHOICE = "lightmem's choice: foreach/fused were unset"


@functools.cache
def _fused_cpu_steps() -> frozenset[Any]:
    """The step functions of torch's optimizers that take ``fused`` and run it on CPU tensors."""
    if "cpu" not in _get_fused_kernels_supported_devices():
        return frozenset()
    classes = [
        value
        for value in vars(torch.optim).values()
        if isinstance(value, type)
        and issubclass(value, torch.optim.Optimizer)
        and "fused" in inspect.signature(value.__init__).parameters
    ]
    return frozenset(inspect.unwrap(cls.step) for cls in classes)


def has_fused_cpu_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps with one of torch's own steps that has a fused CPU kernel (a
    subclass that overrides ``step`` has not: its step may not honour ``fused``)."""
    return inspect.unwrap(type(optimizer).step) in _fused_cpu_steps()


def _torch_step(optimizer: torch.optim.Optimizer) -> bool:
    return getattr(inspect.unwrap(type(optimizer).step), "__module__", "").startswith("torch.optim")


def _unset(group_or_defaults: dict[str, Any]) -> bool:
    return group_or_defaults.get("foreach") is None and group_or_defaults.get("fused") is None


class HostKernel:
    """The implementation that runs ``optimizer``'s step on host tensors, per param group.

    ``select()`` switches every group that left the choice unset to ``fused=True`` where torch
    has a fused CPU kernel for the optimizer (at offload start, and after ``load_state_dict``,
    whose groups are the checkpoint's: a choice written there is kept); ``restore()`` puts
    ``None`` back in the groups it switched (``name`` and ``str()`` go on naming what stepped). ``name`` is what runs (``"fused"``, ``"foreach"``,
    ``"for-loop"``, ``"custom"`` for a step not torch's, or the groups' kernels joined by ``"+"``
    when they differ); ``str()`` adds why, for the line at fit start.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._switched: set[int] = set()  # indices of the groups set to fused=True here
        self._switched_defaults = False
        self._ran: tuple[str, str] | None = None  # after restore(): (name, str) of what stepped

    def select(self) -> None:
        optimizer = self.optimizer
        self._switched = set()  # after load_state_dict the groups are the checkpoint's, with its choice
        if not has_fused_cpu_kernel(optimizer):
            return
        for index, group in enumerate(optimizer.param_groups):
            if _unset(group) and self._fusable(group):
                group["fused"] = True
                self._switched.add(index)
                for param in group["params"]:
                    step = optimizer.state.get(param, {}).get("step")
                    if isinstance(step, torch.Tensor):  # fused kernels keep a float32 counter
                        optimizer.state[param]["step"] = step.to(torch.float32)
        if self._switched and _unset(optimizer.defaults):
            optimizer.defaults["fused"] = True  # param groups added later take the same kernel
            self._switched_defaults = True

    @staticmethod
    def _fusable(group: dict[str, Any]) -> bool:
        floating = all(torch.is_floating_point(param) for param in group["params"])
        return floating and not group.get("differentiable")

    def restore(self) -> None:
        self._ran = (self.name, str(self))
        groups = self.optimizer.param_groups
        for index in self._switched:
            if index < len(groups):
                groups[index]["fused"] = None
        if self._switched_defaults:
            self.optimizer.defaults["fused"] = None
        self._switched.clear()
        self._switched_defaults = False

    def _kernels(self) -> list[tuple[str, str]]:
        """(kernel, why) for each param group, as the optimizer's step on host tensors runs it."""
        name = type(self.optimizer).__name__
        fused_exists = has_fused_cpu_kernel(self.optimizer)
        if not _torch_step(self.optimizer):  # a step of its own: what it runs is its business
            return [(CUSTOM, f"{name}'s own step, as constructed")] * len(self.optimizer.param_groups)
        kernels = []
        for index, group in enumerate(self.optimizer.param_groups):
            if index in self._switched:
                kernels.append((FUSED, _LIGHTMEMS_CHOICE))
            elif group.get("fused"):
                kernels.append((FUSED, "fused=True in its param groups"))
            elif group.get("foreach"):
                kernels.append((FOREACH, "foreach=True in its param groups"))
            elif not _unset(group):  # on CPU tensors torch runs the for-loop unless told otherwise
                chosen = "foreach=False" if group.get("foreach") is False else "fused=False"
                kernels.append((FOR_LOOP, f"{chosen} in its param groups"))
            elif not fused_exists:
                kernels.append((FOR_LOOP, f"{name} has no fused CPU kernel and foreach is slower on CPU"))
            else:
                kernels.append((FOR_LOOP, "the fused kernel takes no differentiable or non-float parameters"))
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
