"""What each action on a block saves and costs, at a plan's prices (``Costs``): bytes taken off
the device, bytes over the link, forward, backward and re-run seconds; partial offload's
thresholds and the offload windows a plan hands the engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from lightmem.config import OffloadSettings, parse_size
from lightmem.config.estimator import parse_offload
from lightmem.config.offload import DEFAULT_MAX_INFLIGHT
from lightmem.estimate.settings import EstimateSettings
from lightmem.estimate.trace.blocks import BlockMemory
from lightmem.estimate.trace.position_wise import ModuleForward
from lightmem.estimate.trace.step import StepTrace

KEEP, OFFLOAD, CHECKPOINT, BOTH = "keep", "offload", "checkpoint", "checkpoint+offload"


PARTIAL = "partial offload"
"""Offload a block's largest saved tensors, as many as its own forward hides the copies of."""


DEFAULT_WINDOW_BYTES = parse_size(DEFAULT_MAX_INFLIGHT, flag="max_inflight_bytes")


@dataclass(frozen=True)
class Costs:
    """The prices of one plan and the parts of the step no configuration changes.

    ``flops_per_s`` prices blocks the step did not price op by op (their ``forward_s`` is 0);
    ``link_bytes_per_s`` is the host link each way. ``optimizer_s`` and ``host_s`` are the
    optimizer step's device seconds and the host's launch time for the whole step (without
    lightmem); ``host_op_s`` prices each block's launches on the host's timeline (0: only
    ``host_s`` bounds the step, and a re-run costs the host its device seconds).
    """

    flops_per_s: float
    link_bytes_per_s: float
    min_bytes: int
    allow_offload: bool
    optimizer_s: float = 0.0
    host_s: float = 0.0
    host_op_s: float = 0.0
    inflight_bytes: int = 256 << 20
    prefetch_bytes: int = 256 << 20
    partial: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Per block, its partial offload's (threshold, bytes) (``partial_thresholds``); absent: none."""
    block_scale: Mapping[str, float] = field(default_factory=dict)
    """Per block, its measured compute over its priced one (``DeviceSpeeds.block_scale``); absent: 1."""
    modules: Mapping[str, ModuleForward] = field(default_factory=dict)
    """The baseline's watched modules (``StepTrace.modules``): what tiling one of them costs."""


def _kept_input(block: BlockMemory, costs: Costs) -> int:
    return block.input_bytes if block.input_bytes >= costs.min_bytes else 0


def partial_offload(block: BlockMemory, costs: Costs, hidden_s: float | None = None) -> tuple[int, int]:
    """``(threshold, bytes)`` of a partial offload of ``block``: its saved tensors from the largest
    down, as long as their copies take no longer than ``hidden_s`` (the compute after them that
    hides them; default: the block's own forward), all of at least ``threshold`` bytes. ``(0, 0)``
    when not even the largest is hidden, or every one is (then it is the whole block's offload)."""
    sizes = sorted((size for size in block.saved_sizes if size >= costs.min_bytes), reverse=True)
    hidden = costs.link_bytes_per_s * (forward_s(block, costs) if hidden_s is None else hidden_s)
    taken = threshold = 0
    for size in sorted(set(sizes), reverse=True):  # every tensor of a size moves, or none
        with_size = sum(s for s in sizes if s >= size)
        if with_size > hidden:
            break
        taken, threshold = with_size, size
    if taken == sum(sizes):  # everything: the whole block's offload
        return 0, 0
    return threshold, taken


def partial_thresholds(blocks: Mapping[str, BlockMemory], costs: Costs) -> dict[str, tuple[int, int]]:
    """Each block's partial offload (``partial_offload``): the link's share of the forward that is
    the block's own (over the step, the forward hides what the link moves while it runs, once)."""
    return {name: partial_offload(block, costs) for name, block in blocks.items()}


def saves_bytes(block: BlockMemory, action: str, costs: Costs) -> int:
    """Predicted activation bytes ``action`` takes off the device for ``block``."""
    if action == PARTIAL:
        return costs.partial.get(block.name, (0, 0))[1]
    if action == OFFLOAD:
        return block.offloadable_bytes(costs.min_bytes)
    if action == CHECKPOINT:
        return max(0, block.saved_bytes - block.input_bytes - block.kept_bytes)
    if action == BOTH:  # offload moves the input to host; the outputs a policy keeps stay on the device
        return max(0, block.saved_bytes - block.input_bytes - block.kept_bytes) + _kept_input(block, costs)
    return 0


def moved_bytes(block: BlockMemory, action: str, costs: Costs) -> int:
    """Bytes ``action`` sends to host for ``block``: what offload moves of what the block keeps."""
    if action == PARTIAL:
        return costs.partial.get(block.name, (0, 0))[1]
    if action == OFFLOAD:
        return block.offloadable_bytes(costs.min_bytes)
    if action == BOTH:
        return _kept_input(block, costs)
    return 0


def _as_measured(block: BlockMemory, costs: Costs, seconds: float) -> float:
    """``seconds`` of ``block``'s compute times its measured scale (``Costs.block_scale``)."""
    return seconds * costs.block_scale.get(block.name, 1.0) if costs.block_scale else seconds


