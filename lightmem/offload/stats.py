"""What the offloader did: counters a user (or the LightMem callback) reads after a step."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from lightmem.config import format_bytes


@dataclass
class OffloadStats:
    """Counters for one use of an offload context: its forward and the backward that follows.

    Byte counts are storage bytes. A storage saved several times counts once in
    ``offloaded_bytes``; the extra saves count in ``deduplicated_bytes``.
    """

    packed_tensors: int = 0
    """Saved tensors autograd handed to the hooks (every save, parameters included)."""
    offloaded_tensors: int = 0
    """Storages copied to host memory."""
    offloaded_bytes: int = 0
    """Bytes copied device -> host."""
    kept_bytes: int = 0
    """Bytes of saved storages on an offload device left there by policy (size, scope, complex,
    autocast copies of parameters)."""
    deduplicated_bytes: int = 0
    """Bytes of saves served by a storage already on host (not copied again)."""
    budget_kept_bytes: int = 0
    """Bytes that were eligible but stayed on the device because the host budget or floor was reached."""
    reloaded_bytes: int = 0
    """Bytes copied host -> device during backward (twice for a second backward with retain_graph)."""
    prefetch_hits: int = 0
    """Reloads that were already issued ahead of need when backward asked for them."""
    prefetch_misses: int = 0
    """Reloads issued only when backward asked for them."""
    inflight_waits: int = 0
    """Times the compute stream waited for the oldest copy to host because more than
    ``max_inflight_bytes`` of saved tensors were held on the device for copies not yet finished."""
    inflight_served: int = 0
    """Unpacks served from the device tensor still held for its unfinished copy to host (no reload)."""
    host_alloc_failed_bytes: int = 0
    """Eligible bytes left on the device because host memory could not be allocated or page-locked."""
    capture_kept_bytes: int = 0
    """Bytes of saves left on the device because a CUDA graph was being captured (each save counted)."""
    wait_s: float = 0.0
    """Seconds the compute stream (on CPU: the training thread) waited for copies."""
    peak_host_bytes: int = 0
    """Peak bytes of host buffers held by the offloader's pool (in use plus cached for reuse)."""
    peak_resident_bytes: int = 0
    """Peak bytes of saved storages on the device: kept ones, reloaded ones not yet consumed, and
    offloaded ones whose copy to host has not run yet (under ``torch.compile``, every save of a
    compiled graph until the graph has run)."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def add(self, other: OffloadStats) -> None:
        """Accumulate another batch's stats: counters add up, ``peak_*`` figures take the larger."""
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            setattr(self, field.name, max(mine, theirs) if field.name.startswith("peak_") else mine + theirs)

    def __str__(self) -> str:
        rows = []
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_bytes"):
                shown = format_bytes(value)
            elif field.name.endswith("_s"):
                shown = f"{value * 1e3:.2f} ms"
            else:
                shown = str(value)
            rows.append(f"  {field.name:<24} {shown}")
        return "OffloadStats(\n" + "\n".join(rows) + "\n)"
