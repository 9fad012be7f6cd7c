"""Cheap memory probes, one per group. None synchronises the GPU.

A probe that cannot run here (no CUDA, NVML missing or failing) raises ``ProbeUnavailable`` at
construction with a one-line reason; the callback switches that group off and says so once.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch

from lightmem.metrics.names import GiB, key


class ProbeUnavailable(RuntimeError):
    """The probe cannot run on this machine; the message says why, in one line."""


class TorchAllocatorProbe:
    """PyTorch's caching allocator: ``torch.cuda.memory_stats`` (a host-side read, no sync)."""

    group = "gpu"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ProbeUnavailable("the training device is not a CUDA device")
        self.device = device

    def collect(self) -> dict[str, float]:  # pragma: no cover - needs CUDA
        stats = torch.cuda.memory_stats(self.device)
        return {
            key("gpu/allocated_GiB"): stats.get("allocated_bytes.all.current", 0) / GiB,
            key("gpu/reserved_GiB"): stats.get("reserved_bytes.all.current", 0) / GiB,
            key("gpu/step_peak_allocated_GiB"): stats.get("allocated_bytes.all.peak", 0) / GiB,
            key("gpu/inactive_split_GiB"): stats.get("inactive_split_bytes.all.current", 0) / GiB,
            key("gpu/alloc_retries"): float(stats.get("num_alloc_retries", 0)),
            key("gpu/ooms"): float(stats.get("num_ooms", 0)),
        }

    def end_step(self) -> None:  # pragma: no cover - needs CUDA
        torch.cuda.reset_peak_memory_stats(self.device)


class NvmlProbe:
    """The driver's view of the device through NVML (``pynvml`` from nvidia-ml-py)."""

    group = "device"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ProbeUnavailable("the training device is not a CUDA device")
        try:  # pragma: no cover - needs a GPU driver
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            try:
                uuid = str(torch.cuda.get_device_properties(index).uuid)
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except Exception:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._memory_info = pynvml.nvmlDeviceGetMemoryInfo
            self._memory_info(self._handle)
        except Exception as error:  # pragma: no cover - depends on the driver
            raise ProbeUnavailable(f"NVML is not usable ({type(error).__name__}: {error})") from None

    def collect(self) -> dict[str, float]:  # pragma: no cover - needs a GPU driver
        info = self._memory_info(self._handle)
        return {key("device/used_GiB"): info.used / GiB, key("device/total_GiB"): info.total / GiB}

    def end_step(self) -> None:
        return None


class HostProbe:
    """This process and this machine through psutil, plus the host buffers lightmem holds."""

    group = "host"

    def __init__(
        self, pool_bytes: Callable[[], int], pool_in_use_bytes: Callable[[], int] = lambda: 0
    ) -> None:
        self._process = psutil.Process()
        self._pool_bytes = pool_bytes
        self._pool_in_use_bytes = pool_in_use_bytes

    def collect(self) -> dict[str, float]:
        return {
            key("host/rss_GiB"): self._process.memory_info().rss / GiB,
            key("host/available_GiB"): psutil.virtual_memory().available / GiB,
            key("host/swap_used_GiB"): psutil.swap_memory().used / GiB,
            key("host/pinned_GiB"): self._pool_bytes() / GiB,
            key("host/pinned_in_use_GiB"): self._pool_in_use_bytes() / GiB,
        }

    def end_step(self) -> None:
        return None


class LightmemProbe:
    """lightmem's own traffic for the step, summed over its micro-batches, and checkpointed blocks."""

    group = "lightmem"

    def __init__(self, checkpointed_blocks: Callable[[], int]) -> None:
        self._checkpointed_blocks = checkpointed_blocks
        self.reset()

    def reset(self) -> None:
        self.offloaded_bytes = 0
        self.reloaded_bytes = 0
        self.kept_bytes = 0
        self.deduplicated_bytes = 0
        self.budget_kept_bytes = 0
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.wait_s = 0.0

    def add(self, stats: object) -> None:
        """Add one micro-batch's ``OffloadStats``."""
        for name in (
            "offloaded_bytes", "reloaded_bytes", "kept_bytes", "deduplicated_bytes", "budget_kept_bytes",
            "prefetch_hits", "prefetch_misses", "wait_s",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(stats, name))

    def collect(self) -> dict[str, float]:
        return {
            key("offload/offloaded_GiB"): self.offloaded_bytes / GiB,
            key("offload/reloaded_GiB"): self.reloaded_bytes / GiB,
            key("offload/kept_GiB"): self.kept_bytes / GiB,
            key("offload/deduplicated_GiB"): self.deduplicated_bytes / GiB,
            key("offload/budget_kept_GiB"): self.budget_kept_bytes / GiB,
            key("offload/prefetch_hits"): float(self.prefetch_hits),
            key("offload/prefetch_misses"): float(self.prefetch_misses),
            key("offload/wait_ms"): self.wait_s * 1e3,
            key("checkpoint/blocks"): float(self._checkpointed_blocks()),
        }

    def end_step(self) -> None:
        self.reset()
