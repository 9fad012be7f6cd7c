"""Every metric lightmem logs, defined once: key, probe group, unit, meaning, panel.

The TensorBoard layout, the README table and the DDP reduction are all built from ``METRICS``.
Bytes are logged as GiB floats; counts as plain numbers; times in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "lightmem/memory"
GiB = float(1024**3)


@dataclass(frozen=True)
class Metric:
    key: str
    """Full name as logged, e.g. ``lightmem/memory/gpu/allocated_GiB``."""
    group: str
    """Probe group that produces it: ``gpu``, ``device``, ``host`` or ``lightmem``."""
    unit: str
    meaning: str
    panel: str
    """TensorBoard custom-scalars chart the metric is drawn in."""
    reduce_max: bool = True
    """With DDP, log the maximum over ranks (memory figures); otherwise rank zero's value."""


def _m(name: str, group: str, unit: str, meaning: str, panel: str, reduce_max: bool = True) -> Metric:
    return Metric(f"{PREFIX}/{name}", group, unit, meaning, panel, reduce_max)


METRICS: tuple[Metric, ...] = (
    # PyTorch's caching allocator (torch.cuda.memory_stats): what PyTorch itself holds.
    _m("gpu/allocated_GiB", "gpu", "GiB", "bytes in live tensors at the end of the step", "GPU memory, PyTorch allocator (GiB)"),
    _m("gpu/reserved_GiB", "gpu", "GiB", "bytes the caching allocator holds from the driver", "GPU memory, PyTorch allocator (GiB)"),
    _m("gpu/step_peak_allocated_GiB", "gpu", "GiB", "peak of allocated since start or your last reset (lightmem resets it only once, at fit start with plan='auto', where its measure of the GPU raised it)", "GPU memory, PyTorch allocator (GiB)"),
    _m("gpu/inactive_split_GiB", "gpu", "GiB", "reserved but unusable fragments of split blocks (fragmentation)", "GPU fragmentation (GiB)"),
    _m("gpu/alloc_retries", "gpu", "count", "allocations that had to free cached blocks and retry (since start)", "GPU allocator retries and OOMs (count)"),
    _m("gpu/ooms", "gpu", "count", "out-of-memory errors raised by the allocator (since start)", "GPU allocator retries and OOMs (count)"),
    # The driver's view (NVML): includes the CUDA context and other processes.
    _m("device/used_GiB", "device", "GiB", "device memory in use by every process, CUDA context included (NVML)", "GPU device memory, NVML (GiB)"),
    _m("device/total_GiB", "device", "GiB", "device memory capacity (NVML)", "GPU device memory, NVML (GiB)"),
    # Host memory (psutil).
    _m("host/rss_GiB", "host", "GiB", "resident set size of this process", "Host memory, this process (GiB)"),
    _m("host/available_GiB", "host", "GiB", "memory the OS can still hand out without swapping", "Host memory, machine (GiB)", reduce_max=False),
    _m("host/swap_used_GiB", "host", "GiB", "swap in use on the machine", "Host memory, machine (GiB)"),
    _m("host/pinned_GiB", "host", "GiB", "host buffers held by lightmem's offload pool (page-locked on CUDA)", "Host memory, this process (GiB)"),
    _m("host/pinned_in_use_GiB", "host", "GiB", "peak of those buffers holding offloaded activations during the step's last forward and backward (the rest is cached)", "Host memory, this process (GiB)"),
    _m("host/page_lock_ms", "host", "ms", "time spent page-locking host memory since the last logged step (touching pages and cudaHostRegister), summed over the threads doing it, background ones included", "Host page-locking (ms)"),
    _m("host/page_lock_wait_ms", "host", "ms", "of that, time a thread needing host memory was held up: registrations on its own thread and waits for a chunk still being page-locked", "Host page-locking (ms)"),
    # The host memory guard (lightmem/host_guard.py): the limit the OOM killer enforces.
    _m("host/limit_GiB", "host", "GiB", "host memory limit of this process: the tightest of its cgroup limit and total RAM", "Host memory limit (GiB)", reduce_max=False),
    _m("host/headroom_GiB", "host", "GiB", "limit less what counts against it (cgroup usage less reclaimable file cache, or process and workers' RSS)", "Host memory limit (GiB)", reduce_max=False),
    _m("host/workers_rss_GiB", "host", "GiB", "resident set size of this process's children (DataLoader workers)", "Host memory, this process (GiB)"),
    # lightmem's own traffic, summed over the micro-batches of the step.
    _m("offload/offloaded_GiB", "lightmem", "GiB", "saved activations copied to host", "Offload traffic (GiB)"),
    _m("offload/reloaded_GiB", "lightmem", "GiB", "bytes copied back to the device during backward", "Offload traffic (GiB)"),
    _m("offload/kept_GiB", "lightmem", "GiB", "saved activations left on the device by policy (size, scope)", "Offload kept on device (GiB)"),
    _m("offload/deduplicated_GiB", "lightmem", "GiB", "saves served by a storage already on host (not copied again)", "Offload traffic (GiB)"),
    _m("offload/budget_kept_GiB", "lightmem", "GiB", "eligible bytes left on the device because the host budget or floor was reached", "Offload kept on device (GiB)"),
    _m("offload/prefetch_hits", "lightmem", "count", "reloads already issued ahead of need when backward asked", "Offload prefetch (count)"),
    _m("offload/prefetch_misses", "lightmem", "count", "reloads issued only when backward asked", "Offload prefetch (count)"),
    _m("offload/wait_ms", "lightmem", "ms", "time the compute stream waited for copies", "Offload waits (ms)"),
    _m("offload/inflight_waits", "lightmem", "count", "times compute waited for the oldest copy to host because max_inflight_bytes was reached", "Offload in-flight waits (count)"),
    # Model-state offload (offload_optimizer): host bytes held now and the last optimizer step's traffic.
    _m("optimizer/host_state_GiB", "lightmem", "GiB", "optimizer state (moments, momentum, step counters) held on the host", "Optimizer offload host memory (GiB)"),
    _m("optimizer/host_grads_GiB", "lightmem", "GiB", "host gradient buffers (accumulators and accumulation staging)", "Optimizer offload host memory (GiB)"),
    _m("optimizer/host_params_GiB", "lightmem", "GiB", "host copies of the parameters the optimizer steps", "Optimizer offload host memory (GiB)"),
    _m("optimizer/grads_out_GiB", "lightmem", "GiB", "gradient bytes copied to host for the last optimizer step (all its micro-batches)", "Optimizer offload traffic (GiB)"),
    _m("optimizer/params_in_GiB", "lightmem", "GiB", "updated parameter bytes copied back to the device after the last optimizer step", "Optimizer offload traffic (GiB)"),
    _m("optimizer/wait_ms", "lightmem", "ms", "time training waited for gradient and parameter copies in the last optimizer step", "Optimizer offload waits (ms)"),
    _m("optimizer/grad_norm", "lightmem", "norm", "global 2-norm of the gradients the last optimizer step took, summed over its micro-batches, before clipping: torch.nn.utils.get_total_norm, taken on the host", "Gradient norm, global 2-norm", reduce_max=False),
    _m("checkpoint/blocks", "lightmem", "count", "blocks recomputed in backward (selective checkpointing)", "Checkpointed blocks (count)", reduce_max=False),
    # plan="auto": what its plans predict beside what the device's allocator measured.
    _m("plan/predicted_peak_GiB", "lightmem", "GiB", "peak allocated memory plan='auto' predicts: the highest of the plans applied in this fit so far", "Plan: predicted and measured peak (GiB)"),
    _m("plan/measured_peak_GiB", "lightmem", "GiB", "peak allocated memory the training batches of this fit raised the device's allocator to (max_memory_allocated), held against the prediction", "Plan: predicted and measured peak (GiB)"),
    _m("plan/predicted_reserved_GiB", "lightmem", "GiB", "peak reserved memory plan='auto' predicts (the allocator's share included): what the plans are made to fit in the budget", "Plan: predicted and measured reserved (GiB)"),
    _m("plan/measured_reserved_GiB", "lightmem", "GiB", "peak reserved memory the training batches of this fit raised the allocator to (max_memory_reserved); past the prediction by 15% the next batch is planned again, tighter", "Plan: predicted and measured reserved (GiB)"),
    _m("plan/predicted_step_ms", "lightmem", "ms", "step time the current plan predicts at the device's measured speeds", "Plan: predicted and measured step (ms)", reduce_max=False),
    _m("plan/measured_step_ms", "lightmem", "ms", "median device time of the steps timed since the current plan was applied (its first step not counted; 0: none yet)", "Plan: predicted and measured step (ms)"),
)

GROUPS: tuple[str, ...] = ("gpu", "device", "host", "lightmem")
BY_KEY: dict[str, Metric] = {metric.key: metric for metric in METRICS}


def key(name: str) -> str:
    """Full metric key for a short name (``"gpu/allocated_GiB"``); fails on unknown names."""
    full = f"{PREFIX}/{name}"
    if full not in BY_KEY:
        raise KeyError(f"unknown lightmem metric {name!r}")
    return full
