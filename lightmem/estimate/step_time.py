"""What a step takes with a lightmem configuration, as the planner prices it.

The fake step prices each op by its class at the device's speeds (``lightmem.devices``):
every block has its forward and backward seconds, and a checkpointed block's re-run costs the
seconds of the forward ops its policy repeats. Transfers are priced on a timeline of the step,
block by block in execution order, as the engine runs them:

- forward: each block computes for its forward seconds; the bytes it offloads join the
  device-to-host queue when it ends and the link drains that queue while later blocks compute.
  The device holds at most ``inflight_bytes`` of copies not yet made (``max_inflight_bytes``):
  past it compute waits for the oldest copy;
- backward: blocks run in reverse, each for its backward seconds plus its re-run; a block's bytes
  come back on the host-to-device queue (the link is full duplex), not before they have left, and
  the block waits for them. Reloads run ahead of compute within ``prefetch_bytes``: a block whose
  reloads do not fit the window beside the ones before it starts its reloads only when the block
  after it (in forward order) starts its backward;
- then the optimizer step.

The host launches the step's ops on a timeline of its own (``DeviceSpeeds.host_op_s`` each, a
checkpointed block's re-run and bookkeeping as ``devices.checkpoint_host_seconds`` prices them): a
block ends on the device no sooner than the host has launched it. A step of many small ops waits on
the host, not the device; there transfers, and a re-run's device time, hide for free.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from lightmem.config import DEFAULT_MAX_INFLIGHT, DEFAULT_PREFETCH, OffloadSettings, TileSettings, parse_size
from lightmem.devices import checkpoint_host_seconds
from lightmem.estimate.position_wise import ModuleForward
from lightmem.estimate.report import BlockMemory
from lightmem.estimate.step import ROOT_BLOCK
from lightmem.tiling import shard_lengths

KEEP, OFFLOAD, CHECKPOINT, BOTH = "keep", "offload", "checkpoint", "checkpoint+offload"
PARTIAL = "partial offload"
"""Offload a block's largest saved tensors, as many as its own forward hides the copies of."""
DEFAULT_WINDOW_BYTES = parse_size(DEFAULT_MAX_INFLIGHT, flag="max_inflight_bytes")
assert DEFAULT_WINDOW_BYTES == parse_size(DEFAULT_PREFETCH, flag="prefetch")


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


@dataclass(frozen=True)
class StepTime:
    """A configuration's predicted step: re-computation and transfer not hidden by compute, on top
    of the step's compute (``compute_s``: forward, backward and optimizer step without lightmem)."""

    recompute_s: float
    exposed_transfer_s: float
    moved_bytes: int
    """Bytes sent to host (and back) per step."""
    compute_s: float = 0.0

    @property
    def total_s(self) -> float:
        """What the configuration adds to the step."""
        return self.recompute_s + self.exposed_transfer_s

    @property
    def step_s(self) -> float:
        """The whole step's predicted seconds."""
        return self.compute_s + self.total_s


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


DEFAULT_SHARDS = TileSettings(modules=())
"""The shards a plan tiles in: ``LightMem(tile=...)``'s default, as long as the module's input is wide."""


def tile_s(module: ModuleForward, blocks: Mapping[str, BlockMemory], costs: Costs, checkpointed: bool = False) -> tuple[float, float, float]:
    """What tiling ``module`` adds to the step: (device seconds in backward: its forward once more,
    the shards run again with grad; host seconds in forward; host seconds in backward).

    The host launches each of its forward's ops once per shard in forward (and again in a
    checkpointed block's re-run), and in backward each shard's forward and backward: its backward
    taken to launch as many ops per forward op as its block's backward does (the trace prices
    blocks' backwards, not modules')."""
    block_name = module.block or ROOT_BLOCK
    shards = len(shard_lengths(module.input_shape[-2], module.input_shape[-1], DEFAULT_SHARDS))
    device = _as_measured(blocks[block_name], costs, module.forward_s) if block_name in blocks else module.forward_s
    block = blocks.get(block_name)
    ratio = block.backward_ops / block.forward_ops if block is not None and block.forward_ops else 1.0
    launches = module.forward_ops
    forward_ops = (shards - 1) * launches * (2 if checkpointed else 1)
    backward_ops = shards * launches + (shards - 1) * launches * ratio
    return device, costs.host_op_s * forward_ops, costs.host_op_s * backward_ops


