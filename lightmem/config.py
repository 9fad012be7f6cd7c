"""Parsing and validation of user-facing configuration values, and the settings they make.

Every size in lightmem ("512KiB", "2GB", 1_048_576, 0.25 of RAM) is parsed here and nowhere else,
and every bad value fails with a message that names the flag and what it accepts. Each flag is
parsed once into one frozen settings object per concern (``OffloadSettings``,
``CheckpointSettings``, ``TileSettings``, ``OptimizerOffloadSettings``, ``MetricsSettings``,
``HostGuardSettings``, ``PlanSettings``; the callback's in ``LightMemSettings``), which the
callback, the functions, the estimator/planner and the CLI all read. A settings object carries its entry point's
``Spelling``, so an error names the flag as the user typed it.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import psutil
import torch
from torch.nn import Module

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


# -- how each entry point spells its flags -----------------------------------------------------


@dataclass(frozen=True)
class Spelling:
    """How one entry point spells its flags, so that an error raised deep inside (a pattern that
    matches no module, found at the first batch) names the flag the user typed, with no rewrite.

    Every settings object below carries one. ``names`` maps a settings field to the entry point's
    own name for it (absent: the field's name; ``""``: the entry point itself, a function whose
    call is the switch); ``style`` is how a flag is written:
    ``"call"``: ``LightMem(offload_min_bytes=...)``, ``"key"``: ``estimate_memory(offload=...)['min_bytes']``,
    ``"cli"``: ``--offload-min-bytes``.
    """

    entry: str
    names: tuple[tuple[str, str], ...] = ()
    style: str = "call"

    def name(self, field: str) -> str:
        """The bare name: ``checkpoint_policy``, ``--checkpoint-policy``."""
        name = dict(self.names).get(field, field)
        return f"--{name}" if self.style == "cli" else name

    def flag(self, field: str) -> str:
        name = dict(self.names).get(field, field)
        if name == "":  # the entry point is itself the switch: offload_optimizer(model, optimizer)
            return self.entry
        if self.style == "cli":
            return f"--{name}"
        if self.style == "key":
            return f"{self.entry}['{name}']"
        return f"{self.entry}({name}=...)"


LIGHTMEM = Spelling("LightMem", (
    ("min_bytes", "offload_min_bytes"), ("devices", "offload_devices"), ("include", "offload_include"),
    ("exclude", "offload_exclude"), ("prefetch", "prefetch_bytes"), ("max_inflight_bytes", "offload_max_inflight_bytes"),
    ("targets", "checkpoint"), ("every_n", "checkpoint_every"), ("policy", "checkpoint_policy"),
    ("groups", "metrics"), ("limit", "host_limit"), ("warn_at", "host_warn_at"), ("stop_at", "host_stop_at"),
    ("stop_checkpoint", "host_stop_checkpoint"), ("enabled", "offload_optimizer"),
    ("max_grad_inflight_bytes", "offload_max_inflight_bytes"), ("overlap_step", "offload_overlap_step"),
    ("device_dtype", "offload_optimizer_device_dtype"), ("modules", "tile"),
))  # fmt: skip
"""``LightMem``'s keyword arguments."""
OFFLOAD_ACTIVATIONS = Spelling("offload_activations")
APPLY_CHECKPOINTING = Spelling("apply_checkpointing")
APPLY_TILING = Spelling("apply_tiling", (("modules", "targets"),))
OFFLOAD_OPTIMIZER = Spelling("offload_optimizer", (("enabled", ""),))
"""``offload_optimizer(model, optimizer, ...)``: the function is the switch."""
CLI = Spelling("lightmem estimate", (
    ("min_bytes", "offload-min-bytes"), ("include", "offload-include"), ("exclude", "offload-exclude"),
    ("targets", "checkpoint"), ("policy", "checkpoint-policy"),
    ("enabled", "offload-optimizer"), ("device_dtype", "offload-optimizer-device-dtype"),
    ("link_bytes_per_s", "link-bytes-per-s"),
), style="cli")  # fmt: skip
"""The ``lightmem estimate`` command's options."""


def reject_without_partner(spelling: Spelling, field: str, partner: str, what: str) -> None:
    """A flag that does nothing without its partner is an error that names both: ``partner`` as
    the user writes it, ``what`` the way to give it."""
    raise ValueError(
        f"{spelling.flag(field)}: has no effect without {partner}; {what} or leave {spelling.name(field)} unset"
    )


# -- offload ------------------------------------------------------------------------------------

