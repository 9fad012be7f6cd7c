"""Plain flag values: switches, counts, choices, paths, device types, module patterns, a device
dtype; and ``warn_once``, how lightmem says a thing once per process."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch


def parse_bool(value: bool, *, flag: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{flag}: expected True or False; got {value!r}")
    return value


def parse_count(value: int | None, *, flag: str, allow_none: bool = False) -> int | None:
    """Validate an integer >= 1 (a step interval, every n-th block); None where ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag}: expected an integer >= 1{' or None' if allow_none else ''}; got {value!r}")
    return value


DEVICE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, torch.bfloat16: torch.bfloat16}
"""What ``device_dtype`` accepts: the parameters' dtype on the device under model-state offload."""


def parse_device_dtype(value: Any, *, flag: str) -> torch.dtype | None:
    """None (the parameters keep their dtype) or bf16 (``"bf16"``, ``"bfloat16"``, ``torch.bfloat16``)."""
    if value is None:
        return None
    try:
        return DEVICE_DTYPES[value]
    except (KeyError, TypeError):
        raise ValueError(f"{flag}: expected None, 'bf16' or torch.bfloat16; got {value!r}") from None


def device_dtype_name(dtype: torch.dtype) -> str:
    """How lightmem spells a device dtype in reports and keyword arguments: "bf16"."""
    return {torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


def parse_choices(
    values: Iterable[str] | str, *, flag: str, accepted: Iterable[str], what: str
) -> tuple[str, ...]:
    """Validate a list of names from ``accepted``; a bare string is one name. ``what`` names one."""
    accepted = tuple(accepted)
    try:
        result = (values,) if isinstance(values, str) else tuple(values)
    except TypeError:
        raise ValueError(
            f"{flag}: expected a list of {what}s from {', '.join(accepted)}; got {values!r}"
        ) from None
    unknown = [value for value in result if value not in accepted]
    if unknown:
        raise ValueError(f"{flag}: unknown {what} {unknown[0]!r}; accepted: {', '.join(accepted)}")
    return result


def parse_path(value: str | None, *, flag: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{flag}: expected a file path or None; got {value!r}")
    return value


def parse_devices(devices: Iterable[str] | str, *, flag: str) -> tuple[str, ...]:
    """Validate a collection of device type names such as ("cuda",) or ("cpu",)."""
    if isinstance(devices, str):
        devices = (devices,)
    try:
        result = tuple(devices)
    except TypeError:
        raise ValueError(f"{flag}: expected a tuple of device types such as ('cuda',); got {devices!r}") from None
    known = {"cpu", "cuda", "xpu", "mps", "hpu", "privateuseone", "meta"}
    for device in result:
        if not isinstance(device, str) or device not in known:
            raise ValueError(
                f"{flag}: unknown device type {device!r}; accepted: {', '.join(sorted(known))}"
            )
    if not result:
        raise ValueError(f"{flag}: needs at least one device type, e.g. ('cuda',)")
    return result


def parse_patterns(patterns: Iterable[str] | str | None, *, flag: str) -> tuple[str, ...] | None:
    """Validate a list of module-name patterns; a bare string is one pattern."""
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    try:
        result = tuple(patterns)
    except TypeError:
        raise ValueError(f"{flag}: expected a list of module-name patterns; got {patterns!r}") from None
    for pattern in result:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{flag}: every pattern must be a non-empty string; got {pattern!r}")
    return result


_warned: set[str] = set()


def warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with ``message`` once per process: lightmem says a thing once, not every step."""
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, category, stacklevel=3)