def forward_s(block: BlockMemory, costs: Costs) -> float:
    """The block's forward seconds: priced op by op, else its FLOPs at ``costs.flops_per_s``; as measured."""
    return _as_measured(block, costs, block.forward_s or block.forward_flops / costs.flops_per_s)


def backward_s(block: BlockMemory, costs: Costs) -> float:
    """The block's backward seconds: priced op by op (as measured), else twice its forward."""
    return _as_measured(block, costs, block.backward_s) if block.backward_s else 2 * forward_s(block, costs)


def recompute_s(block: BlockMemory, costs: Costs) -> float:
    """Seconds a checkpointed block's re-run costs: the forward ops its policy repeats; as measured."""
    if block.forward_s:
        seconds = block.forward_s if block.recompute_s is None else block.recompute_s
    else:
        flops = block.forward_flops if block.recompute_flops is None else block.recompute_flops
        seconds = flops / costs.flops_per_s
    return _as_measured(block, costs, seconds)


def block_cost_s(block: BlockMemory, action: str, costs: Costs) -> float:
    """One block's cost seen alone: its re-run, and the transfer its own compute does not hide
    (out while its forward runs, back while its backward runs)."""
    transfer_s = moved_bytes(block, action, costs) / costs.link_bytes_per_s
    exposed = (
        max(0.0, transfer_s - forward_s(block, costs)) + max(0.0, transfer_s - backward_s(block, costs))
        if transfer_s
        else 0.0
    )
    rerun = recompute_s(block, costs) if action in (CHECKPOINT, BOTH) else 0.0
    return rerun + exposed


WINDOW_GRAIN_BYTES = 64 << 10
"""Windows are whole multiples of this (and at least one): the engine admits one copy past any window."""


def window_bytes(link_bytes_per_s: float, seconds: float, block_bytes: int) -> int:
    """The bytes the host link moves in ``seconds``, but no more than ``block_bytes`` (what one block
    sends): a window that keeps the link busy while one block computes, and holds no more than the
    block that is being copied. Rounded up to ``WINDOW_GRAIN_BYTES``."""
    moved = min(link_bytes_per_s * max(seconds, 0.0), float(block_bytes))
    return max(WINDOW_GRAIN_BYTES, -(-int(moved) // WINDOW_GRAIN_BYTES) * WINDOW_GRAIN_BYTES)


def sized_windows(
    offload: OffloadSettings, blocks: Mapping[str, BlockMemory], costs: Costs, share_bytes: int | None = None
) -> OffloadSettings:
    """``offload`` with its in-flight window sized to what the link moves while a typical block
    (the median repeated one) runs its forward, and its prefetch window to what it moves while that
    block runs its backward, each at most what that block offloads and at most ``share_bytes`` (the
    planner's window cap: at long context a layer's forward takes seconds and its saved tensors
    tens of GiB, and a window the size of either held every layer's input on the device); a window
    set to anything but its default is kept as given."""
    layers = [block for block in blocks.values() if block.repeated] or list(blocks.values())
    if not layers:
        return offload

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    forward = median([forward_s(block, costs) for block in layers])
    backward = median([backward_s(block, costs) for block in layers])
    sent = int(median([float(block.offloadable_bytes(costs.min_bytes)) for block in layers]))
    if share_bytes is not None:
        sent = min(sent, max(share_bytes, 0))
    inflight, prefetch = offload.max_inflight_bytes, offload.prefetch_bytes
    if inflight == DEFAULT_WINDOW_BYTES:
        inflight = window_bytes(costs.link_bytes_per_s, forward, sent)
    if prefetch == DEFAULT_WINDOW_BYTES:
        prefetch = window_bytes(costs.link_bytes_per_s, backward, sent)
    return replace(offload, max_inflight_bytes=inflight, prefetch_bytes=prefetch)


def costs_for(settings: EstimateSettings, baseline: StepTrace, offload: OffloadSettings | None) -> Costs:
    """The prices a plan for ``settings`` uses: its device speeds, the baseline step's optimizer
    and host launch time, and the offload windows and threshold (offload is not considered on
    "cpu" or when ``offload`` is None)."""
    speeds = settings.speeds
    assert speeds is not None
    flops = speeds.matmul_rate(_dtype_name(settings))
    searched = offload if offload is not None else parse_offload(True, flag="plan(offload=...)")
    assert searched is not None
    return Costs(
        flops, speeds.link_bytes_per_s, searched.min_bytes,
        allow_offload=offload is not None and settings.device != "cpu", optimizer_s=baseline.optimizer_s,
        host_s=speeds.host_seconds(baseline.priced_ops), host_op_s=speeds.host_op_s, inflight_bytes=searched.max_inflight_bytes,
        prefetch_bytes=searched.prefetch_bytes, block_scale=dict(speeds.block_scale), modules=dict(baseline.modules),
    )  # fmt: skip


def _dtype_name(settings: EstimateSettings) -> str:
    """The dtype the step's products run in, as ``DeviceSpeeds`` names it."""
    dtype = settings.precision.autocast_dtype or settings.precision.param_dtype
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}.get(str(dtype), "fp32")