DEFAULT_MIN_BYTES = "1MiB"
DEFAULT_HOST_BUDGET = 0.5
DEFAULT_PREFETCH = "256MiB"
DEFAULT_MAX_INFLIGHT = "256MiB"
DEFAULT_HOST_MIN_AVAILABLE = 0.10


@dataclass(frozen=True)
class OffloadSettings:
    """The offload flags, parsed and validated once; ``LightMem``, ``offload_activations``, the
    estimator (``estimate_memory(offload=...)``), the planner, ``Plan.offload`` and the CLI all
    read this object instead of re-parsing flags.

    ``spelling`` is the entry point the user called: error messages raised later (a pattern
    matching no module) name the flag as the user spelled it.
    """

    min_bytes: int
    devices: tuple[str, ...]
    include: tuple[str, ...] | None
    exclude: tuple[str, ...] | None
    host_budget: int | float | str | None
    """As given: a fraction is taken of this node's available RAM, shared by its ranks."""
    host_budget_bytes: int | None
    """None only in the estimator without a ``host_budget``: the target machine's host is not this one."""
    prefetch_bytes: int
    host_min_available_bytes: int
    max_inflight_bytes: int = 256 << 20
    spelling: Spelling = OFFLOAD_ACTIVATIONS
    include_min_bytes: tuple[int, ...] | None = None
    """Per ``include`` pattern, the size a saved tensor needs to move while that module runs (a
    plan's partial offload: a block's largest tensors only); None: ``min_bytes`` everywhere."""

    @classmethod
    def parse(
        cls,
        *,
        min_bytes: int | str = DEFAULT_MIN_BYTES,
        devices: Iterable[str] | str = ("cuda",),
        include: Iterable[str] | Mapping[str, int | str] | str | None = None,
        exclude: Iterable[str] | str | None = None,
        host_budget: int | float | str | None = DEFAULT_HOST_BUDGET,
        prefetch: int | str = DEFAULT_PREFETCH,
        max_inflight_bytes: int | str = DEFAULT_MAX_INFLIGHT,
        host_min_available: int | float | str = DEFAULT_HOST_MIN_AVAILABLE,
        spelling: Spelling = OFFLOAD_ACTIVATIONS,
        ranks_per_node: int | None = None,
    ) -> OffloadSettings:
        """Validate every flag; ``ValueError`` names the first bad one as ``spelling`` spells it."""
        flag = spelling.flag
        if host_budget is None:
            host_budget = DEFAULT_HOST_BUDGET
        include_min_bytes = None
        if isinstance(include, Mapping):  # {pattern: min_bytes}: each module its own threshold
            include_min_bytes = tuple(parse_size(size, flag=f"{flag('include')}[{pattern!r}]") for pattern, size in include.items())
            include = list(include)
        included = parse_patterns(include, flag=flag("include"))
        if included == ():
            raise ValueError(
                f"{flag('include')}: an empty list offloads nothing; leave it unset (None) to offload "
                "in every module, or name the modules to offload in"
            )
        return cls(
            min_bytes=parse_size(min_bytes, flag=flag("min_bytes")),
            devices=parse_devices(devices, flag=flag("devices")),
            include=included,
            exclude=parse_patterns(exclude, flag=flag("exclude")) or None,
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
            spelling=spelling,
            include_min_bytes=include_min_bytes,
        )

    @classmethod
    def for_estimate(
        cls, *, host_budget: int | str | None = None, spelling: Spelling, **flags: Any
    ) -> OffloadSettings:
        """The engine's settings with the engine's defaults, for a machine that is not this one:
        no host cap unless ``host_budget`` (bytes) is given, no floor on this host's free RAM."""
        settings = cls.parse(spelling=spelling, **flags)
        budget_bytes = None if host_budget is None else parse_size(host_budget, flag=spelling.flag("host_budget"))
        return replace(settings, host_budget=host_budget, host_budget_bytes=budget_bytes, host_min_available_bytes=0)

    def flag(self, field: str) -> str:
        """How the user spelled the flag behind ``field``: ``LightMem(offload_include=...)``."""
        return self.spelling.flag(field)

    def for_ranks_per_node(self, ranks_per_node: int) -> OffloadSettings:
        """The same settings with a fractional ``host_budget`` shared by ``ranks_per_node`` ranks."""
        if self.host_budget is None:
            return self
        budget = parse_size(
            self.host_budget, flag=self.flag("host_budget"),
            fraction_of=lambda: host_ram_share_bytes(ranks_per_node),
        )
        return replace(self, host_budget_bytes=budget)

    def include_arg(self) -> list[str] | dict[str, int] | None:
        """``include`` as ``offload_activations`` and ``LightMem(offload_include=...)`` take it:
        the patterns, or {pattern: min_bytes} when modules have thresholds of their own."""
        if self.include is None:
            return None
        if self.include_min_bytes is None:
            return list(self.include)
        return dict(zip(self.include, self.include_min_bytes))

    def to_dict(self) -> dict[str, Any]:
        """The estimator's view, JSON-ready, keyed as ``offload_activations``' arguments."""
        return {
            "min_bytes": self.min_bytes,
            "include": self.include_arg(),
            "exclude": list(self.exclude) if self.exclude is not None else None,
            "prefetch": self.prefetch_bytes,
            "max_inflight_bytes": self.max_inflight_bytes,
            "host_budget": self.host_budget_bytes,
        }

    def with_choice(
        self, *, min_bytes: int, include: tuple[str, ...] | None, include_min_bytes: tuple[int, ...] | None = None
    ) -> OffloadSettings:
        """The same settings with a planner's threshold and modules (each with its own threshold
        when ``include_min_bytes`` is given)."""
        return replace(self, min_bytes=min_bytes, include=include, include_min_bytes=include_min_bytes)


