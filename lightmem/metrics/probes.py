"""Cheap memory probes, one per group. None synchronises the GPU.

A probe that cannot run here (no CUDA, NVML missing or failing) raises ``ProbeUnavailable`` at
construction with a one-line reason; the callback switches that group off and says so once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import psutil
import torch

from lightmem.metrics.names import GiB, key
from lightmem.offload.stats import OffloadStats
from lightmem.transfer import page_lock


class ProbeUnavailable(RuntimeError):
    """The probe cannot run on this machine; the message says why, in one line."""


class TorchAllocatorProbe:
    """PyTorch's caching allocator: ``torch.cuda.memory_stats`` (a host-side read, no sync).

    The allocator keeps one peak per device, the one ``torch.cuda.max_memory_allocated`` returns.
    By default lightmem resets it only where measuring the GPU for ``plan="auto"`` raised it at fit
    start, so a user's own peak readings stay true; the logged
    ``step_peak_allocated`` is then the peak since the process started (or since the user's
    last reset). With ``reset_peak=True`` lightmem resets it after each logged step and the
    metric is the peak of that step alone, at the cost of the user's ``max_memory_allocated``.
    """

    group = "gpu"

    def __init__(self, device: torch.device, reset_peak: bool = False) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ProbeUnavailable("the training device is not a CUDA device")
        self.device = device
        self.reset_peak = reset_peak

    def collect(self) -> dict[str, float]:
        stats = torch.cuda.memory_stats(self.device)
        return {
            key("gpu/allocated_GiB"): stats.get("allocated_bytes.all.current", 0) / GiB,
            key("gpu/reserved_GiB"): stats.get("reserved_bytes.all.current", 0) / GiB,
            key("gpu/step_peak_allocated_GiB"): stats.get("allocated_bytes.all.peak", 0) / GiB,
            key("gpu/inactive_split_GiB"): stats.get("inactive_split_bytes.all.current", 0) / GiB,
            key("gpu/alloc_retries"): float(stats.get("num_alloc_retries", 0)),
            key("gpu/ooms"): float(stats.get("num_ooms", 0)),
        }

    def end_step(self) -> None:
        if self.reset_peak:
            torch.cuda.reset_peak_memory_stats(self.device)


class NvmlProbe:
    """The driver's view of the device through NVML (``pynvml`` from nvidia-ml-py).

    The NVML device is found by the UUID CUDA reports for the training device, never by index:
    CUDA's index is relative to ``CUDA_VISIBLE_DEVICES`` (which may list UUIDs, in any order)
    while NVML numbers every GPU of the machine, and a MIG instance has no NVML index at all.
    """

    group = "device"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ProbeUnavailable("the training device is not a CUDA device")
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            self._handle = nvml_handle_by_uuid(pynvml, uuid)
            self._memory_info = pynvml.nvmlDeviceGetMemoryInfo
            self._memory_info(self._handle)
        except ProbeUnavailable:
            raise
        except Exception as error:  # depends on the driver
            raise ProbeUnavailable(f"NVML is not usable ({type(error).__name__}: {error})") from None

    def collect(self) -> dict[str, float]:
        info = self._memory_info(self._handle)
        return {key("device/used_GiB"): info.used / GiB, key("device/total_GiB"): info.total / GiB}

    def end_step(self) -> None:
        return None


def nvml_handle_by_uuid(pynvml: Any, uuid: str) -> Any:
    """The NVML handle of the GPU or MIG instance whose UUID CUDA reports as ``uuid``.

    CUDA gives the bare UUID; NVML names a full GPU ``GPU-<uuid>`` and a MIG instance
    ``MIG-<uuid>``. Both are tried directly, then every GPU and MIG instance NVML lists is
    compared by UUID (drivers that reject a MIG UUID in ``nvmlDeviceGetHandleByUUID``).

    Raises:
        ProbeUnavailable: no device NVML knows has that UUID.
    """
    bare = uuid.lower().removeprefix("gpu-").removeprefix("mig-")
    for name in (f"GPU-{bare}", f"MIG-{bare}"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except pynvml.NVMLError:
            pass
    for gpu in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        candidates = [handle]
        try:
            for mig in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    candidates.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig))
                except pynvml.NVMLError:
                    pass  # an empty MIG slot
        except pynvml.NVMLError:
            pass  # MIG not supported on this GPU
        for candidate in candidates:
            if _bare_uuid(pynvml.nvmlDeviceGetUUID(candidate)) == bare:
                return candidate
    raise ProbeUnavailable(f"NVML lists no GPU or MIG instance with the UUID {bare} that CUDA reports")


def _bare_uuid(name: str | bytes) -> str:
    if isinstance(name, bytes):
        name = name.decode()
    return name.lower().removeprefix("gpu-").removeprefix("mig-")


class HostProbe:
    """This process and this machine through psutil, plus the host buffers lightmem holds
    (``pool_bytes``; None when offload is off: no such buffers, no such metric) and the time
    page-locking them took since the last reading (``lightmem.transfer.page_lock``)."""

    group = "host"

    def __init__(
        self, pool_bytes: Callable[[], int] | None, pool_in_use_bytes: Callable[[], int] = lambda: 0
    ) -> None:
        self._process = psutil.Process()
        self._pool_bytes = pool_bytes
        self._pool_in_use_bytes = pool_in_use_bytes
        self._page_lock_s = 0.0  # the process's totals at the last reading
        self._page_lock_wait_s = 0.0

    def collect(self) -> dict[str, float]:
        values = {
            key("host/rss_GiB"): self._process.memory_info().rss / GiB,
            key("host/available_GiB"): psutil.virtual_memory().available / GiB,
            key("host/swap_used_GiB"): psutil.swap_memory().used / GiB,
        }
        if self._pool_bytes is not None:
            values[key("host/pinned_GiB")] = self._pool_bytes() / GiB
            values[key("host/pinned_in_use_GiB")] = self._pool_in_use_bytes() / GiB
            registration = page_lock.registration_stats()
            total_s = registration.registration_s + registration.prefault_s
            values[key("host/page_lock_ms")] = (total_s - self._page_lock_s) * 1e3
            values[key("host/page_lock_wait_ms")] = (registration.blocked_s - self._page_lock_wait_s) * 1e3
            self._page_lock_s, self._page_lock_wait_s = total_s, registration.blocked_s
        return values

    def end_step(self) -> None:
        return None


class OptimizerOffloadProbe:
    """Model-state offload: host bytes held now and the last optimizer step's traffic and waits,
    summed over the optimizers offloaded, and the global gradient norm of the last step where it
    was taken for it. ``stats`` returns their ``OptimizerOffloadStats``."""

    group = "lightmem"
    FIELDS = (
        "host_state_bytes", "host_grad_bytes", "host_param_bytes", "host_bytes", "grad_bytes_out", "param_bytes_in",
        "waited_s",
    )  # fmt: skip

    def __init__(self, stats: Callable[[], list[Any]]) -> None:
        self._stats = stats

    def figures(self, rows: list[Any] | None = None) -> dict[str, float]:
        """The raw sums (bytes and seconds), by field name."""
        rows = self._stats() if rows is None else rows
        return {name: sum(getattr(row, name) for row in rows) for name in self.FIELDS}

    def collect(self) -> dict[str, float]:
        rows = self._stats()
        figures = self.figures(rows)
        values = {
            key("optimizer/host_state_GiB"): figures["host_state_bytes"] / GiB,
            key("optimizer/host_grads_GiB"): figures["host_grad_bytes"] / GiB,
            key("optimizer/host_params_GiB"): figures["host_param_bytes"] / GiB,
            key("optimizer/grads_out_GiB"): figures["grad_bytes_out"] / GiB,
            key("optimizer/params_in_GiB"): figures["param_bytes_in"] / GiB,
            key("optimizer/wait_ms"): figures["waited_s"] * 1e3,
        }
        # Taken only for the steps that are read; several optimizers: over each one's last step.
        norms = [row.grad_norm for row in rows if row.grad_norm is not None]
        if norms:
            values[key("optimizer/grad_norm")] = math.hypot(*norms)
        return values

    def end_step(self) -> None:
        return None


class PlanPeaks(Protocol):
    predicted_peak_bytes: int
    predicted_reserved_bytes: int
    worst_ratio: float | None
    plan: Any

    def measured_peak_bytes(self) -> int: ...

    def measured_reserved_bytes(self) -> int: ...

    def measured_step_s(self) -> float: ...


class PlanProbe:
    """``plan="auto"``: the peaks (allocated and reserved) its plans predict beside those the
    device's allocator measured, the step time beside the measured one, and (for the summary) the
    worst ratio of the reserved peaks (``lightmem.auto_plan.AutoPlan``)."""

    group = "lightmem"

    def __init__(self, peaks: PlanPeaks) -> None:
        self.peaks = peaks

    def collect(self) -> dict[str, float]:
        peaks = self.peaks
        return {
            key("plan/predicted_peak_GiB"): peaks.predicted_peak_bytes / GiB,
            key("plan/measured_peak_GiB"): peaks.measured_peak_bytes() / GiB,
            key("plan/predicted_reserved_GiB"): peaks.predicted_reserved_bytes / GiB,
            key("plan/measured_reserved_GiB"): peaks.measured_reserved_bytes() / GiB,
            key("plan/predicted_step_ms"): (peaks.plan.step_seconds if peaks.plan is not None else 0.0) * 1e3,
            key("plan/measured_step_ms"): peaks.measured_step_s() * 1e3,
        }

    def end_step(self) -> None:
        return None


class LightmemProbe:
    """lightmem's own traffic for the step, summed over its micro-batches, and checkpointed blocks.

    Only what is on is reported: offload figures with ``offload=True``, the block count when
    ``checkpointed_blocks`` is given.
    """

    group = "lightmem"

    def __init__(self, checkpointed_blocks: Callable[[], int] | None, offload: bool = True) -> None:
        self._checkpointed_blocks = checkpointed_blocks
        self.offload = offload
        self.reset()

    def reset(self) -> None:
        self.totals = OffloadStats()

    def add(self, stats: OffloadStats) -> None:
        """Add one micro-batch's ``OffloadStats``."""
        self.totals.add(stats)

    def collect(self) -> dict[str, float]:
        values: dict[str, float] = {}
        if self.offload:
            totals = self.totals
            values = {
                key("offload/offloaded_GiB"): totals.offloaded_bytes / GiB,
                key("offload/reloaded_GiB"): totals.reloaded_bytes / GiB,
                key("offload/kept_GiB"): totals.kept_bytes / GiB,
                key("offload/deduplicated_GiB"): totals.deduplicated_bytes / GiB,
                key("offload/budget_kept_GiB"): totals.budget_kept_bytes / GiB,
                key("offload/prefetch_hits"): float(totals.prefetch_hits),
                key("offload/prefetch_misses"): float(totals.prefetch_misses),
                key("offload/wait_ms"): totals.wait_s * 1e3,
                key("offload/inflight_waits"): float(totals.inflight_waits),
            }
        if self._checkpointed_blocks is not None:
            values[key("checkpoint/blocks")] = float(self._checkpointed_blocks())
        return values

    def end_step(self) -> None:
        self.reset()
