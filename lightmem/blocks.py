"""A model's blocks: its repeated layers, at whatever depth they sit, and the modules around them.

The estimator reports and the planner acts on these units; ``LightMem`` compiles a model captured
whole one block at a time along them (``lightmem.compile_blocks``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from torch import nn

from lightmem.compiled import user_module_name

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


class _Layers:
    """What ``find_blocks`` asks of each module of one model, each answer worked out once (asked from
    every ancestor, a nested container's answers cost time exponential in the depth)."""

    def __init__(self) -> None:
        self._repeats: dict[int, bool] = {}
        self._holds: dict[int, bool] = {}

    def repeats(self, container: nn.Module) -> bool:
        """A container holds repeated layers: two of its layers share a class."""
        key = id(container)
        if key not in self._repeats:
            classes = [type(child) for child in container.children() if self.is_layer(child)]
            self._repeats[key] = len(classes) != len(set(classes))
        return self._repeats[key]

    def holds_repeats(self, module: nn.Module) -> bool:
        """A container that repeats is ``module`` itself or somewhere inside it."""
        key = id(module)
        if key not in self._holds:
            self._holds[key] = (isinstance(module, _CONTAINERS) and self.repeats(module)) or any(
                self.holds_repeats(child) for child in module.children()
            )
        return self._holds[key]

    def is_stage(self, module: nn.Module) -> bool:
        """A plain container (``Sequential``, ``ModuleList``, ``ModuleDict``) holding repeated layers
        somewhere inside: a group of layers (a ResNet stage), opened, never a layer itself."""
        return isinstance(module, _CONTAINERS) and self.holds_repeats(module)

    def is_layer(self, module: nn.Module) -> bool:
        """A candidate repeated layer: a module with parameters that is not a group of layers."""
        return _has_parameters(module) and not self.is_stage(module)


@dataclass
class Blocks:
    """The units the estimator reports and the planner acts on, by qualified name."""

    modules: dict[str, nn.Module]
    repeated: set[str]
    """Names of the repeated layers: children of a container that holds several of their class."""

    def kind(self, name: str) -> str:
        return type(self.modules[name]).__name__


def find_blocks(model: nn.Module) -> Blocks:
    """The model's repeated layers, at whatever depth they sit, and the modules around them.

    The tree is opened down to the outermost containers (``ModuleList``, ``Sequential``,
    ``ModuleDict``) whose children repeat a class: those children are blocks
    (``transformer.h.0``, ``model.layers.3``, ``bert.encoder.layer.1``, ``net.3``), each one a
    unit to checkpoint. A module holding no repeated layers is a block as a whole; a module
    holding some is opened. A root whose parameters all live in one child (a LightningModule
    around its model) is looked through. A module reachable by several names (tied embeddings)
    is one block, under its first name.
    """
    prefix = ""
    root = model
    while True:
        children = list(root.named_children())
        with_params = [(name, child) for name, child in children if _has_parameters(child)]
        own = any(True for _ in root.parameters(recurse=False))
        if len(with_params) == 1 and not own and not isinstance(with_params[0][1], _CONTAINERS):
            name, root = with_params[0]
            prefix = f"{prefix}{name}."
            continue
        break
    found = Blocks({}, set())
    seen: set[int] = set()
    layers = _Layers()

    def add(name: str, module: nn.Module, repeated: bool) -> None:
        if id(module) not in seen:
            seen.add(id(module))
            found.modules[name] = module
            if repeated:
                found.repeated.add(name)

    def visit(name: str, module: nn.Module) -> None:
        if isinstance(module, _CONTAINERS) and layers.repeats(module):
            classes = collections.Counter(type(layer) for layer in module.children() if layers.is_layer(layer))
            for inner, layer in module.named_children():
                if layers.is_stage(layer):  # a stage beside layers: opened in turn
                    visit(f"{name}.{inner}", layer)
                else:
                    add(f"{name}.{inner}", layer, classes[type(layer)] > 1)
        elif isinstance(module, _CONTAINERS) or layers.holds_repeats(module):
            for inner, child in module.named_children():
                visit(f"{name}.{inner}", child)
        else:
            add(name, module, False)

    for name, child in root.named_children():
        visit(f"{prefix}{name}", child)
    # The names the user wrote, also on a compiled model: they are checkpoint targets for the plan.
    return Blocks(
        {user_module_name(name): module for name, module in found.modules.items()},
        {user_module_name(name) for name in found.repeated},
    )