# -- optimizer (model-state) offload ------------------------------------------------------------

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


# -- checkpoint ---------------------------------------------------------------------------------

CHECKPOINT_POLICIES = ("full", "save_matmuls")
POLICY_HELP = (
    "'full' (recompute the whole block), 'save_matmuls' (keep matmul, convolution and attention "
    "outputs, recompute the rest), or a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy or bool"
)


def parse_checkpoint_policy(policy: Any, *, flag: str) -> Any:
    """Validate a checkpoint policy; returns it unchanged ("full", "save_matmuls" or the callable).

    Raises:
        ValueError: naming ``flag`` and the accepted values, for any other string or object, or a
            callable that cannot take ``(ctx, op, *args, **kwargs)``.
    """
    if isinstance(policy, str):
        if policy in CHECKPOINT_POLICIES:
            return policy
        raise ValueError(f"{flag}: expected {POLICY_HELP}; got {policy!r}")
    if not callable(policy) or isinstance(policy, type):
        raise ValueError(f"{flag}: expected {POLICY_HELP}; got {policy!r}")
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # some builtins have none: accepted, checked when called
        return policy
    try:
        signature.bind(None, None)
    except TypeError:
        raise ValueError(
            f"{flag}: a callable policy is called as policy(ctx, op, *args, **kwargs); "
            f"{getattr(policy, '__name__', policy)!r} has the signature {signature}"
        ) from None
    return policy


def parse_checkpoint_targets(targets: Any, *, flag: str) -> tuple[Any, ...]:
    """Blocks to checkpoint: class names, ``nn.Module`` classes or module-name globs; a bare name or
    class is one target. An empty list is an error: it would checkpoint nothing."""
    return parse_module_targets(targets, flag=flag, empty="checkpoints nothing")


def parse_module_targets(targets: Any, *, flag: str, empty: str) -> tuple[Any, ...]:
    """Modules an action applies to (``checkpoint=``, ``tile=``): class names, ``nn.Module`` classes
    or module-name globs; a bare name or class is one target. An empty list is an error that says
    what it would do (``empty``: "checkpoints nothing")."""
    if isinstance(targets, (str, type)):
        targets = [targets]
    try:
        result = tuple(targets)
    except TypeError:
        raise ValueError(f"{flag}: expected a list of module names, classes or glob patterns; got {targets!r}") from None
    if not result:
        raise ValueError(
            f"{flag}: expected at least one class name, class or module-name pattern; an empty list {empty}"
        )
    for target in result:
        if target == "":
            raise ValueError(f"{flag}: every pattern must be a non-empty string; got ''")
        if not isinstance(target, str) and not (isinstance(target, type) and issubclass(target, Module)):
            raise ValueError(f"{flag}: expected module names, nn.Module classes or glob patterns; got {target!r}")
    return result


