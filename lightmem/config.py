"""Parsing and validation of user-facing configuration values.

Every size in lightmem ("512KiB", "2GB", 1_048_576, 0.25 of RAM) is parsed here and nowhere else,
and every bad value fails with a message that names the flag and what it accepts.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import psutil

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")

SIZE_HELP = "a byte count (int), or a string such as '512KiB', '64MiB', '2GB', '1.5GiB'"


def available_ram_bytes() -> int:
    """Bytes the OS can hand out right now without swapping (psutil's ``available``)."""
    return int(psutil.virtual_memory().available)


def total_ram_bytes() -> int:
    return int(psutil.virtual_memory().total)


def ranks_per_node_from_env() -> int:
    """Processes on this node as torchrun announces it (``LOCAL_WORLD_SIZE``); 1 when unset."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def host_ram_share_bytes(ranks_per_node: int | None = None) -> int:
    """This process's share of the node's available RAM: what a fractional ``host_budget`` is taken of.

    The ranks of a node share its RAM, so ``host_budget=0.5`` on 8 ranks gives each rank 1/16 of
    the available RAM, not half of it. ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE``; the
    Lightning callback passes the Trainer's devices per node.
    """
    ranks = ranks_per_node if ranks_per_node is not None else ranks_per_node_from_env()
    return available_ram_bytes() // max(1, ranks)


def parse_size(
    value: int | float | str,
    *,
    flag: str,
    fraction_of: Callable[[], int] | None = None,
    fraction_name: str = "available RAM",
) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an int (bytes), a string with a decimal (KB, MB, GB, TB) or binary (KiB, MiB, GiB, TiB)
    unit, and, when ``fraction_of`` is given, a float in (0, 1] or a percentage string ("25%") taken
    of ``fraction_of()``.

    Raises:
        ValueError: naming ``flag`` and the accepted forms when ``value`` is none of those.
    """
    accepted = SIZE_HELP + (
        f", or a fraction of {fraction_name} (a float in (0, 1] or a string like '25%')"
        if fraction_of is not None
        else ""
    )
    if isinstance(value, bool):
        raise ValueError(f"{flag}: expected {accepted}; got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{flag}: a size cannot be negative; got {value!r}")
        return value
    if isinstance(value, float):
        if fraction_of is not None and 0.0 < value <= 1.0:
            return int(value * fraction_of())
        raise ValueError(f"{flag}: expected {accepted}; got {value!r}")
    if isinstance(value, str):
        percent = _PERCENT_RE.match(value)
        if percent is not None and fraction_of is not None:
            fraction = float(percent.group(1)) / 100.0
            if 0.0 < fraction <= 1.0:
                return int(fraction * fraction_of())
        match = _SIZE_RE.match(value)
        if match is not None:
            unit = match.group(2).lower()
            if unit in _UNITS:
                number = float(match.group(1))
                if math.isfinite(number):
                    return int(number * _UNITS[unit])
    raise ValueError(f"{flag}: expected {accepted}; got {value!r}")


def parse_fraction(value: float, *, flag: str, allow_none: bool = False) -> float | None:
    """Validate a fraction in (0, 1] (e.g. a share of a memory limit); None where ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value <= 1.0:
        return float(value)
    accepted = "a fraction in (0, 1], e.g. 0.9" + (", or None" if allow_none else "")
    raise ValueError(f"{flag}: expected {accepted}; got {value!r}")


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


def parse_host_limit(value: int | float | str, *, flag: str) -> int | None:
    """``"auto"`` (None: the cgroup limit or total RAM, read when training starts), or a size."""
    if value == "auto":
        return None
    try:
        return parse_size(value, flag=flag, fraction_of=total_ram_bytes, fraction_name="total RAM")
    except ValueError as error:
        message = str(error).replace("expected ", "expected 'auto' (cgroup limit or total RAM), ", 1)
        raise ValueError(message) from None


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    sign = "-" if num_bytes < 0 else ""
    size = float(abs(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024.0 or unit == "TiB":
            return f"{sign}{size:.0f} {unit}" if unit == "B" else f"{sign}{size:.2f} {unit}"
        size /= 1024.0
    raise AssertionError("unreachable")


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


DEFAULT_MIN_BYTES = "1MiB"
DEFAULT_HOST_BUDGET = 0.5
DEFAULT_PREFETCH = "256MiB"
DEFAULT_MAX_INFLIGHT = "256MiB"
DEFAULT_HOST_MIN_AVAILABLE = 0.10

# How each entry point spells the offload flags (the settings' field names are offload_activations').
_OFFLOAD_FLAG_NAMES = {
    "LightMem": {
        "min_bytes": "offload_min_bytes",
        "devices": "offload_devices",
        "include": "offload_include",
        "exclude": "offload_exclude",
        "prefetch": "prefetch_bytes",
        "max_inflight_bytes": "offload_max_inflight_bytes",
    },
}


@dataclass(frozen=True)
class OffloadSettings:
    """The offload flags, parsed and validated once; ``LightMem``, ``offload_activations``, the
    estimator (``estimate_memory(offload=...)``) and ``Plan.offload`` all read this object instead of
    re-parsing flags.

    ``owner`` is the entry point the user called (``"offload_activations"`` or ``"LightMem"``): error
    messages raised later (a pattern matching no module) name the flag as the user spelled it.
    """

    min_bytes: int
    devices: tuple[str, ...]
    include: tuple[str, ...] | None
    exclude: tuple[str, ...] | None
    host_budget: int | float | str | None
    """As given: a fraction is taken of this node's available RAM, shared by its ranks."""
    host_budget_bytes: int | None
    """None only in the estimator: no cap (the target machine's host is not this one)."""
    prefetch_bytes: int
    host_min_available_bytes: int
    max_inflight_bytes: int = 256 << 20
    owner: str = "offload_activations"

    @classmethod
    def parse(
        cls,
        *,
        min_bytes: int | str = DEFAULT_MIN_BYTES,
        devices: Iterable[str] | str = ("cuda",),
        include: Iterable[str] | str | None = None,
        exclude: Iterable[str] | str | None = None,
        host_budget: int | float | str | None = DEFAULT_HOST_BUDGET,
        prefetch: int | str = DEFAULT_PREFETCH,
        max_inflight_bytes: int | str = DEFAULT_MAX_INFLIGHT,
        host_min_available: int | float | str = DEFAULT_HOST_MIN_AVAILABLE,
        owner: str = "offload_activations",
        ranks_per_node: int | None = None,
    ) -> OffloadSettings:
        """Validate every flag; ``ValueError`` names the first bad one as ``owner`` spells it."""

        def flag(field: str) -> str:
            return offload_flag(owner, field)

        if host_budget is None:
            host_budget = DEFAULT_HOST_BUDGET
        return cls(
            min_bytes=parse_size(min_bytes, flag=flag("min_bytes")),
            devices=parse_devices(devices, flag=flag("devices")),
            include=parse_patterns(include, flag=flag("include")),
            exclude=parse_patterns(exclude, flag=flag("exclude")),
            host_budget=host_budget,
            host_budget_bytes=parse_size(
                host_budget, flag=flag("host_budget"),
                fraction_of=lambda: host_ram_share_bytes(ranks_per_node),
            ),
            prefetch_bytes=parse_size(prefetch, flag=flag("prefetch")),
            max_inflight_bytes=parse_size(max_inflight_bytes, flag=flag("max_inflight_bytes")),
            host_min_available_bytes=parse_size(
                host_min_available, flag=flag("host_min_available"), fraction_of=total_ram_bytes,
                fraction_name="total RAM",
            ),  # fmt: skip
            owner=owner,
        )

    def flag(self, field: str) -> str:
        """How the user spelled the flag behind ``field``: ``LightMem(offload_include=...)``."""
        return offload_flag(self.owner, field)

    def for_ranks_per_node(self, ranks_per_node: int) -> OffloadSettings:
        """The same settings with a fractional ``host_budget`` shared by ``ranks_per_node`` ranks."""
        if self.host_budget is None:
            return self
        budget = parse_size(
            self.host_budget, flag=self.flag("host_budget"),
            fraction_of=lambda: host_ram_share_bytes(ranks_per_node),
        )
        return replace(self, host_budget_bytes=budget)

    def to_dict(self) -> dict[str, Any]:
        """The estimator's view, JSON-ready, keyed as ``offload_activations``' arguments."""
        return {
            "min_bytes": self.min_bytes,
            "include": list(self.include) if self.include is not None else None,
            "exclude": list(self.exclude) if self.exclude is not None else None,
            "prefetch": self.prefetch_bytes,
            "host_budget": self.host_budget_bytes,
        }

    def with_choice(self, *, min_bytes: int, include: tuple[str, ...] | None) -> OffloadSettings:
        """The same settings with a planner's threshold and modules."""
        return replace(self, min_bytes=min_bytes, include=include)


def offload_flag(owner: str, field: str) -> str:
    return f"{owner}({_OFFLOAD_FLAG_NAMES.get(owner, {}).get(field, field)}=...)"


DEFAULT_GRAD_INFLIGHT = "64MiB"

# How each entry point spells the optimizer-offload flags (field names are offload_optimizer's).
_OPTIMIZER_FLAG_NAMES = {
    "LightMem": {
        "enabled": "offload_optimizer",
        "devices": "offload_devices",
        "max_grad_inflight_bytes": "offload_max_inflight_bytes",
    },
}


@dataclass(frozen=True)
class OptimizerOffloadSettings:
    """The model-state offload flags, parsed once; ``LightMem(offload_optimizer=True)`` and
    ``offload_optimizer(model, optimizer, ...)`` both build the offloader from this object, and its
    ``flag()`` names a flag as the user's entry point (``owner``) spells it."""

    devices: tuple[str, ...]
    """Device types whose parameters get host-side gradients and optimizer steps."""
    max_grad_inflight_bytes: int
    """Most gradient bytes kept on the device while their copy to host runs."""
    owner: str = "offload_optimizer"

    @classmethod
    def parse(
        cls,
        *,
        devices: Iterable[str] | str = ("cuda",),
        max_grad_inflight_bytes: int | str = DEFAULT_GRAD_INFLIGHT,
        owner: str = "offload_optimizer",
    ) -> OptimizerOffloadSettings:
        def flag(field: str) -> str:
            return optimizer_offload_flag(owner, field)

        return cls(
            devices=parse_devices(devices, flag=flag("devices")),
            max_grad_inflight_bytes=parse_size(max_grad_inflight_bytes, flag=flag("max_grad_inflight_bytes")),
            owner=owner,
        )

    def flag(self, field: str) -> str:
        """How the user spelled the flag behind ``field``: ``LightMem(offload_optimizer=...)``."""
        return optimizer_offload_flag(self.owner, field)


def optimizer_offload_flag(owner: str, field: str) -> str:
    if owner == "offload_optimizer" and field == "enabled":
        return "offload_optimizer"  # the function itself is the option
    return f"{owner}({_OPTIMIZER_FLAG_NAMES.get(owner, {}).get(field, field)}=...)"


_warned: set[str] = set()


def warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with ``message`` once per process: lightmem says a thing once, not every step."""
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, category, stacklevel=3)
