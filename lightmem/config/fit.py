"""The callback's own flag groups (metrics, host guard, ``plan="auto"``) and ``LightMemSettings``:
every ``LightMem`` flag parsed once into one settings object per concern, with the rules between
concerns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from lightmem.config.checkpointing import CheckpointSettings
from lightmem.config.offload import OffloadSettings
from lightmem.config.optimizer_offload import OptimizerOffloadSettings
from lightmem.config.spelling import LIGHTMEM, Spelling, reject_without_partner
from lightmem.config.tiling import TileSettings
from lightmem.config.units import decimal_reading, parse_fraction, parse_host_limit, parse_size
from lightmem.config.values import parse_bool, parse_choices, parse_count, parse_device_dtype, parse_path


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
    tile: bool = False
    """The plans may run position-wise modules in sequence shards (``LightMem(tile=True)``, or a
    list of modules tiled as given): exact within 1e-6, not bitwise, so only when asked."""

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
        if tile is not None and tile is not False:  # the plans may tile too (True: the plans alone)
            if tile is True and not plan.auto:
                reject_without_partner(LIGHTMEM, "tile", f"{LIGHTMEM.entry}(plan='auto')", "name the modules to tile")
            plan = replace(plan, tile=True)
        if isinstance(tile, bool):
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
