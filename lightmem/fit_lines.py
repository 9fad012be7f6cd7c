"""What a fit says: the lines at fit start (what is on and why each feature asked for is off, how
``plan="auto"`` plans, a host budget read in decimal units), the warning for code that reads
gradients optimizer offload moved, a plan's offload scope, a dry run's failure in a few words. The fit session (``lightmem.fit_session``) decides; these word it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightmem.config import (
    DECIMAL_UNITS_NOTE,
    LightMemSettings,
    OffloadSettings,
    decimal_reading,
    format_bytes,
)
from lightmem.metrics.names import key


def offload_off_reason(settings: OffloadSettings) -> str | None:
    """Why offload with these settings would gain nothing on this machine, or None."""
    if settings.devices == ("cuda",) and not torch.cuda.is_available():
        return "no CUDA device: moving CPU tensors to host memory gains nothing"
    return None


def offload_scope(offload: OffloadSettings | None) -> str:
    """A plan's offload scope in the log line: its modules, 'everywhere' (no include) or 'nothing'."""
    if offload is None:
        return "nothing"
    return "everywhere" if offload.include is None else str(offload.include_arg())


def dry_run_failure(error: BaseException) -> str:
    """An error of the dry run in a few words: its type and first line."""
    first = (str(error).strip().splitlines() or [""])[0][:300].rstrip(".")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def decimal_host_budget(settings: LightMemSettings) -> str | None:
    """A ``host_budget`` given in decimal units, as read (as ``plan="auto"`` reads back its
    ``device_budget``): "64 GB" is 59.60 GiB, not 64. None for any other."""
    offload = settings.offload
    reading = decimal_reading(offload.host_budget)
    return None if reading is None else f"lightmem: {offload.flag('host_budget')}: {reading}, {DECIMAL_UNITS_NOTE}"


def how_plans_are_made(auto_plan: Any, settings: LightMemSettings, allocator_note: str) -> list[str]:
    """``plan="auto"``'s lines at fit start: its budget, the allocator, the prices."""
    lines = []
    measured = auto_plan.budget_source
    if measured is not None:
        lines.append(f"lightmem: plan='auto' device budget, measured at fit start: {measured}")
    reading = settings.plan.device_budget_reading
    if reading is not None:
        lines.append(f"lightmem: plan='auto' device budget: {reading}, {DECIMAL_UNITS_NOTE}")
    if allocator_note:
        lines.append(allocator_note)
    if auto_plan.speeds is not None:
        lines.append(f"lightmem: plan='auto' prices steps at {auto_plan.speeds.describe()}")
    if auto_plan.peaks_reset:
        lines.append(
            "lightmem: measuring the device raised the allocator's peak statistics above anything before "
            "the fit: reset them (torch.cuda.reset_peak_memory_stats), so that the training batches' "
            "peaks can be measured against the plan"
        )
    return lines


def gradients_elsewhere(settings: LightMemSettings, readers: list[str]) -> str:
    """The warning for user code that reads gradients where optimizer offload leaves ``param.grad``
    None: ``readers`` name it (``model_state.trainer_optimizers.gradient_readers``)."""
    flag = settings.optimizer_offload.flag("enabled")  # type: ignore[union-attr]
    logged = "lightmem" in settings.metrics.groups
    norm = f"; their global norm is logged as {key('optimizer/grad_norm')}" if logged else ""
    runs = "runs" if len(readers) == 1 else "run"
    return (
        f"lightmem: {flag}: param.grad of the model's parameters is None between backward and the optimizer "
        f"step (the gradients are on the host), where {', '.join(readers)} {runs}: read them with "
        f"lightmem.named_grads(module), by the names grad_norm gives{norm}"
    )


def what_is_on(
    settings: LightMemSettings,
    device: torch.device,
    metrics_on: list[str],
    metrics_off: dict[str, str],
    *,
    planning: bool,
    offloader: Any,
    offload_settings: OffloadSettings,
    optimizer_offloaders: Sequence[Any],
    optimizer_offload_off: str | None,
    checkpointed: Sequence[str],
    tiling: Any,
) -> str:
    """One line: every feature that is on, why each one asked for is off, and, on a CPU, how to
    run the offloads there anyway. ``planning``: ``plan="auto"`` chooses at the first batch;
    ``offloader``: the activation offloader running (None: none); ``optimizer_offloaders``: the
    model-state offloaders running, or why none does; ``checkpointed``: the blocks checkpointed;
    ``tiling``: the tiling handle (None: nothing tiled)."""
    on, off = [], []
    on_the_cpu = []  # what offload_devices=["cpu"] would run here
    if planning:  # the plan's own line, at the first batch, says what it chose
        what = "what to checkpoint and tile" if settings.plan.tile else "what to checkpoint"
        if device.type == "cpu":
            what += "; on a CPU it never offloads"
        elif settings.offload_on:
            what += " and offload"
        on.append(f"plan='auto' (at the first training batch it chooses {what})")
    if offloader is not None:
        on.append(f"activation offload (tensors from {format_bytes(offloader.min_bytes)})")
    elif settings.offload_on and (reason := offload_off_reason(offload_settings)) is not None:
        off.append(f"activation offload ({reason})")
        if not planning and device.type == "cpu":
            on_the_cpu.append("activation offload")
    if optimizer_offloaders:
        notes = [
            (str(offloader.host_kernel), offloader.overlap_note, offloader.device_dtype_note)
            for offloader in optimizer_offloaders
        ]
        kernels = "; ".join("; ".join(note for note in each if note) for each in notes)
        on.append(f"optimizer offload (gradients, optimizer state and step on the host; {kernels})")
    elif optimizer_offload_off:
        off.append(f"optimizer offload ({optimizer_offload_off})")
        optimizer_offload = settings.optimizer_offload
        if device.type == "cpu" and optimizer_offload is not None and "cpu" not in optimizer_offload.devices:
            on_the_cpu.append("optimizer offload")
    blocks = len(checkpointed)
    if blocks:
        on.append(f"checkpointing {blocks} blocks ({', '.join(checkpointed[:3])}{', ...' if blocks > 3 else ''})")
    elif settings.checkpoint.targets is not None:
        off.append("checkpointing (see the warning above)")
    if tiling is not None:
        on.append(tiling.describe())
    if metrics_on:
        on.append(f"{', '.join(dict.fromkeys(metrics_on))} metrics")
    for reason in dict.fromkeys(metrics_off.values()):
        groups = [group for group, why in metrics_off.items() if why == reason]
        named = " and ".join(filter(None, [", ".join(groups[:-1]), groups[-1]]))
        off.append(f"{named} metrics ({reason})")
    line = f"lightmem: on: {'; '.join(on) or 'nothing'}." + (f" Off: {'; '.join(off)}." if off else "")
    if on_the_cpu:
        spelling = settings.offload.spelling
        them = "them" if len(on_the_cpu) > 1 else "it"
        line += (
            f" On this CPU, {spelling.entry}({spelling.name('devices')}=['cpu']) runs {' and '.join(on_the_cpu)} "
            f"anyway, with host-to-host copies that save no memory: to see {them} work."
        )
    return line