@dataclass(frozen=True)
class CheckpointSettings:
    """Which blocks to checkpoint and what they keep, parsed once (``LightMem``, the estimator, the CLI)."""

    targets: tuple[Any, ...] | None
    """None: checkpoint nothing (``plan="auto"`` may still choose blocks, with ``policy``)."""
    every_n: int = 1
    policy: Any = "full"
    spelling: Spelling = APPLY_CHECKPOINTING
    policy_given: bool = False
    """The user named the policy (else ``plan="auto"`` chooses between "full" and "save_matmuls")."""

    @classmethod
    def parse(
        cls, targets: Any = None, every_n: int | None = None, policy: Any = None, *,
        spelling: Spelling = APPLY_CHECKPOINTING, planned: bool = False, planners: tuple[str, ...] = ("plan",),
    ) -> CheckpointSettings:  # fmt: skip
        """``every_n`` and ``policy`` need ``targets`` (``policy`` also serves a plan: ``planned``;
        ``planners`` names the fields that plan, for the error without any of them)."""
        flag = spelling.flag
        settings = cls(
            targets=None if targets is None else parse_checkpoint_targets(targets, flag=flag("targets")),
            every_n=1 if every_n is None else parse_count(every_n, flag=flag("every_n")),  # type: ignore[arg-type]
            policy="full" if policy is None else parse_checkpoint_policy(policy, flag=flag("policy")),
            spelling=spelling,
            policy_given=policy is not None,
        )
        if targets is None:
            if every_n is not None:
                reject_without_partner(spelling, "every_n", flag("targets"), "name the blocks to checkpoint")
            if policy is not None and not planned:
                *first, last = [flag(name) for name in ("targets", *planners)]
                partner = f"{', '.join(first)} or {last}"
                reject_without_partner(spelling, "policy", partner, "name the blocks to checkpoint")
        return settings

    def flag(self, field: str) -> str:
        return self.spelling.flag(field)


# -- sequence tiling ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TileSettings:
    """Which position-wise modules run in sequence shards, and how long a shard is, parsed once
    (``apply_tiling``, ``LightMem(tile=...)``, ``estimate_memory(tile=...)``); ``lightmem.tiling``
    turns a sequence length into shards (``shard_lengths``)."""

    modules: tuple[Any, ...]
    tile_tokens: int | None = None
    """Positions per shard (the last shard may be shorter); None with ``shards`` None: as many as
    the module's input is wide (``lightmem.tiling.shard_lengths``)."""
    shards: int | None = None
    """Split the sequence into this many shards of nearly equal length instead."""
    spelling: Spelling = APPLY_TILING

    @classmethod
    def parse(
        cls, modules: Any = None, *, tile_tokens: int | None = None, shards: int | None = None,
        spelling: Spelling = APPLY_TILING,
    ) -> TileSettings | None:  # fmt: skip
        """None when ``modules`` is None (nothing tiled); ``tile_tokens`` and ``shards`` need it, and
        exclude each other."""
        flag = spelling.flag
        tokens = parse_count(tile_tokens, flag=flag("tile_tokens"), allow_none=True)
        count = parse_count(shards, flag=flag("shards"), allow_none=True)
        if modules is None:
            for field, value in (("tile_tokens", tokens), ("shards", count)):
                if value is not None:
                    reject_without_partner(spelling, field, flag("modules"), "name the modules to tile")
            return None
        if tokens is not None and count is not None:
            raise ValueError(
                f"{flag('shards')}: give either {spelling.name('tile_tokens')} (positions per shard) or "
                f"{spelling.name('shards')} (shards per sequence), not both"
            )
        targets = parse_module_targets(modules, flag=flag("modules"), empty="tiles nothing")
        return cls(modules=targets, tile_tokens=tokens, shards=count, spelling=spelling)

    def flag(self, field: str) -> str:
        return self.spelling.flag(field)


# -- metrics, host guard, plan ------------------------------------------------------------------


@dataclass(frozen=True)
class MetricsSettings:
    """What the callback logs and where: probe groups, interval, TensorBoard panels, OOM snapshot."""

    groups: tuple[str, ...]
    log_every_n_steps: int | None
    tensorboard_panels: bool
    oom_snapshot: str | None

    @classmethod
    def parse(
        cls, *, groups: Iterable[str] | str, accepted: Iterable[str], log_every_n_steps: int | None,
        tensorboard_panels: bool, oom_snapshot: str | None, spelling: Spelling = LIGHTMEM,
    ) -> MetricsSettings:  # fmt: skip
        flag = spelling.flag
        return cls(
            groups=parse_choices(groups, flag=flag("groups"), accepted=accepted, what="probe group"),
            log_every_n_steps=parse_count(log_every_n_steps, flag=flag("log_every_n_steps"), allow_none=True),
            tensorboard_panels=parse_bool(tensorboard_panels, flag=flag("tensorboard_panels")),
            oom_snapshot=parse_path(oom_snapshot, flag=flag("oom_snapshot")),
        )


