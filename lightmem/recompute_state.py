"""What a checkpointed block's recompute may see: never state that its forward changed.

A recompute runs a block's forward a second time, in backward. When that forward changes state
outside the block (a Hugging Face model's key/value cache appends the block's keys and values),
the recompute sees the changed state and changes it again: a grown cache makes attention run
over twice the keys (torch's checkpoint then fails on a different number or kind of ops) and
the cache the user got back grows in backward. Three rules keep the recompute exact:

- ``CacheOffInTraining``: a model whose forward takes ``use_cache`` and holds checkpointed blocks
  runs its training forwards with ``use_cache=False``, as Hugging Face's own
  ``gradient_checkpointing_enable()`` does, and says so once. The user's config is never written:
  eval forwards and generation keep their cache.
- A block that receives a model cache anyway (an eval forward with grad enabled, or a cache the
  user passes in training) runs that call without checkpointing: its forward updates the cache
  once and backward uses the saved activations.
- ``ArgumentStates``: any other argument that holds state (a dict, a list, an object holding
  tensors or counters) and that the block's forward changes is an error that names the block and
  the argument, raised when the forward ends, never a wrong gradient.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightmem.compiled import user_named_modules
from lightmem.config import warn_once


def _forward_parameters(module: nn.Module) -> list[inspect.Parameter]:
    # The class's forward: a checkpointed block's instance forward is lightmem's wrapper.
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())
    except (TypeError, ValueError):
        return []
    return parameters[1:]  # without self


class CacheOffInTraining:
    """A forward pre-hook: in training forwards (train mode, grad enabled) ``use_cache`` is False.

    Only the call's argument changes, never ``config.use_cache``, so nothing needs restoring
    after the forward (or after one that raised).
    """

    def __init__(self, module: nn.Module, parameters: list[inspect.Parameter]) -> None:
        index = [parameter.name for parameter in parameters].index("use_cache")
        parameter = parameters[index]
        positional = parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.position = index if positional else None
        self.default = parameter.default if parameter.default is not inspect.Parameter.empty else None
        self.model_name = type(module).__name__

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        if self.position is not None and len(args) > self.position:
            asked = args[self.position]
            args = (*args[: self.position], False, *args[self.position + 1 :])
        else:
            asked = kwargs.get("use_cache", self.default)
            kwargs = {**kwargs, "use_cache": False}
        if asked is None:  # Hugging Face resolves a missing use_cache from the config
            asked = getattr(getattr(module, "config", None), "use_cache", False)
        if asked:
            warn_once(
                f"lightmem: {self.model_name} runs its training forwards with use_cache=False while lightmem "
                "checkpoints blocks inside it (backward's recompute would fill the cache a second time); "
                "config.use_cache is left as you set it, so eval forwards and generation keep their cache"
            )
        return args, kwargs


def cache_off_in_training(model: nn.Module, block_names: Iterable[str]) -> list[torch.utils.hooks.RemovableHandle]:
    """Hook every module of ``model`` that holds (or is) a checkpointed block and takes ``use_cache``.

    The outer model passes ``use_cache=False`` down; inner models (``LlamaModel`` inside
    ``LlamaForCausalLM``) are hooked too, for steps that call them directly.
    """
    names = list(block_names)
    handles = []
    for name, module in user_named_modules(model):
        if not any(name == "" or block == name or block.startswith(f"{name}.") for block in names):
            continue
        parameters = _forward_parameters(module)
        if any(parameter.name == "use_cache" for parameter in parameters):
            hook = CacheOffInTraining(module, parameters)
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def is_model_cache(value: Any) -> bool:
    """A Hugging Face cache (``DynamicCache``, ``EncoderDecoderCache``, ``StaticCache``, ...)."""
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers.") for cls in type(value).__mro__
    )


def model_cache_argument(args: tuple, kwargs: dict) -> Any:
    """The model cache among a block's arguments, or None."""
    for value in (*args, *kwargs.values()):
        if value is not None and not isinstance(value, (torch.Tensor, bool, int, float, str)) and is_model_cache(value):
            return value
    return None


_ATOMS = (bool, int, float, complex, str, bytes, type(None))
_NOT_STATE = (nn.Module, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype,
              torch.device, torch.Size)  # fmt: skip
_MAX_DEPTH = 6
_MAX_NODES = 2000


def _fingerprint(value: Any, depth: int, budget: list[int], held: bool = False) -> Any:
    """What a block could change in ``value``: tensors by identity (and version, when held in a
    list, dict or object: state), atoms by value. Tuples are the block's inputs, not state."""
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        return ...
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version if held else None)
    if isinstance(value, (float, complex)):
        return repr(value)  # nan != nan: compare what it reads as
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, tuple):
        return (type(value), tuple(_fingerprint(item, depth + 1, budget, held) for item in value))
    if isinstance(value, list):
        return (list, tuple(_fingerprint(item, depth + 1, budget, True) for item in value))
    if isinstance(value, dict):
        return (type(value), tuple((key, _fingerprint(item, depth + 1, budget, True)) for key, item in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value), len(value))
    if isinstance(value, _NOT_STATE) or not hasattr(value, "__dict__"):
        return (type(value), id(value))
    fields = vars(value)
    return (type(value), tuple((key, _fingerprint(item, depth + 1, budget, True)) for key, item in fields.items()))


def _holds_state(value: Any) -> bool:
    if isinstance(value, tuple):
        return any(_holds_state(item) for item in value)
    return not isinstance(value, (torch.Tensor, *_ATOMS, *_NOT_STATE)) and (
        isinstance(value, (list, dict, set)) or hasattr(value, "__dict__")
    )


class ArgumentStates:
    """The state a block's arguments hold before its forward, to check that the forward left it alone.

    Tensors passed directly or in tuples are the block's inputs (checkpoint keeps them); lists,
    dicts and objects are state the recompute would read again.
    """

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.before: list[tuple[Any, Any, Any]] = [
            (position, value, _fingerprint(value, 0, [_MAX_NODES]))
            for position, value in (*enumerate(args), *kwargs.items())
            if _holds_state(value)
        ]

    def check(self, block_name: str, block_class: str, forward: Any) -> None:
        """Raises RuntimeError naming the block and the first argument its forward changed."""
        for position, value, before in self.before:
            if _fingerprint(value, 0, [_MAX_NODES]) != before:
                argument = _argument_name(forward, position)
                raise RuntimeError(
                    f"lightmem: checkpointed block {block_name or block_class!r} "
                    f"({block_class}) changed its argument {argument} ({type(value).__name__}) "
                    "during forward; backward's recompute would read that changed state and change it again, "
                    "so its gradients would be wrong. Keep such state out of the block's arguments in training "
                    "(for a cache: use_cache=False), or leave the block out of checkpointing"
                )


def _argument_name(forward: Any, position: Any) -> str:
    if isinstance(position, str):
        return repr(position)
    try:
        names = [
            name
            for name, parameter in inspect.signature(forward).parameters.items()
            if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        names = []
    return repr(names[position]) if position < len(names) else f"at position {position}"
