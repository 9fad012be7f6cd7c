"""Which module's forward is running, and whether its saved tensors may be offloaded."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightmem.matching import select_modules


class ModuleScope:
    """Follows ``include`` / ``exclude`` rules while forwards run.

    A tensor saved while a selected module's forward runs follows that module's rule; the
    innermost selected module wins, and ``exclude`` beats ``include`` on the same module. Outside
    every selected module the default applies: offload, unless ``include`` was given.

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
    ) -> None:
        self.default = include is None
        rules: dict[str, tuple[nn.Module, bool]] = {}
        if include:
            for name, module in select_modules(model, include, flag=include_flag).items():
                rules[name] = (module, True)
        if exclude:
            for name, module in select_modules(model, exclude, flag=exclude_flag).items():
                rules[name] = (module, False)
        self._rules = list(rules.values())
        self.allowed = self.default
        self.entered = 0  # selected modules entered since attach
        self._stack: list[bool] = []
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
        self.allowed = self.default
        self.entered = 0

    @torch.compiler.disable
    def _enter(self, rule: bool, module: nn.Module, args: Any) -> None:
        self._stack.append(self.allowed)
        self.allowed = rule
        self.entered += 1

    @torch.compiler.disable
    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.allowed = self._stack.pop() if self._stack else self.default
