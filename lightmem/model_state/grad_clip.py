"""Gradient clipping the offloader applies itself, bitwise torch's ``clip_grad_norm_`` / ``clip_grad_value_``.

Two callers: ``offload_optimizer(clip_grad_norm=... | clip_grad_value=...)`` in a plain loop (the
offloader clips before each step, so the overlapped step knows the clipping ahead), and the
overlapped step under Lightning, which clips as ``gradient_clip_val`` asks while Lightning's own
call is taken as done (``lightmem.model_state.trainer_optimizers``).

By value, each gradient is clipped on its own: the overlapped step clamps it as it lands and steps it
at once. By norm, the step needs every gradient first, but the norm need not wait: each gradient's
norm is taken as it lands (``norms``), and once the last has landed the total of those norms
(``total``) scales them all (``scale``) and the step starts. ``clip_grad_norm_`` computes the
same per-tensor norms (on CPU, ``torch._foreach_norm`` is per tensor) and stacks them in the order
``total`` rebuilds, so the result is bitwise its own.

The same two functions (``tensor_norms``, ``total_norm``) give the gradient norm lightmem logs under
Lightning (``lightmem/memory/optimizer/grad_norm``), clipping or not: bitwise
``torch.nn.utils.get_total_norm``, which ``clip_grad_norm_`` calls. ``GradNorm`` holds it, once per
step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support


@dataclass(frozen=True)
class GradClip:
    """Clip by global norm (``clip_grad_norm_(params, value, norm_type)``) or by value
    (``clip_grad_value_(params, value)``) over an optimizer's parameters, before its step."""

    algorithm: str
    value: float
    norm_type: float = 2.0

    @classmethod
    def parse(cls, by_norm: float | None, by_value: float | None, flags: tuple[str, str]) -> GradClip | None:
        """From the two flags (at most one set); ``flags`` names them for the error.

        Raises:
            ValueError: both set, or one that is not a positive finite number.
        """
        if by_norm is not None and by_value is not None:
            raise ValueError(f"{flags[0]} and {flags[1]}: choose one way to clip; got both")
        for flag, value in zip(flags, (by_norm, by_value)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{flag}: expected a positive finite number (the largest norm or value); got {value!r}")
        if by_norm is not None:
            return cls("norm", float(by_norm))
        if by_value is not None:
            return cls("value", float(by_value))
        return None

    @classmethod
    def lightning(cls, clip_val: float | None, algorithm: Any) -> GradClip | None:
        """What Lightning's ``clip_gradients(optimizer, clip_val, gradient_clip_algorithm)`` (or the
        Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm``) clips: None for nothing."""
        if not clip_val or clip_val <= 0:
            return None
        name = getattr(algorithm, "value", algorithm) or "norm"  # GradClipAlgorithmType, str or None
        return cls(str(name).lower(), float(clip_val))

    @property
    def by_norm(self) -> bool:
        return self.algorithm == "norm"

    def __str__(self) -> str:
        return f"clipping by {self.algorithm} {self.value:g}"

    def clip(self, params: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """All at once, after backward: torch's own function. Returns the total norm (by norm)."""
        if self.by_norm:
            return torch.nn.utils.clip_grad_norm_(list(params), self.value, self.norm_type)
        torch.nn.utils.clip_grad_value_(list(params), self.value)
        return None

    def norms(self, grads: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each gradient's norm (keyed by ``id``), computed as ``clip_grad_norm_`` computes it."""
        return tensor_norms(grads, self.norm_type)

    def total(self, grads: list[torch.Tensor], norm_of: dict[int, torch.Tensor]) -> torch.Tensor:
        """The global norm of ``grads`` from their norms (``total_norm``)."""
        return total_norm(grads, norm_of, self.norm_type)

    def scale(self, params: list[torch.Tensor], total: torch.Tensor) -> None:
        """Scale every gradient of ``params`` by ``min(value / (total + 1e-6), 1)``, as ``clip_grad_norm_``."""
        torch.nn.utils.clip_grads_with_norm_(params, self.value, total)

    @functools.cached_property
    def writes(self) -> int:
        """How many in-place writes (version bumps) clipping makes to one gradient, measured once
        on a probe: what the overlapped step adds to the version it saw a gradient land with, so
        that any other write to it shows, even one racing the clipping."""
        probe = torch.nn.Parameter(torch.zeros(1, device="cpu"))
        probe.grad = torch.zeros(1, device="cpu")
        before = probe.grad._version
        if self.by_norm:
            self.scale([probe], torch.tensor(1.0, device="cpu"))
        else:
            self.clamp([probe])
        return probe.grad._version - before

    def clamp(self, params: list[torch.Tensor]) -> None:
        """By value: each gradient of ``params`` into ``[-value, value]``, as ``clip_grad_value_``."""
        if all(param.grad is None for param in params):
            return  # torch's grouping refuses an empty list
        torch.nn.utils.clip_grad_value_(params, self.value)



def tensor_norms(grads: list[torch.Tensor], norm_type: float = 2.0) -> dict[int, torch.Tensor]:
    """Each gradient's norm (keyed by ``id``), computed as ``torch.nn.utils.get_total_norm`` (and
    so ``clip_grad_norm_``) computes it: ``torch._foreach_norm`` per device and dtype where it runs,
    which on CPU is per tensor, so any split of ``grads`` gives the same bits."""
    result: dict[int, torch.Tensor] = {}
    if not grads:
        return result
    for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([grads]).items():
        if _has_foreach_support(group, device):
            group_norms = torch._foreach_norm(group, norm_type)
        else:
            group_norms = [torch.linalg.vector_norm(grad, norm_type) for grad in group]
        result.update(zip(map(id, group), group_norms))
    return result


def total_norm(grads: list[torch.Tensor], norm_of: dict[int, torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The global norm of ``grads`` (every gradient of the step, in the parameters' order) from
    their norms (``tensor_norms``): stacked in the order ``get_total_norm`` stacks them, so the
    result is its bits."""
    if not grads:
        return torch.tensor(0.0, device="cpu")  # get_total_norm's own answer: a host zero
    first_device = grads[0].device
    norms = [
        norm_of[id(grad)]
        for (_, _), ([group], _) in _group_tensors_by_device_and_dtype([grads]).items()
        for grad in group
    ]
    return torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), norm_type)


class GradNorm:
    """The global 2-norm of one optimizer step's gradients, taken at most once per step: before
    anything clips them, by the step itself, by clipping by norm, or as they land in an overlapped
    step."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.step = 0
        """The step (counted from 1, as ``stats.steps``) ``value`` was taken for."""
        self.wanted: Callable[[], bool] = lambda: False
        """Whether the step now running takes the gradients' global norm (under Lightning: the steps
        whose metrics are read); clipping by norm takes it every step anyway."""

    def took(self, norm: torch.Tensor | None, step: int) -> None:
        self.value, self.step = norm, step

    def take(self, grads: list[torch.Tensor], step: int) -> None:
        """Bitwise ``torch.nn.utils.get_total_norm(grads)`` (the parameters' order)."""
        self.took(total_norm(grads, tensor_norms(grads)), step)
