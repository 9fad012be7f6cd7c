"""Which module's forward is running, and from what size its saved tensors may be offloaded."""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightmem.matching import select_modules


NEVER = sys.maxsize
"""The threshold of a module whose saved tensors never move."""


class ModuleScope:
    """Follows ``include`` / ``exclude`` rules while forwards run.

    A tensor saved while a selected module's forward runs follows that module's rule; the
    innermost selected module wins, and ``exclude`` beats ``include`` on the same module. Outside
    every selected module the default applies: offload, unless ``include`` was given. A rule is a
    threshold (``threshold``): the bytes a saved tensor's storage needs to move, 0 for an included
    module without one of its own (the offloader's ``min_bytes`` applies), ``NEVER`` when excluded.

    Under ``torch.compile`` a selected module's saved tensors reach the hooks only when the compiled
    graph around them ends, after a traced forward hook would have left the module: the hooks are
    therefore never compiled, so Dynamo breaks the graph at each selected module's boundaries and
    its saves are packed while its rule holds.
    """

    def __init__(
        self,
        model: nn.Module,
        include: tuple[str, ...] | None,
        exclude: tuple[str, ...] | None,
        *,
        include_flag: str,
        exclude_flag: str,
        include_min_bytes: tuple[int, ...] | None = None,
    ) -> None:
        self.default = 0 if include is None else NEVER
        rules: dict[str, tuple[nn.Module, int]] = {}
        if include:
            if include_min_bytes is None:
                for name, module in select_modules(model, include, flag=include_flag).items():
                    rules[name] = (module, 0)
            else:
                for pattern, threshold in zip(include, include_min_bytes):
                    for name, module in select_modules(model, (pattern,), flag=include_flag).items():
                        rules[name] = (module, threshold)
        if exclude:
            for name, module in select_modules(model, exclude, flag=exclude_flag).items():
                rules[name] = (module, NEVER)
        self._rules = list(rules.values())
        self.threshold = self.default
        self.entered = 0  # selected modules entered since attach
        self._stack: list[int] = []
        self._handles: list[RemovableHandle] = []

    def attach(self) -> None:
        for module, rule in self._rules:
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, rule)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        self.threshold = self.default
        self.entered = 0

    @torch.compiler.disable
    def _enter(self, rule: int, module: nn.Module, args: Any) -> None:
        self._stack.append(self.threshold)
        self.threshold = rule
        self.entered += 1

    @torch.compiler.disable
    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.threshold = self._stack.pop() if self._stack else self.default
