"""What a lightmem configuration adds to a step's time, as the planner prices it.

Two costs: re-running checkpointed blocks (their forward FLOPs, or the FLOPs their policy
recomputes, over ``flops_per_s``) and the part of the host transfers that compute does not hide.
Transfers are priced on a timeline of the step, block by block in execution order:

- forward: each block computes for ``forward_flops / flops_per_s``; the bytes it offloads join the
  device-to-host queue when it ends, and the link drains that queue at ``link_bytes_per_s`` while
  later blocks compute;
- backward: blocks run in reverse, each for twice its forward time plus its re-run; a block's
  bytes come back on the host-to-device queue (the link is full duplex), not before they have
  left, and the block waits for them.

Step time with lightmem minus the compute of the same step without it is the cost. The model is
simple on purpose: it does not bound the bytes in flight (``max_inflight_bytes``, the prefetch
window), so it is optimistic where a single block moves more than the window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightmem.estimate.report import BlockMemory

KEEP, OFFLOAD, CHECKPOINT, BOTH = "keep", "offload", "checkpoint", "checkpoint+offload"


@dataclass(frozen=True)
class Costs:
    """The prices of one plan: device throughput, host link, and the offload threshold."""

    flops_per_s: float
    link_bytes_per_s: float
    min_bytes: int
    allow_offload: bool


@dataclass(frozen=True)
class StepTime:
    """Seconds a configuration adds to a step: re-computation and transfer not hidden by compute."""

    recompute_s: float
    exposed_transfer_s: float
    moved_bytes: int
    """Bytes sent to host (and back) per step."""

    @property
    def total_s(self) -> float:
        return self.recompute_s + self.exposed_transfer_s


def _kept_input(block: BlockMemory, costs: Costs) -> int:
    return block.input_bytes if block.input_bytes >= costs.min_bytes else 0


def saves_bytes(block: BlockMemory, action: str, costs: Costs) -> int:
    """Predicted activation bytes ``action`` takes off the device for ``block``."""
    if action == OFFLOAD:
        return block.offloadable_bytes(costs.min_bytes)
    if action == CHECKPOINT:
        return max(0, block.saved_bytes - block.input_bytes - block.kept_bytes)
    if action == BOTH:  # offload moves the input to host; the outputs a policy keeps stay on the device
        return max(0, block.saved_bytes - block.input_bytes - block.kept_bytes) + _kept_input(block, costs)
    return 0


def moved_bytes(block: BlockMemory, action: str, costs: Costs) -> int:
    """Bytes ``action`` sends to host for ``block``: what offload moves of what the block keeps."""
    if action == OFFLOAD:
        return block.offloadable_bytes(costs.min_bytes)
    if action == BOTH:
        return _kept_input(block, costs)
    return 0


def recompute_s(block: BlockMemory, costs: Costs) -> float:
    """Seconds a checkpointed block's re-run costs: the FLOPs its policy recomputes."""
    flops = block.forward_flops if block.recompute_flops is None else block.recompute_flops
    return flops / costs.flops_per_s


def block_cost_s(block: BlockMemory, action: str, costs: Costs) -> float:
    """One block's cost seen alone: its re-run, and the transfer its own compute does not hide
    (out while its forward runs, back while its backward, about twice as long, runs)."""
    forward_s = block.forward_flops / costs.flops_per_s
    transfer_s = moved_bytes(block, action, costs) / costs.link_bytes_per_s
    exposed = max(0.0, transfer_s - forward_s) + max(0.0, transfer_s - 2 * forward_s) if transfer_s else 0.0
    rerun = recompute_s(block, costs) if action in (CHECKPOINT, BOTH) else 0.0
    return rerun + exposed


def step_time(blocks: Mapping[str, BlockMemory], actions: Mapping[str, str], costs: Costs) -> StepTime:
    """The cost of ``actions`` (block name -> action; absent: keep) on the step's timeline.

    ``blocks`` must be in execution order (the estimator reports them so, with what runs outside
    every block last).
    """
    compute_s = [block.forward_flops / costs.flops_per_s for block in blocks.values()]
    moved = [moved_bytes(block, actions.get(name, KEEP), costs) for name, block in blocks.items()]
    rerun = [
        recompute_s(block, costs) if actions.get(name, KEEP) in (CHECKPOINT, BOTH) else 0.0
        for name, block in blocks.items()
    ]
    now = link_out = 0.0
    out_done = []
    for seconds, nbytes in zip(compute_s, moved):
        now += seconds
        if nbytes:
            link_out = max(link_out, now) + nbytes / costs.link_bytes_per_s
        out_done.append(link_out if nbytes else now)
    forward_end = now
    link_in = forward_end
    for index in reversed(range(len(compute_s))):
        ready = now
        if moved[index]:
            link_in = max(link_in, out_done[index]) + moved[index] / costs.link_bytes_per_s
            ready = link_in
        now = max(now, ready) + rerun[index] + 2 * compute_s[index]
    exposed = now - 3 * sum(compute_s) - sum(rerun)
    return StepTime(sum(rerun), max(0.0, exposed), sum(moved))