@dataclass(frozen=True)
class HostGuardSettings:
    """The host memory guard: the limit it watches, where it warns, where it stops and saves."""

    limit_bytes: int | None
    """None: ``"auto"``, the cgroup limit or total RAM, read when training starts."""
    warn_at: float
    stop_at: float | None
    stop_checkpoint: str | None

    @classmethod
    def parse(
        cls, *, limit: int | float | str = "auto", warn_at: float = 0.85, stop_at: float | None = 0.95,
        stop_checkpoint: str | None = None, spelling: Spelling = LIGHTMEM,
    ) -> HostGuardSettings:  # fmt: skip
        flag = spelling.flag
        warn = parse_fraction(warn_at, flag=flag("warn_at"))
        stop = parse_fraction(stop_at, flag=flag("stop_at"), allow_none=True)
        if stop is not None and stop < warn:  # type: ignore[operator]
            raise ValueError(f"{flag('stop_at')}: must be >= {spelling.name('warn_at')} ({warn_at}); got {stop_at!r}")
        if stop is None and stop_checkpoint is not None:
            raise ValueError(
                f"{flag('stop_checkpoint')}: has no effect while {spelling.name('stop_at')} is None (the guard "
                f"only warns, nothing is saved); set {spelling.name('stop_at')} or leave {spelling.name('stop_checkpoint')} unset"
            )
        return cls(
            limit_bytes=parse_host_limit(limit, flag=flag("limit")),
            warn_at=warn,  # type: ignore[arg-type]
            stop_at=stop,
            stop_checkpoint=parse_path(stop_checkpoint, flag=flag("stop_checkpoint")),
        )


@dataclass(frozen=True)
class PlanSettings:
    """``plan="auto"``: plan from the training batches, for ``device_budget`` or (None) for what the
    training device can give this process, measured at fit start (``lightmem.device_memory``)."""

    auto: bool
    device_budget_bytes: int | None
    spelling: Spelling = LIGHTMEM
    device_budget_reading: str | None = None
    """A ``device_budget`` given in decimal units, as read (``decimal_reading``): said at fit start."""
    tile: bool = True
    """The plans may run position-wise modules in sequence shards (``LightMem(tile=False)``: never)."""

    @classmethod
    def parse(
        cls, *, plan: str | None, device_budget: int | str | None, spelling: Spelling = LIGHTMEM
    ) -> PlanSettings:
        flag = spelling.flag
        if plan not in (None, "auto"):
            raise ValueError(f"{flag('plan')}: expected None or 'auto'; got {plan!r}")
        budget = None if device_budget is None else parse_size(device_budget, flag=flag("device_budget"))
        if plan is None and budget is not None:
            reject_without_partner(spelling, "device_budget", f"{spelling.entry}(plan='auto')", "set plan='auto'")
        return cls(
            auto=plan == "auto", device_budget_bytes=budget, spelling=spelling,
            device_budget_reading=decimal_reading(device_budget),
        )  # fmt: skip

    def flag(self, field: str) -> str:
        return self.spelling.flag(field)


@dataclass(frozen=True)
class PlanPrices:
    """Prices given instead of the device's own: a matrix throughput for every dtype and the host
    link speed per second, each way (``plan(flops_per_s=..., link_bytes_per_s=...)``,
    ``--link-bytes-per-s``); None: the device's (``lightmem.devices``)."""

    flops_per_s: float | None
    link_bytes_per_s: int | None

    @classmethod
    def parse(
        cls, *, flops_per_s: float | None, link_bytes_per_s: int | str | None, spelling: Spelling
    ) -> PlanPrices:
        """Validate both; ``ValueError`` names the flag as ``spelling`` spells it."""
        flag = spelling.flag
        link = None
        if link_bytes_per_s is not None:
            link = parse_size(link_bytes_per_s, flag=flag("link_bytes_per_s"))
            if link <= 0:
                raise ValueError(f"{flag('link_bytes_per_s')}: must be positive; got {link_bytes_per_s!r}")
        if flops_per_s is not None and (isinstance(flops_per_s, bool) or not float(flops_per_s) > 0):
            raise ValueError(f"{flag('flops_per_s')}: must be positive; got {flops_per_s!r}")
        return cls(flops_per_s=None if flops_per_s is None else float(flops_per_s), link_bytes_per_s=link)


