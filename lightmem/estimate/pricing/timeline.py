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
from dataclasses import dataclass, replace

from lightmem.config import DEFAULT_PREFETCH, TileSettings, parse_size
from lightmem.devices import checkpoint_host_seconds
from lightmem.estimate.pricing.costs import (
    BOTH,
    CHECKPOINT,
    DEFAULT_WINDOW_BYTES,
    KEEP,
    OFFLOAD,
    Costs,
    _as_measured,
    backward_s,
    forward_s,
    moved_bytes,
    recompute_s,
)
from lightmem.estimate.trace.blocks import ROOT_BLOCK, BlockMemory
from lightmem.estimate.trace.position_wise import ModuleForward
from lightmem.tiling import shard_lengths

assert DEFAULT_WINDOW_BYTES == parse_size(DEFAULT_PREFETCH, flag="prefetch")


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


