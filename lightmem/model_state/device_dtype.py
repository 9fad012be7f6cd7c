"""bf16 parameters on the device, fp32 masters and the step on the host (``device_dtype``).

ZeRO-Offload's scheme, opt-in (``offload_optimizer(..., device_dtype=torch.bfloat16)``,
``LightMem(offload_optimizer_device_dtype="bf16")``): the optimizer steps fp32 host copies of the
parameters ("masters"), and the device keeps the parameters in bf16 only, so each step moves half
the bytes to the device and the device holds half the bytes of weights. Gradients come out of
backward in bf16 (the forward runs under autocast, ``precision="bf16-mixed"``), travel in bf16 and
are widened to fp32 on the host, where accumulation, clipping and the step run in fp32. After each
step the masters are rounded to bf16 on the host (round to nearest even, as autocast's cast of an
fp32 weight rounds) into a page-locked bf16 arena, which is what travels to the device.

It is not bitwise equal to training without lightmem, so it is never on by default. What the user
keeps: ``model.state_dict()`` holds the fp32 masters (a checkpoint resumes in fp32 without
lightmem), ``model.load_state_dict`` of an fp32 checkpoint sets the masters exactly, and
``close()`` gives the parameters back in fp32, from the masters.

``HostCopies`` owns the arenas and ``ParamsBack`` the copies (their CUDA ordering rules are
unchanged); this module holds what the scheme adds: the refusals, the cast, widening, rounding and
the state-dict hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from lightmem.config import OptimizerOffloadSettings, device_dtype_name


class _Slot(Protocol):
    param: nn.Parameter
    master: nn.Parameter


def refuse_device_dtype(params: list[nn.Parameter], settings: OptimizerOffloadSettings, reducer: Any) -> None:
    """Before anything changed: the cases the scheme cannot serve, each with the flag named."""
    flag = settings.flag("device_dtype")
    if reducer is not None:
        raise ValueError(
            f"{flag}: not under DDP (its buckets are built for the parameters' dtype and would "
            "average bf16 gradients); leave it unset"
        )
    for param in params:
        if param.dtype != torch.float32:
            raise ValueError(
                f"{flag}: keeps fp32 master weights on the host for fp32 parameters; a parameter of "
                f"shape {list(param.shape)} is {param.dtype} (precision='bf16-true' or a model cast "
                "to half precision): keep the parameters fp32 (precision='bf16-mixed') or leave it unset"
            )


def refuse_precision(trainer: Any, settings: OptimizerOffloadSettings) -> None:
    """Under Lightning the forward must run under bf16 autocast: only ``bf16-mixed`` does that
    with fp32 parameters (``settings.refuse_precision``, the estimator's rule too)."""
    settings.refuse_precision(str(getattr(trainer.precision_plugin, "precision", "")))


class DeviceDtype:
    """The device side in ``dtype`` for ``slots`` whose masters are fp32 host tensors.

    ``narrow``: one page-locked ``dtype`` host tensor per slot, the source of its copy to the
    device; ``wide_grads``: one fp32 host tensor per slot, the master's gradient.
    """

    def __init__(
        self,
        slots: list[_Slot],
        dtype: torch.dtype,
        narrow: list[torch.Tensor],
        wide_grads: list[torch.Tensor],
    ) -> None:
        self.dtype = dtype
        self.name = device_dtype_name(dtype)
        self._narrow = {id(slot.param): tensor for slot, tensor in zip(slots, narrow)}
        self._wide = {id(slot.param): tensor for slot, tensor in zip(slots, wide_grads)}
        self._slots = slots
        self._loaded: dict[int, torch.Tensor] | None = None  # during a load: the checkpoint's values

    @property
    def note(self) -> str:
        """For the line at fit start."""
        return f"{self.name} parameters on the device, fp32 masters on the host"

    def cast_device_params(self) -> None:
        """Round the device parameters to ``dtype`` in place (``param.data``: the Parameter objects,
        their hooks and every reference to them stay); a gradient already there follows."""
        with torch.no_grad():
            for slot in self._slots:
                param, grad = slot.param, slot.param.grad
                param.grad = None
                param.data = param.data.to(self.dtype)
                if grad is not None:
                    param.grad = grad.to(self.dtype)

    def widened(self, slot: _Slot, landed: torch.Tensor) -> torch.Tensor:
        """The master's fp32 gradient: ``landed`` (the gradient as it came, in ``dtype``) widened."""
        wide = self._wide[id(slot.param)]
        wide.copy_(landed)
        return wide

    def rounded(self, slot: _Slot) -> torch.Tensor:
        """The master rounded to ``dtype`` into its page-locked tensor: the source of the copy to
        the device. The caller has host-waited the previous copies from it."""
        narrow = self._narrow[id(slot.param)]
        narrow.copy_(slot.master.detach())
        return narrow

    def give_back(self) -> None:
        """``close()``: the device parameters in the masters' dtype and values, exactly."""
        with torch.no_grad():
            for slot in self._slots:
                slot.param.grad = None
                slot.param.data = slot.master.detach().to(slot.param.device, copy=True)

    # -- the state dict: fp32 masters in, fp32 masters out ------------------------------------

    def _keys(self, model: nn.Module, prefix: str) -> Iterable[tuple[str, _Slot]]:
        by_param = {id(slot.param): slot for slot in self._slots}
        for name, param in model.named_parameters(remove_duplicate=False):
            slot = by_param.get(id(param))
            if slot is not None:
                yield prefix + name, slot

    def put_masters(self, model: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
        """``model.state_dict()`` post-hook: the fp32 masters stand where the bf16 device values were
        (detached unless ``keep_vars``, aliasing the live masters as a state dict aliases parameters)."""
        for key, slot in self._keys(model, prefix):
            if key in state_dict:
                keep_vars = isinstance(state_dict[key], nn.Parameter)
                state_dict[key] = slot.master if keep_vars else slot.master.detach()

    def take_loaded(self, model: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """``model.load_state_dict`` pre-hook: remember the checkpoint's values for the masters."""
        self._loaded = {
            id(slot.param): state_dict[key] for key, slot in self._keys(model, prefix) if key in state_dict
        }

    def refresh_masters(self) -> None:
        """After ``model.load_state_dict``: the masters the checkpoint names take its values exactly,
        the others (``strict=False``) keep theirs. Called outside a load (the user wrote the device
        parameters): every master takes its device parameter's value, widened."""
        loaded, self._loaded = self._loaded, None
        with torch.no_grad():
            for slot in self._slots:
                if loaded is None:
                    slot.master.copy_(slot.param.detach())
                elif id(slot.param) in loaded:
                    slot.master.copy_(loaded[id(slot.param)].detach())
