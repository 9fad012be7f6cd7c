"""Compile at block granularity: what lightmem does with a model that ``torch.compile`` captures whole.

AOTAutograd hands a compiled graph's saved tensors to the saved-tensor hooks only when the graph has
run, so with a model captured whole, offload sees every activation of the forward at once, after
all of them were on the device together: the copies are paid and the peak stays (measured on a GPT
of 8 blocks: 93% of the no-offload residency compiled whole, 7% in eager). Compiled one block at a
time, a graph holds one block's activations until it ends.

``split_at_blocks`` gets there without touching the user's compile call: each block gets a forward
pre-hook that Dynamo may not trace, so Dynamo ends the graph before the block and compiles the block's
forward as a frame of its own, with the same compile options (the frames called from a compiled
module are compiled by the same ``torch.compile`` call). The blocks are the checkpointed ones when
lightmem checkpoints, else the repeated layers the estimator finds. Nothing is recompiled from step
to step: the hooks never change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightmem.compiled import is_compiled_module, user_named_modules
from lightmem.estimate.step import find_blocks


def whole_model_compile(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost module of ``model`` compiled whole that holds repeated blocks, by its user name.

    ``torch.compile(module)`` (an ``OptimizedModule``) and ``module.compile()`` both count; a model
    whose blocks are compiled one by one (torchtitan's way) does not.
    """
    for name, module in model.named_modules():
        inner = module._orig_mod if is_compiled_module(module) else module
        compiled = inner is not module or getattr(module, "_compiled_call_impl", None) is not None
        if compiled and find_blocks(inner).repeated:
            return _user_name(model, inner), module
    return None


def fullgraph(compiled: nn.Module) -> bool:
    """Whether ``compiled`` was compiled with ``fullgraph=True`` (a graph break is then an error)."""
    context = getattr(compiled, "dynamo_ctx", None)
    return bool(getattr(context, "fullgraph", False))


def _user_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in user_named_modules(model) if candidate is module)


def repeated_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The repeated layers of ``model`` by user name (``blocks.0``, ``transformer.h.3``)."""
    found = find_blocks(model)
    names = {id(module): name for name, module in user_named_modules(model)}
    return {names[id(found.modules[name])]: found.modules[name] for name in sorted(found.repeated, key=list(found.modules).index)}


@torch.compiler.disable
def _graph_boundary(module: nn.Module, args: Any) -> None:
    """Does nothing; Dynamo may not trace it, so a graph ends before the module it is hooked on."""


class BlockBoundaries:
    """The pre-hooks ``split_at_blocks`` put on the blocks; ``remove()`` takes them off."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        self.modules = list(blocks)
        self._handles: list[RemovableHandle] = [block.register_forward_pre_hook(_graph_boundary) for block in blocks.values()]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def split_at_blocks(blocks: dict[str, nn.Module] | Iterable[tuple[str, nn.Module]]) -> BlockBoundaries:
    """Make ``torch.compile`` compile each of ``blocks`` as a graph of its own (see the module doc)."""
    return BlockBoundaries(dict(blocks))
