"""Sizes, as users write them and as lightmem says them: one parser, one formatter.

Every size in lightmem ("512KiB", "2GB", 1_048_576, 0.25 of RAM) is parsed by ``parse_size`` and
nowhere else, and every bad value fails with a message that names the flag and what it accepts.
What a fraction of RAM is taken of (this node's available RAM, shared by its ranks, or the total)
is read here too.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable

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


_DECIMAL_UNITS = {"k", "kb", "m", "mb", "g", "gb", "t", "tb"}


DECIMAL_UNITS_NOTE = "in decimal units (kB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: of 1024)"
"""What follows a ``decimal_reading`` said at fit start."""


def decimal_reading(value: int | float | str | None) -> str | None:
    """How ``parse_size`` read a size string in decimal units (powers of 1000):
    ``"2 GB"`` -> ``"2 GB = 2,000,000,000 bytes (1.86 GiB)"``. None for any other value (binary
    units, byte counts and fractions mean what they say), or one ``parse_size`` refuses."""
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _DECIMAL_UNITS:
        return None
    try:
        size = parse_size(value, flag="")
    except ValueError:
        return None
    return f"{value.strip()} = {size:,} bytes ({format_bytes(size)})"


def parse_fraction(value: float, *, flag: str, allow_none: bool = False) -> float | None:
    """Validate a fraction in (0, 1] (e.g. a share of a memory limit); None where ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value <= 1.0:
        return float(value)
    accepted = "a fraction in (0, 1], e.g. 0.9" + (", or None" if allow_none else "")
    raise ValueError(f"{flag}: expected {accepted}; got {value!r}")


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