def tiled_by_block(
    blocks: Mapping[str, BlockMemory], costs: Costs, tiled: Collection[str], checkpointed: Collection[str] = ()
) -> dict[str, tuple[float, float, float]]:
    """``tile_s`` of the ``tiled`` modules summed per block (a module the baseline did not price adds nothing)."""
    added: dict[str, tuple[float, float, float]] = {}
    for name in tiled:
        module = costs.modules.get(name)
        if module is None:
            continue
        block = module.block or ROOT_BLOCK
        price = tile_s(module, blocks, costs, block in checkpointed)
        before = added.get(block, (0.0, 0.0, 0.0))
        added[block] = (before[0] + price[0], before[1] + price[1], before[2] + price[2])
    return added


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


def compute_s(blocks: Mapping[str, BlockMemory], costs: Costs) -> float:
    """The step without lightmem: every block's forward and backward and the optimizer step, on
    the device's timeline and the host's (no less than the host's time to launch them)."""
    return _timeline(blocks, {}, costs, [0] * len(blocks))


def _host_s(blocks: list[BlockMemory], checkpointed: list[bool], costs: Costs) -> tuple[list[float], list[float], float]:
    """Each block's host seconds (forward, backward), a checkpointed one's re-run included, and
    what checkpointing adds to them; zeros where the step's ops were not priced one by one."""
    forward, backward, added = [], [], 0.0
    for block, rerun in zip(blocks, checkpointed):
        extra = (0.0, 0.0)
        if rerun:
            ops = block.forward_ops if block.recompute_ops is None else block.recompute_ops
            extra = checkpoint_host_seconds(costs.host_op_s, block.forward_ops, ops, block.recompute_ops is not None)
        forward.append(costs.host_op_s * block.forward_ops + extra[0])
        backward.append(costs.host_op_s * block.backward_ops + extra[1])
        added += extra[0] + extra[1]
    return forward, backward, added


@dataclass(frozen=True)
class ForwardInterval:
    """One block's forward on the step's timeline, as a pair of CUDA events around it times it:
    from the end of what ran before it on the device to its own end."""

    seconds: float
    """The interval: the larger of its compute and its share of the host's launches."""
    device_s: float
    """Its compute (``forward_s``)."""
    host_s: float
    """How long after the device ended what ran before it the host ends launching it (its launches
    less the lead the host had; 0 or less when the host was that far ahead)."""
    launch_s: float
    """The host's time to launch it."""

    @property
    def host_bound(self) -> bool:
        """The host's launches, not its compute, end it."""
        return self.host_s > self.device_s


def forward_intervals(
    blocks: Mapping[str, BlockMemory], actions: Mapping[str, str], costs: Costs
) -> dict[str, ForwardInterval]:
    """Each block's forward interval (``ForwardInterval``) with ``actions``, on the host's and the
    device's timelines of the step without transfers (``_forward``, as ``_timeline`` runs it)."""
    order = list(blocks.values())
    checkpointed = [actions.get(block.name, KEEP) in (CHECKPOINT, BOTH) for block in order]
    launches = _host_s(order, checkpointed, costs)[0]
    device = [forward_s(block, costs) for block in order]
    ends, hosts, _ = _forward(device, [0] * len(order), launches, costs)
    before = [0.0, *ends[:-1]]
    return {
        block.name: ForwardInterval(end - start, seconds, host - start, launch)
        for block, seconds, launch, start, end, host in zip(order, device, launches, before, ends, hosts)
    }


def _forward(
    forward: list[float], sent: list[int], launches: list[float], costs: Costs
) -> tuple[list[float], list[float], list[float]]:
    """The forward on the step's timelines, block by block: when each ends on the device (no sooner
    than the host has launched it), when the host has launched it, and when its bytes have left
    (its end when it sends none)."""
    link = costs.link_bytes_per_s
    now = link_out = host = 0.0
    ends, hosts, out_done = [], [], []
    for seconds, nbytes, launch in zip(forward, sent, launches):
        host += launch
        now = max(now + seconds, host)
        if nbytes:
            link_out = max(link_out, now) + nbytes / link
            # The device keeps at most inflight_bytes of copies not yet made: compute waits.
            now = max(now, link_out - costs.inflight_bytes / link)
        ends.append(now)
        hosts.append(host)
        out_done.append(link_out if nbytes else now)
    return ends, hosts, out_done