@dataclass(frozen=True)
class LightMemSettings:
    """Every ``LightMem`` flag, parsed once into one settings object per concern.

    ``parse`` takes ``LightMem``'s keyword arguments; a flag is added by adding it there and to
    its concern's settings. The rules between concerns (``plan="auto"`` chooses the blocks
    itself) live here.
    """

    offload_on: bool
    offload: OffloadSettings
    checkpoint: CheckpointSettings
    metrics: MetricsSettings
    host_guard: HostGuardSettings
    plan: PlanSettings
    optimizer_offload: OptimizerOffloadSettings | None = None
    """None: ``offload_optimizer=False``."""
    chunked_loss: bool = False
    """``chunked_loss``: the Hugging Face causal LMs' own loss through ``lightmem.linear_cross_entropy``."""
    tile: TileSettings | None = None
    """``tile`` and ``tile_tokens``; None: nothing tiled."""

    @classmethod
    def parse(cls, *, metric_groups: tuple[str, ...], **flags: Any) -> LightMemSettings:
        """``flags``: ``LightMem``'s keyword arguments, every one given; ``metric_groups``: the
        probe groups ``metrics`` accepts."""
        flag = LIGHTMEM.flag
        plan = PlanSettings.parse(plan=flags["plan"], device_budget=flags["device_budget"])
        tile = flags["tile"]
        if tile is False:  # nothing tiled, not even by a plan
            plan = replace(plan, tile=False)
            tile = None
        if plan.auto and (flags["checkpoint"] is not None or flags["offload_include"] is not None):
            raise ValueError(f"{flag('plan')}: 'auto' chooses checkpoint and offload_include itself; leave them unset")
        offload = OffloadSettings.parse(
            min_bytes=flags["offload_min_bytes"], devices=flags["offload_devices"],
            include=flags["offload_include"], exclude=flags["offload_exclude"], host_budget=flags["host_budget"],
            prefetch=flags["prefetch_bytes"], max_inflight_bytes=flags["offload_max_inflight_bytes"],
            host_min_available=flags["host_min_available"], spelling=LIGHTMEM,
        )  # fmt: skip
        optimizer_offload = None
        overlap_step = flags["offload_overlap_step"]
        if overlap_step != "auto" and not isinstance(overlap_step, bool):
            raise ValueError(f"{flag('overlap_step')}: expected True, False or 'auto'; got {overlap_step!r}")
        device_dtype = parse_device_dtype(flags["offload_optimizer_device_dtype"], flag=flag("device_dtype"))
        if parse_bool(flags["offload_optimizer"], flag=flag("enabled")):
            # offload_devices and offload_max_inflight_bytes serve both offloads: parsed once, above
            optimizer_offload = OptimizerOffloadSettings(
                offload.devices, offload.max_inflight_bytes, LIGHTMEM, overlap_step=overlap_step,
                device_dtype=device_dtype,
            )  # fmt: skip
            optimizer_offload.refuse_overlap_with_device_dtype()
        elif overlap_step is True:
            reject_without_partner(LIGHTMEM, "overlap_step", flag("enabled"), "pass offload_optimizer=True")
        elif device_dtype is not None:
            reject_without_partner(LIGHTMEM, "device_dtype", flag("enabled"), "pass offload_optimizer=True")
        return cls(
            offload_on=parse_bool(flags["offload"], flag=flag("offload")),
            offload=offload,
            checkpoint=CheckpointSettings.parse(
                flags["checkpoint"], flags["checkpoint_every"], flags["checkpoint_policy"], spelling=LIGHTMEM,
                planned=plan.auto,
            ),
            metrics=MetricsSettings.parse(
                groups=flags["metrics"], accepted=metric_groups, log_every_n_steps=flags["log_every_n_steps"],
                tensorboard_panels=flags["tensorboard_panels"], oom_snapshot=flags["oom_snapshot"],
            ),
            host_guard=HostGuardSettings.parse(
                limit=flags["host_limit"], warn_at=flags["host_warn_at"], stop_at=flags["host_stop_at"],
                stop_checkpoint=flags["host_stop_checkpoint"],
            ),
            plan=plan,
            optimizer_offload=optimizer_offload,
            chunked_loss=parse_bool(flags["chunked_loss"], flag=flag("chunked_loss")),
            tile=TileSettings.parse(tile, tile_tokens=flags["tile_tokens"], spelling=LIGHTMEM),
        )  # fmt: skip


_warned: set[str] = set()


def warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with ``message`` once per process: lightmem says a thing once, not every step."""
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, category, stacklevel=3)
