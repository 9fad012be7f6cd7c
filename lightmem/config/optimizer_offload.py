"""The model-state offload flags (``LightMem(offload_optimizer=True)``, ``offload_optimizer``, the
estimator's ``offload_optimizer=``, ``--offload-optimizer``), parsed once into ``OptimizerOffloadSettings``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightmem.config.spelling import OFFLOAD_OPTIMIZER, Spelling
from lightmem.config.units import parse_size
from lightmem.config.values import device_dtype_name, parse_bool, parse_device_dtype, parse_devices

DEFAULT_GRAD_INFLIGHT = "64MiB"


@dataclass(frozen=True)
class OptimizerOffloadSettings:
    """The model-state offload flags, parsed once: ``LightMem(offload_optimizer=True)``,
    ``offload_optimizer(model, optimizer, ...)``, the estimator and planner
    (``estimate_memory(offload_optimizer=...)``) and ``--offload-optimizer`` all read this object.
    ``flag("enabled")`` names the switch as the user's entry point spells it."""

    devices: tuple[str, ...]
    """Device types whose parameters get host-side gradients and optimizer steps."""
    max_grad_inflight_bytes: int
    """Most gradient bytes kept on the device while their copy to host runs."""
    spelling: Spelling = OFFLOAD_OPTIMIZER
    overlap_step: bool | str = False
    """Step each parameter on the host as soon as its gradient is final, while backward runs: the
    caller promises that nothing changes gradients or param groups between backward and the step.
    ``"auto"`` (``LightMem`` only): wherever the fit shows it is safe (``offload_trainer_optimizers``)."""
    device_dtype: torch.dtype | None = None
    """None: the device parameters keep their dtype (exact). ``torch.bfloat16``: fp32 master weights
    and the step on the host, bf16 parameters on the device (half the bytes per step; not exact)."""

    @classmethod
    def parse(
        cls,
        *,
        devices: Iterable[str] | str = ("cuda",),
        max_grad_inflight_bytes: int | str = DEFAULT_GRAD_INFLIGHT,
        overlap_step: bool = False,
        device_dtype: Any = None,
        spelling: Spelling = OFFLOAD_OPTIMIZER,
    ) -> OptimizerOffloadSettings:
        flag = spelling.flag
        settings = cls(
            devices=parse_devices(devices, flag=flag("devices")),
            max_grad_inflight_bytes=parse_size(max_grad_inflight_bytes, flag=flag("max_grad_inflight_bytes")),
            spelling=spelling,
            overlap_step=parse_bool(overlap_step, flag=flag("overlap_step")),
            device_dtype=parse_device_dtype(device_dtype, flag=flag("device_dtype")),
        )
        settings.refuse_overlap_with_device_dtype()
        return settings

    def refuse_overlap_with_device_dtype(self) -> None:
        """The overlapped step lands gradients in the parameters' dtype; with ``device_dtype`` they
        are widened to the fp32 masters after backward, so the two do not combine."""
        if self.device_dtype is not None and self.overlap_step is True:
            raise ValueError(
                f"{self.flag('overlap_step')}: not with {self.flag('device_dtype')} (bf16 gradients are "
                "widened into the fp32 masters after backward); leave one of them off"
            )

    def flag(self, field: str) -> str:
        """How the user spelled the flag behind ``field``: ``LightMem(offload_optimizer=...)``."""
        return self.spelling.flag(field)

    @property
    def device_dtype_name(self) -> str | None:
        """``device_dtype`` as reports and ``LightMem`` spell it ("bf16"); None when unset."""
        return None if self.device_dtype is None else device_dtype_name(self.device_dtype)

    def refuse_precision(self, precision: str) -> None:
        """With ``device_dtype`` the forward must run under bf16 autocast on fp32 parameters: only
        ``bf16-mixed`` does that (``32-true`` would feed fp32 activations to bf16 weights, the
        ``-true`` half precisions have no fp32 parameters to keep as masters). The rule of a
        Lightning fit and of the estimator's step alike."""
        if self.device_dtype is not None and precision != "bf16-mixed":
            raise ValueError(
                f"{self.flag('device_dtype')}: needs precision='bf16-mixed' (the forward runs under "
                f"bf16 autocast on bf16 parameters); got precision={precision!r}"
            )


def parse_optimizer_offload(
    value: bool | OptimizerOffloadSettings, *, spelling: Spelling
) -> OptimizerOffloadSettings | None:
    """An ``offload_optimizer=`` argument of the estimator's functions: True (the defaults), False
    (None: off) or settings already parsed (the callback's, for ``plan="auto"``)."""
    if isinstance(value, OptimizerOffloadSettings):
        return value
    if not parse_bool(value, flag=spelling.flag("enabled")):
        return None
    return OptimizerOffloadSettings.parse(spelling=spelling)
