"""The one fold of per-block time: a traced step's priced ops, in the tracer's order, summed per
block and phase at a device's speeds."""

from __future__ import annotations

import dataclasses
from typing import Any

from lightmem.devices import DeviceSpeeds
from lightmem.estimate.trace.blocks import ROOT_BLOCK
from lightmem.estimate.trace.step import StepTrace


def reprice(trace: StepTrace, speeds: DeviceSpeeds) -> StepTrace:
    """``trace``, a priced step that re-ran no block, as if traced at ``speeds``: each priced op of
    its log priced again and summed in the tracer's order, so the seconds are those a new trace at
    ``speeds`` gives, bit for bit (its memory does not depend on prices)."""
    assert trace.priced_with is not None and not trace.checkpointed
    seconds: dict[Any, float] = {}
    op_seconds: dict[str, tuple[float, int]] = {}
    recompute: dict[str, float] = {}
    for key, cost, name, block in trace.price_log:
        spent = speeds.op_seconds(*cost)
        total, ops = op_seconds.get(name, (0.0, 0))
        op_seconds[name] = (total + spent, ops + 1)
        seconds[key] = seconds.get(key, 0.0) + spent
        if block is not None:
            recompute[block] = recompute.get(block, 0.0) + spent
    blocks = {
        name: dataclasses.replace(
            usage, saved_sizes=list(usage.saved_sizes), forward_s=0.0, backward_s=0.0,
            recompute_s=None if usage.recompute_s is None else recompute.get(name, 0.0),
        )
        for name, usage in trace.blocks.items()
    }  # fmt: skip
    for (phase, block), spent in seconds.items():  # as forward_end_usage and steady_step add them
        if phase == "forward":
            blocks[block or ROOT_BLOCK].forward_s += spent
        elif phase == "backward":
            blocks[block or ROOT_BLOCK].backward_s += spent
    return dataclasses.replace(
        trace, blocks=blocks, op_seconds=op_seconds, optimizer_s=seconds.get(("optimizer", None), 0.0),
        priced_with=speeds, checkpointed=list(trace.checkpointed),
    )  # fmt: skip
