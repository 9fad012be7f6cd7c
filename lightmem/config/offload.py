"""The activation-offload flags (``LightMem``, ``offload_activations``, the estimator, the CLI),
parsed once into ``OffloadSettings``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import lightmem.config.units as units
from lightmem.config.spelling import OFFLOAD_ACTIVATIONS, Spelling
from lightmem.config.units import host_ram_share_bytes, parse_size
from lightmem.config.values import parse_devices, parse_patterns

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
                host_min_available, flag=flag("host_min_available"), fraction_of=units.total_ram_bytes,
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