def _timeline(
    blocks: Mapping[str, BlockMemory], actions: Mapping[str, str], costs: Costs, sent: list[int],
    tiled: Collection[str] = (),
) -> float:
    """The step's seconds with ``actions``, ``sent`` bytes per block and the ``tiled`` modules
    (module docstring; a tiled module's shards run again in its block's backward, ``tile_s``)."""
    names = list(blocks)
    order = [blocks[name] for name in names]
    forward = [forward_s(block, costs) for block in order]
    backward = [backward_s(block, costs) for block in order]
    checkpointed = [actions.get(name, KEEP) in (CHECKPOINT, BOTH) for name in names]
    rerun = [recompute_s(block, costs) if on else 0.0 for block, on in zip(order, checkpointed)]
    host_forward, host_backward, added = _host_s(order, checkpointed, costs)
    if tiled:
        on = {name for name, action in actions.items() if action in (CHECKPOINT, BOTH)}
        for block, (device, host_in_forward, host_in_backward) in tiled_by_block(blocks, costs, tiled, on).items():
            index = names.index(block) if block in blocks else -1
            if index < 0:
                continue
            rerun[index] += device
            host_forward[index] += host_in_forward
            host_backward[index] += host_in_backward
            added += host_in_forward + host_in_backward
    # The host's whole step (its optimizer's launches too) bounds it; without per-block host
    # prices a re-run costs the host its device seconds.
    floor = costs.host_s + (added if costs.host_op_s else sum(rerun))
    link = costs.link_bytes_per_s
    ends, hosts, out_done = _forward(forward, sent, host_forward, costs)
    now, host = (ends[-1], hosts[-1]) if ends else (0.0, 0.0)
    link_in = now
    started: dict[int, float] = {}
    for index in reversed(range(len(names))):
        ready = now
        if sent[index]:
            begin = max(link_in, out_done[index])
            after = index + 1
            while after < len(names) and not sent[after]:
                after += 1
            if after < len(names) and sent[index] + sent[after] > costs.prefetch_bytes:
                begin = max(begin, started.get(after, begin))  # the window holds the next block's reloads
            link_in = begin + sent[index] / link
            ready = link_in
        start = max(now, ready)
        started[index] = start
        host += host_backward[index]
        now = max(start + rerun[index] + backward[index], host)
    return max(now + costs.optimizer_s, floor)


def step_time(
    blocks: Mapping[str, BlockMemory],
    actions: Mapping[str, str],
    costs: Costs,
    moved: Mapping[str, int] | None = None,
    tiled: Collection[str] = (),
) -> StepTime:
    """The step with ``actions`` (block name -> action; absent: keep) and the ``tiled`` modules on
    the step's timeline.

    ``blocks`` must be in execution order (the estimator reports them so, with what runs outside
    every block last). ``moved``: the bytes each block sends to host, when known from a verified
    step (else predicted from the actions). The re-run's share (checkpointed blocks' re-runs and
    tiled modules' second forwards) is what the step takes without the transfers over what it
    takes without lightmem; the rest is transfer the step does not hide.
    """
    names = list(blocks)
    if moved is None:
        sent = [moved_bytes(blocks[name], actions.get(name, KEEP), costs) for name in names]
    else:
        sent = [moved.get(name, 0) for name in names]
    base = compute_s(blocks, costs)
    reruns = tiled or any(actions.get(name, KEEP) in (CHECKPOINT, BOTH) for name in names)
    recomputed = _timeline(blocks, actions, costs, [0] * len(names), tiled) if reruns else base
    total = _timeline(blocks, actions, costs, sent, tiled) if any(sent) else recomputed
    return StepTime(max(0.0, recomputed - base), max(0.0, total - recomputed), sum(sent), base)


def configuration_time(
    blocks: Mapping[str, BlockMemory],
    costs: Costs,
    checkpointed: list[str] | tuple[str, ...] = (),
    moved: Mapping[str, int] | None = None,
    model_state_link_bytes: int = 0,
    tiled: Collection[str] = (),
) -> StepTime:
    """A verified configuration's step: ``checkpointed`` blocks re-run, ``tiled`` modules' shards
    run again in backward, ``moved`` bytes per block over the link (from its fake step), and
    model-state offload's ``model_state_link_bytes`` priced as not hidden by compute (an upper
    bound); its optimizer step then runs on the host, whose time is not priced."""
    moved = dict(moved or {})
    actions = {name: CHECKPOINT for name in checkpointed if name in blocks}
    for name, nbytes in moved.items():
        if nbytes and name in blocks:
            actions[name] = BOTH if name in actions else OFFLOAD
    if model_state_link_bytes:
        costs = replace(costs, optimizer_s=0.0)
    price = step_time(blocks, actions, costs, moved, tiled)
    exposed = price.exposed_transfer_s + model_state_link_bytes / costs.link_bytes_per_s
    return StepTime(price.recompute_s, exposed, price.moved_bytes, price.compute_s)


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
    planner's ``_window_cap``: at long context a layer's forward takes seconds and its saved tensors
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
