"""What was on the device when training ran out of memory, and which flag would help."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightmem.config import format_bytes
from lightmem.tables import format_table


HISTORY_ENTRIES = 100_000


def record_memory_history() -> bool:
    """Start recording CUDA allocations for a snapshot; False (nothing done) without CUDA.

    Python-only stacks: full C++ stacks make every allocation slower and a dump take minutes.
    """
    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    return True


def stop_memory_history() -> None:
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(enabled=None)


def snapshot_path(path: str, rank: int, world_size: int) -> str:
    """One file per rank: ``oom.pickle`` -> ``oom.rank3.pickle`` when several processes train."""
    if world_size <= 1:
        return path
    file = Path(path)
    return str(file.with_name(f"{file.stem}.rank{rank}{file.suffix}"))


def dump_snapshot(path: str, rank: int, world_size: int) -> str | None:
    """Write this rank's memory snapshot (open it at https://pytorch.org/memory_viz); its path, or
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    target = snapshot_path(path, rank, world_size)
    torch.cuda.memory._dump_snapshot(target)
    return target


def _unique_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device != device:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def device_breakdown(
    model: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
    saved_on_device_bytes: int,
) -> dict[str, int]:
    """Bytes by category on ``device``; ``rest`` is allocated memory none of them explains (CUDA)."""
    params = list(model.parameters())
    state = [
        value
        for optimizer in optimizers
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    breakdown = {
        "parameters": _unique_bytes([*params, *model.buffers()], device),
        "gradients": _unique_bytes([p.grad for p in params if p.grad is not None], device),
        "optimizer_state": _unique_bytes(state, device),
        "saved_activations_known_to_lightmem": saved_on_device_bytes,
    }
    if device.type == "cuda" and torch.cuda.is_available():  # pragma: no cover - needs CUDA
        allocated = torch.cuda.memory_allocated(device)
        breakdown["rest"] = max(0, allocated - sum(breakdown.values()))
        breakdown["allocated"] = allocated
        breakdown["reserved"] = torch.cuda.memory_reserved(device)
    return breakdown


def advice(
    *,
    offload: bool,
    offload_min_bytes: int,
    checkpointed_blocks: int,
    repeated_block: str | None,
    breakdown: Mapping[str, int],
) -> list[str]:
    """Concrete LightMem flags (and other levers) that address what the breakdown shows."""
    lines = []
    fixed = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]
    allocated = breakdown.get("allocated", 0)
    if allocated and fixed > 0.8 * allocated:
        lines.append(
            "Parameters, gradients and optimizer state take most of the device: activation offload or "
            "checkpointing cannot fix that. Keep only the parameters on the device with "
            "LightMem(offload_optimizer=True) (gradients, optimizer state and step on the host), or use "
            "bf16 weights, an optimizer with less state, or sharding (FSDP / DeepSpeed ZeRO)."
        )
    if checkpointed_blocks == 0 and repeated_block is not None:
        lines.append(f"Checkpoint the repeated blocks: LightMem(checkpoint=[{repeated_block!r}]).")
    if not offload:
        lines.append("Move saved activations to host memory: LightMem(offload=True, offload_min_bytes='1MiB').")
    elif offload_min_bytes > 1024**2:
        lines.append("Offload smaller activations too: LightMem(offload_min_bytes='1MiB').")
    lines.append(
        "Estimate before training to find the largest batch that fits: "
        "lightmem.estimate_memory(...) / max_batch_size(...), or `lightmem estimate` on the command line."
    )
    return lines


def repeated_block_class(model: nn.Module) -> str | None:
    """The class name of the largest group of identical sibling blocks (``ModuleList`` children)."""
    best: tuple[int, str] | None = None
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            names = [type(child).__name__ for child in module.children()]
            for name in set(names):
                count = names.count(name)
                if count > 1 and any(True for _ in module.parameters()) and (best is None or count > best[0]):
                    best = (count, name)
    return best[1] if best else None


def report(
    model: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
    *,
    offloader: Any,
    offload_min_bytes: int,
    checkpointed_blocks: int,
    last_metrics: Mapping[str, float],
) -> str:
    """The whole report: what was on ``device``, the last metrics, the flags that would help.

    ``offloader`` is the active ``ActivationOffloader`` or None (offload off).
    """
    breakdown = device_breakdown(model, optimizers, device, offloader.resident_bytes if offloader else 0)
    if offloader is not None:
        breakdown["host_buffers_held_by_lightmem"] = offloader.host_bytes_held
    lines = advice(
        offload=offloader is not None,
        offload_min_bytes=offload_min_bytes,
        checkpointed_blocks=checkpointed_blocks,
        repeated_block=repeated_block_class(model),
        breakdown=breakdown,
    )
    return render(breakdown, last_metrics, lines)


def render(breakdown: Mapping[str, int], last_metrics: Mapping[str, float], lines: list[str]) -> str:
    out = ["lightmem: out of memory during training. What was on the device:"]
    rows = [(name, format_bytes(value)) for name, value in breakdown.items()]
    out.append(_indent(format_table(rows, align="lr")))
    if last_metrics:
        out.append("Last logged metrics:")
        rows = [(name, f"{value:.4f}") for name, value in last_metrics.items()]
        out.append(_indent(format_table(rows, align="lr")))
    out.append("What would help:")
    out.extend(f"  - {line}" for line in lines)
    return "\n".join(out)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())
