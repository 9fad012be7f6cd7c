"""lightmem and ``torch.compile``: hooks Dynamo never traces, and the names users see.

Autograd calls lightmem's saved-tensor hooks from C++ whenever an op saves a tensor. When a model
breaks its graph, the code between two compiled graphs runs eagerly with Dynamo's frame callback
still installed, so every Python frame started there, a hook or a finalizer (``__del__``) run by a
reference count reaching zero included, is offered to Dynamo to compile. Tracing the offload engine
fails or recompiles without end (its state changes at every call). ``never_traced`` marks a
function so that Dynamo skips its frame and every frame it calls, at no cost per call.

``torch.compile(module)`` returns an ``OptimizedModule`` that holds the module as ``_orig_mod``, so
every name under it gains that part; ``user_named_modules`` gives the names the user wrote.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

_F = TypeVar("_F", bound=Callable[..., Any])

try:  # torch >= 2.6: a per-code-object strategy, read by Dynamo's frame evaluation in C
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    _SKIP_RECURSIVELY = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
except ImportError:  # pragma: no cover - older torch
    set_code_exec_strategy = None


def never_traced(function: _F) -> _F:
    """Dynamo neither compiles ``function`` nor anything it calls, whoever calls it.

    The frame strategy lives on the code object, so it holds for every bound method of a class
    and costs nothing per call (``torch.compiler.disable`` wraps the function: two more Python
    frames and four calls on every save, the fallback on a torch without frame strategies).
    """
    if set_code_exec_strategy is None:  # pragma: no cover - older torch
        return torch._dynamo.disable(function)
    set_code_exec_strategy(function.__code__, _SKIP_RECURSIVELY)
    return function


def user_module_name(name: str) -> str:
    """A module name as the user wrote the model: without the ``_orig_mod`` that ``torch.compile``
    puts under the module it wraps (``_orig_mod.blocks.0``, or ``blocks.0._orig_mod.attn`` when
    each block is compiled)."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _compiled_module_class() -> type | None:
    # Only once torch._dynamo is imported can a module be an OptimizedModule: no import here.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returned (an ``OptimizedModule``)."""
    wrapper = _compiled_module_class()
    return wrapper is not None and isinstance(module, wrapper)


def user_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` as the user wrote the model: the modules ``torch.compile``
    wrapped under their own names, without the wrappers."""
    wrapper = _compiled_module_class()
    for name, module in model.named_modules():
        if wrapper is None or not isinstance(module, wrapper):
            yield user_module_name(name), module


def holds_compiled_modules(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule was compiled: ``torch.compile(module)`` or ``module.compile()``."""
    return any(
        is_compiled_module(module) or getattr(module, "_compiled_call_impl", None) is not None
        for module in model.modules()
    )
