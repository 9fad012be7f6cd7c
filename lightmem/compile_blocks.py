"""Compile at block granularity: what lightmem does with a model that ``torch.compile`` captures whole.

AOTAutograd hands a compiled graph's saved tensors to the saved-tensor hooks only when the graph has
run, so with a model captured whole, offload sees every activation of the forward at once, after
all of them were on the device together: the copies are paid and the peak stays (measured on CPU
with ``benchmarks/compile.py``, a GPT of 8 blocks under inductor: saved bytes on the device at once
with offload, 96% of the no-offload figure compiled whole, 5% in eager, 12% split at its blocks).
Compiled one block at a time, a graph holds one block's activations until it ends.

``BlockCompile`` gets there without touching the user's compile call: each block gets a forward
pre-hook that Dynamo may not trace, so Dynamo ends the graph before the block and compiles the block's
forward as a frame of its own, with the same compile options (the frames called from a compiled
module are compiled by the same ``torch.compile`` call). The blocks are the repeated layers the
estimator finds (``lightmem.blocks``). Nothing is recompiled from step to step: the graphs never
change. ``offload_activations`` (and so ``LightMem``) does this while offload is active.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightmem.blocks import find_blocks
from lightmem.compiled import is_compiled_module, user_named_modules


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
    return {name: module for name, module in found.modules.items() if name in found.repeated}


@torch.compiler.disable
def _graph_boundary(module: nn.Module, args: Any) -> None:
    """Does nothing; Dynamo may not trace it, so a graph ends before the module it is hooked on."""


class BlockCompile:
    """A model compiled whole, to be compiled one block at a time while offload is active.

    ``attach()`` puts a boundary pre-hook on each block, ``detach()`` takes them off. Graphs Dynamo
    compiles while they are on end before each block; the break stays in the compiled code, and an
    eager call of a block runs the hooks present then, so attaching around each forward suffices.
    Dynamo does not guard on module hooks: a graph compiled before the first ``attach()`` keeps the
    whole model (``torch._dynamo.reset()`` recompiles it).
    """

    def __init__(self, name: str, blocks: dict[str, nn.Module]) -> None:
        self.blocks = blocks
        what = f"module {name!r}" if name else "the model"
        names = list(blocks)
        self.message = (
            f"lightmem: {what} is compiled whole; with activation offload on, it is compiled one block at a time "
            f"instead ({len(names)} blocks: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), with your "
            "compile options, so each block's activations leave the device when the block has run."
        )
        self._handles: list[RemovableHandle] = []

    def attach(self) -> None:
        self.detach()
        self._handles = [block.register_forward_pre_hook(_graph_boundary) for block in self.blocks.values()]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def block_compile(model: nn.Module) -> tuple[BlockCompile | None, str | None]:
    """How to compile ``model`` one block at a time, and why not when it cannot be (a message):
    ``(None, None)`` when no module of ``model`` is compiled whole around repeated blocks."""
    found = whole_model_compile(model)
    if found is None:
        return None, None
    name, compiled = found
    if fullgraph(compiled):
        what = f"module {name!r}" if name else "the model"
        return None, (
            f"lightmem: {what} is compiled whole with fullgraph=True, so offload sees its saved tensors only when "
            "the whole forward has run and the device peak does not fall; compile each block instead "
            "(torch.compile(block) for each repeated layer) or drop fullgraph=True"
        )
    return BlockCompile(name, repeated_blocks(model)), None


def split_at_blocks(blocks: dict[str, nn.Module]) -> BlockCompile:
    """Make ``torch.compile`` compile each of ``blocks`` as a graph of its own until ``detach()``
    (for a loop that compiles the model whole but gives ``offload_activations`` the uncompiled one)."""
    split = BlockCompile("", blocks)
    split.attach()
    return split
