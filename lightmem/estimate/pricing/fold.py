"""The one fold of per-block time: a traced step's priced ops, in the tracer's order, summed per
block and phase at a device's speeds.

The trace only logs what each op costs (``StepTrace.price_log``: its class, dtype, FLOPs and bytes,
``devices.op_cost``); ``priced_at`` turns that log into seconds at any ``DeviceSpeeds``. A step traced
once is priced at the settings' speeds, and again at a measured device's, by the same sum in the
same order, so both give the same seconds, bit for bit: every block's forward (the ops before the
first forward ended), backward and checkpointed re-run (an op-level policy's: the forward ops it
repeats), the optimizer step, and each ``aten`` op's share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightmem.devices import DeviceSpeeds
from lightmem.estimate.trace.blocks import ROOT_BLOCK
from lightmem.estimate.trace.step import StepTrace


def priced_at(trace: StepTrace, speeds: DeviceSpeeds) -> StepTrace:
    """``trace`` with its logged ops priced at ``speeds`` (the original is left as it is)."""
    seconds: dict[Any, float] = {}
    ops: dict[Any, int] = {}
    op_seconds: dict[str, tuple[float, int]] = {}
    recompute: dict[str, float] = {}
    recompute_ops: dict[str, int] = {}
    for index, (key, cost, name, block) in enumerate(trace.price_log):
        spent = speeds.op_seconds(*cost)
        total, calls = op_seconds.get(name, (0.0, 0))
        op_seconds[name] = (total + spent, calls + 1)
        if key[0] == "forward" and index >= trace.forward_priced_ops:
            continue  # a later forward (a manual step's second one): not the blocks' forward
        seconds[key] = seconds.get(key, 0.0) + spent
        ops[key] = ops.get(key, 0) + 1
        if block is not None:
            recompute[block] = recompute.get(block, 0.0) + spent
            recompute_ops[block] = recompute_ops.get(block, 0) + 1
    blocks = {
        name: dataclasses.replace(
            block, saved_sizes=list(block.saved_sizes), forward_s=0.0, backward_s=0.0, forward_ops=0, backward_ops=0,
            recompute_s=None if block.recompute_s is None else recompute.get(name, 0.0),
            recompute_ops=None if block.recompute_ops is None else recompute_ops.get(name, 0),
        )
        for name, block in trace.blocks.items()
    }  # fmt: skip
    for (phase, block), spent in seconds.items():
        if phase == "forward":
            blocks[block or ROOT_BLOCK].forward_s += spent
            blocks[block or ROOT_BLOCK].forward_ops += ops[(phase, block)]
        elif phase == "backward":
            blocks[block or ROOT_BLOCK].backward_s += spent
            blocks[block or ROOT_BLOCK].backward_ops += ops[(phase, block)]
    modules = {
        name: dataclasses.replace(module, forward_s=sum(speeds.op_seconds(*cost) for cost in module.costs))
        for name, module in trace.modules.items()
    }
    return dataclasses.replace(
        trace, blocks=blocks, op_seconds=op_seconds, optimizer_s=seconds.get(("optimizer", None), 0.0),
        priced_with=speeds, checkpointed=list(trace.checkpointed), modules=modules,
    )  # fmt: skip
