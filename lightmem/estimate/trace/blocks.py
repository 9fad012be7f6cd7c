"""The blocks a fake step runs through: which top-level block runs (``BlockTracker``) and what
each kept for backward at the end of forward (``BlockMemory``, the one record of a block's
memory and cost, which reports and plans read)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightmem.estimate.trace.op_chain import attention_scores
from lightmem.estimate.trace.records import BUFFER, PARAMETER
from lightmem.estimate.trace.tracer import StorageTracer
from lightmem.tiling.function import rerunning


@dataclass
class BlockMemory:
    """One block (a repeated layer, or a module around them): what autograd keeps of it at the
    end of forward, and its cost. The trace fills it as the step runs (its seconds and priced ops
    at a device's speeds: ``lightmem.estimate.pricing.fold``); reports and plans read it."""

    name: str
    saved_bytes: int = 0
    forward_flops: float = 0.0
    input_bytes: int = 0
    saved_sizes: list[int] = field(default_factory=list, repr=False)
    kind: str = ""
    """The block's class name ("GPT2Block"); empty for what runs outside every block."""
    repeated: bool = False
    """One of the model's repeated layers: what the planner checkpoints."""
    kept_bytes: int = 0
    """Bytes of op outputs a checkpointed block keeps besides its input (op-level policies)."""
    recompute_flops: float | None = None
    """Forward FLOPs a checkpointed re-run repeats; None: all of ``forward_flops`` ("full")."""
    forward_s: float = 0.0
    """Predicted device seconds of its forward, priced op by op (0: not priced)."""
    backward_s: float = 0.0
    """Predicted device seconds of its backward."""
    recompute_s: float | None = None
    """Seconds a checkpointed re-run repeats; None: all of ``forward_s`` ("full")."""
    forward_ops: int = 0
    """Priced ops of its forward: what the host launches (0: not priced)."""
    backward_ops: int = 0
    """Priced ops of its backward."""
    recompute_ops: int | None = None
    """Priced ops a checkpointed re-run repeats; None: all of ``forward_ops`` ("full")."""

    @property
    def label(self) -> str:
        """``transformer.h.3 (GPT2Block)``."""
        return f"{self.name} ({self.kind})" if self.kind else self.name

    def offloadable_bytes(self, min_bytes: int) -> int:
        """Saved bytes in storages of at least ``min_bytes`` (what offload would move)."""
        return sum(size for size in self.saved_sizes if size >= min_bytes)


ROOT_BLOCK = "(outside blocks)"


@dataclass
class SavedTensor:
    shape: tuple[int, ...]
    nbytes: int
    block: str
    attention_scores: bool = False
    """Made between a product of two activations (query and key) and its softmax, or from that
    softmax's output (``lightmem.estimate.trace.op_chain.attention_scores``)."""


class BlockTracker:
    """Which top-level block runs (forward), which one backward is in, and forward re-runs.

    Global module hooks see every module call; the block names are looked up by module identity.
    During backward, any module forward is a re-run by activation checkpointing.
    """

    def __init__(
        self, tracer: StorageTracer, block_names: dict[int, str], module_failed: Callable[[nn.Module, BaseException], None]
    ) -> None:
        self.tracer = tracer
        self.module_failed = module_failed
        self.block_names = block_names
        self.stack: list[str] = []
        self.depth = 0
        self.input_bytes: dict[str, int] = {}
        self._handles: list[Any] = []

    def current(self) -> str | None:
        if self.tracer.context.phase == "backward":
            return self.tracer.forward_block if self.tracer.in_recompute else self.tracer.backward_block
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> BlockTracker:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module: nn.Module, args: Any) -> None:
        tracer = self.tracer
        self.depth += 1
        if tracer.context.phase == "backward":
            tracer.in_recompute = True
            tracer.in_tile_rerun = tracer.in_tile_rerun or rerunning()
        name = self.block_names.get(id(module))
        if name is not None:
            self.stack.append(name)
            tracer.forward_block = name
            if tracer.context.phase == "forward" and name not in self.input_bytes:
                seen: set[int] = set()
                total = 0
                for arg in args:
                    if isinstance(arg, torch.Tensor) and id(arg.untyped_storage()) not in seen:
                        seen.add(id(arg.untyped_storage()))
                        total += tracer.record_of(arg).nbytes
                self.input_bytes[name] = total
        if tracer.watch is not None and tracer.context.phase == "forward":
            tracer.watch.enter(module, args, tracer.forward_block)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        tracer = self.tracer
        error = sys.exc_info()[1]
        if error is not None:  # called from Module.__call__'s except clause: the forward raised
            self.module_failed(module, error)
        self.depth -= 1
        if tracer.watch is not None and tracer.context.phase == "forward":
            tracer.watch.exit(module, output)
        name = self.block_names.get(id(module))
        if name is not None and self.stack and self.stack[-1] == name:
            self.stack.pop()
            tracer.forward_block = self.stack[-1] if self.stack else None
            if tracer.context.phase == "forward":
                for leaf in torch.utils._pytree.tree_leaves(output):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        leaf.register_hook(lambda grad, name=name: self._backward_enters(name))
        if self.depth <= 0:
            self.depth = 0
            tracer.in_recompute = tracer.in_tile_rerun = False
            if tracer.context.phase != "backward":
                tracer.forward_block = None

    def _backward_enters(self, name: str) -> None:
        self.tracer.backward_block = name


def forward_end_usage(
    tracer: StorageTracer, tracker: BlockTracker
) -> tuple[dict[str, BlockMemory], list[SavedTensor], int]:
    """Per-block saved bytes still alive at the end of forward, and the saved tensors' shapes; a
    block that ran priced ops has its entry too (its seconds are folded in by the pricing)."""
    usage = {name: BlockMemory(name) for name in tracker.block_names.values()}
    saved: list[SavedTensor] = []
    total = 0
    scores = attention_scores(tracer) if tracer.softmaxes else set()
    for rid in tracer.saved:
        record = tracer.records[rid]
        if record.freed or record.saved_at < tracer.window.start or record.role in (PARAMETER, BUFFER):
            continue
        block = record.saved_block or ROOT_BLOCK
        entry = usage.setdefault(block, BlockMemory(block))
        entry.saved_bytes += record.nbytes
        entry.saved_sizes.append(record.nbytes)
        total += record.nbytes
        saved.append(SavedTensor(record.saved_shape or (), record.nbytes, block, rid in scores))
    for name, flops in tracer.block_flops.items():
        usage.setdefault(name or ROOT_BLOCK, BlockMemory(name or ROOT_BLOCK)).forward_flops += flops
    priced_blocks(usage, tracer.price_log, "forward")
    for name, nbytes in tracker.input_bytes.items():
        usage[name].input_bytes = nbytes
    if tracer.op_policy is not None:
        for name, entry in usage.items():
            entry.kept_bytes = tracer.block_kept_bytes.get(name, 0)
            entry.recompute_flops = tracer.block_recompute_flops.get(name, 0.0)
            entry.recompute_s, entry.recompute_ops = 0.0, 0  # what its re-run repeats: priced by the fold
    return usage, saved, total


def priced_blocks(usage: dict[str, BlockMemory], price_log: Sequence[Sequence[Any]], phase: str) -> None:
    """An entry in ``usage`` for every block that ran priced ops in ``phase``, in the order they ran."""
    for (logged_phase, block), *_ in price_log:
        if logged_phase == phase:
            name = block or ROOT_BLOCK
            if name not in usage:
                usage[name] = BlockMemory(name)
