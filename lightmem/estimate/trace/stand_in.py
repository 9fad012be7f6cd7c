"""The model the dry run runs: a stand-in with its own Python state, so planning leaves no trace.

The estimator runs the user's code (``configure_optimizers``, ``training_step``, the hooks around
it, metrics) on fake tensors. Run on the user's own module, that code writes to the module: it
keeps the dry run's optimizer and scheduler in ``self.my_opt``, appends a fake loss to a list,
advances a counter, updates a metric's state. ``stand_in`` builds a twin of the module tree
instead, and the dry run runs on the twin:

- every module of the tree has a twin of its own class, whose parameters and buffers are the dry
  run's fakes (tied weights stay tied) and whose children are twins;
- every other attribute is a deep copy, made within one memo for the whole tree, so attributes that
  shared an object still share one (a list held by two modules, a module referenced from another:
  its twin), and a bound method of a module in the tree is bound to its twin;
- a tensor met in that copy (a cache, a metric's state, a parameter held outside the tree) becomes
  a fake on the dry run's device, never a copy of its data (``known_value`` keeps a one-element
  tensor's value, which steps read as a number);
- hooks registered on the modules follow the attributes: a hook bound to a module of the tree is
  bound to its twin, one bound to an object an attribute holds to its copy, any other is shared;
- lightmem's own machinery set on a module (offload hooks, a block clock) is shared: it holds host
  memory and streams by handle, and the dry run runs its own; plain-state wrappers the step reads
  through the module (a checkpoint or tiling wrapper, a chunked loss's handle) are copied;
- an optimizer is copied whole but for the callables set on it (``_copy_optimizer``), and in a fit
  the fit's own optimizers and schedulers are copied with the tree (``with_it``), so the twin's
  ``self.my_opt`` is the dry run's ``self.optimizers()``;
- the module's Trainer is replaced by the dry run's (``lightmem.estimate.trace.user_code.DryRunTrainer``);
- what cannot be copied (a lock, an open file, a C object without a copy) and heavy objects that
  a step reads but does not write (data loaders, datasets, data modules, loggers, callbacks) are
  shared: ``StandIn.shared`` names them.

A compiled module's twin runs eagerly (``torch.compile`` binds the compiled callable to the real
module; the dry run's modes run it eagerly anyway). What the copy cannot reach stays the user's:
globals, class attributes, and objects reached only through closures.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

from lightmem.estimate.trace.dry_run_device import DRY_RUN_DEVICE, known_value
from lightmem.lightning_packages import imported_classes

_STRUCTURE = ("_parameters", "_buffers", "_modules")
_HOOKS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


def _shared_types() -> tuple[type, ...]:
    """Objects a step reads but does not write, each possibly holding a dataset: shared, not copied."""
    found: list[type] = [torch.utils.data.DataLoader, torch.utils.data.Dataset, torch.utils.data.Sampler]
    for module, name in (("", "LightningDataModule"), ("loggers", "Logger"), ("callbacks", "Callback"), ("", "Trainer")):
        found.extend(imported_classes(module, name))
    return tuple(found)


@dataclass
class StandIn:
    """The twin of a module tree (``module``), and what its copy could not make its own."""

    module: nn.Module
    twins: dict[int, nn.Module]
    """id of each module of the real tree -> its twin."""
    shared: list[str] = field(default_factory=list)
    """``module.attribute`` paths left shared with the real modules."""
    fakes: list[torch.Tensor] = field(default_factory=list)
    """The fakes made of tensors met in the copy (not parameters or buffers)."""
    copies: list[Any] = field(default_factory=list)
    """The copies of ``stand_in(with_it=...)``."""

    def twin(self, module: nn.Module) -> nn.Module:
        return self.twins[id(module)]


class _TensorsAsFakes(TorchFunctionMode):
    """While the attributes are copied: a tensor's copy is a fake on the dry run's device."""

    def __init__(self, fake_mode: FakeTensorMode, made: list[torch.Tensor]) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.made = made

    def fake(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, FakeTensor):
            return tensor
        fake = known_value(self.fake_mode, tensor)
        if fake is None:
            with unset_fake_temporarily():
                meta = tensor.detach().to("meta")
            fake = self.fake_mode.fake_tensor_converter.from_meta_and_device(self.fake_mode, meta, DRY_RUN_DEVICE)
        self.made.append(fake)
        return fake

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__deepcopy__:
            tensor, memo = args[0], args[1] if len(args) > 1 else kwargs.get("memo", {})
            fake = self.fake(tensor)
            if type(tensor) is nn.Parameter or isinstance(tensor, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = fake
            return fake
        if func is torch.Tensor.clone and args and not isinstance(args[0], FakeTensor):
            return self.fake(args[0])  # nn.Parameter.__deepcopy__ clones its data
        return func(*args, **kwargs)


def stand_in(
    model: nn.Module,
    fakes: dict[int, torch.Tensor],
    fake_mode: FakeTensorMode,
    replacements: dict[int, Any] | None = None,
    attributes: Callable[[nn.Module, dict[str, Any]], None] | None = None,
    with_it: tuple[Any, ...] = (),
) -> StandIn:
    """A twin of ``model``'s tree (module docstring).

    Args:
        fakes: id of each real parameter and buffer -> the fake its twin holds.
        replacements: id of an object -> what the twins hold in its place (the Trainer -> the dry
            run's), wherever the copy meets it.
        attributes: called with each LightningModule twin and its ``__dict__`` to set what the dry
            run gives it in place of the real one (its Trainer, ``log``).
        with_it: objects copied within the same memo after the tree (the fit's optimizers and
            schedulers): ``StandIn.copies``, the very objects the twins' attributes hold where they
            held the originals.
    """
    memo: dict[int, Any] = dict(fakes)
    memo.update(replacements or {})
    modules = list(dict.fromkeys(model.modules()))
    twins: dict[int, nn.Module] = {}
    for module in modules:
        twins[id(module)] = memo[id(module)] = object.__new__(type(module))
    found = StandIn(twins[id(model)], twins)
    shared_types = _shared_types()
    copier = _TensorsAsFakes(fake_mode, found.fakes)
    with copier:
        for value in with_it:  # first: an attribute that holds one holds its copy
            _seed_tensors(value, memo, copier)
        for name, module in ((name, m) for name, m in model.named_modules(remove_duplicate=True)):
            twin = twins[id(module)]
            state: dict[str, Any] = {}
            for key, value in vars(module).items():
                if key in _STRUCTURE:
                    state[key] = {inner: memo.get(id(item), item) if item is not None else None for inner, item in value.items()}
                elif key in _HOOKS:
                    state[key] = value  # copied below, once every attribute is
                elif isinstance(value, shared_types) or isinstance(value, types.ModuleType) or _lightmems(value):
                    state[key] = value
                else:
                    _seed_tensors(value, memo, copier)
                    try:
                        state[key] = _copy_value(value, memo)
                    except Exception:  # noqa: BLE001 - anything that cannot be copied is shared
                        state[key] = value
                        found.shared.append(f"{name or type(module).__name__}.{key}")
            twin.__dict__.update(state)
            if attributes is not None:
                attributes(twin, twin.__dict__)
        for twin in twins.values():  # a hook's owner copied with the attributes is that copy
            for key in _HOOKS:
                hooks = twin.__dict__.get(key)
                if hooks:
                    twin.__dict__[key] = type(hooks)((handle, _copied_hook(hook, memo)) for handle, hook in hooks.items())
        found.copies = [copy.deepcopy(value, memo) for value in with_it]
    for module in modules:
        _run_eagerly(twins[id(module)])
    return found


def _copy_optimizer(optimizer: torch.optim.Optimizer, memo: dict[int, Any]) -> torch.optim.Optimizer:
    """An optimizer's copy, its whole ``__dict__`` (``Optimizer.__getstate__`` keeps three keys and
    loses what a subclass sets, such as LBFGS's ``_params``), less the callables set on the instance:
    a scheduler's wrapper of ``step`` is bound to the original, which the copy must never step."""
    twin = object.__new__(type(optimizer))
    memo[id(optimizer)] = twin
    state = {key: value for key, value in vars(optimizer).items() if not callable(value)}
    twin.__dict__.update(copy.deepcopy(state, memo))
    return twin


def _seed_tensors(value: Any, memo: dict[int, Any], copier: _TensorsAsFakes, depth: int = 4) -> None:
    """The fakes of the tensors an attribute holds in plain containers, and the copies of its
    optimizers, put in the memo before the copy: ``copy`` then never calls a tensor's own
    ``__deepcopy__`` (a tensor subclass may define one), nor ``Optimizer.__getstate__`` (``_copy_optimizer``)."""
    if isinstance(value, torch.optim.Optimizer):
        if id(value) not in memo:
            _copy_optimizer(value, memo)
    elif isinstance(value, torch.Tensor):
        if id(value) not in memo:
            fake = copier.fake(value)
            memo[id(value)] = nn.Parameter(fake, requires_grad=value.requires_grad) if isinstance(value, nn.Parameter) else fake
    elif depth and isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _seed_tensors(item, memo, copier, depth - 1)
    elif depth and isinstance(value, dict):
        for item in value.values():
            _seed_tensors(item, memo, copier, depth - 1)


def _copy_value(value: Any, memo: dict[int, Any]) -> Any:
    """An attribute's copy: a function or a partial set on a module with what it closes over copied
    too (``_copy_function``), anything else by ``copy.deepcopy``."""
    if isinstance(value, types.FunctionType):
        return _copy_function(value, memo)
    if isinstance(value, functools.partial):
        return functools.partial(
            _copy_value(value.func, memo), *copy.deepcopy(value.args, memo), **copy.deepcopy(value.keywords, memo)
        )
    return copy.deepcopy(value, memo)


def _copy_function(function: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
    """A function set on a module (``module.training_step = lambda ...``) with what its closure
    holds copied as the module's attributes are (``deepcopy`` keeps a function as it is, and its
    closure would reach the real module)."""
    if not function.__closure__:
        return function
    cells = tuple(types.CellType(copy.deepcopy(cell.cell_contents, memo)) for cell in function.__closure__)
    copied = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__, cells)
    copied.__kwdefaults__ = function.__kwdefaults__
    copied.__dict__.update(function.__dict__)
    return copied


def _lightmems(value: Any) -> bool:
    """lightmem's own machinery set on a module (an offloader's hooks, a block clock): shared, never
    copied. It holds host memory, streams and threads by handle, and the dry run makes its own (a copy
    would free what the original still owns). A class of plain state that the step reads through
    the module (a checkpoint wrapper, a chunked loss's handle) says ``dry_run_copies = True``."""
    if isinstance(value, functools.partial):
        return _lightmems(value.func)
    if isinstance(value, types.FunctionType):  # a closure over lightmem's objects
        return (value.__module__ or "").startswith("lightmem.")
    owner = value.__self__ if isinstance(value, types.MethodType) else value
    if isinstance(owner, (nn.Module, torch.Tensor)):  # a tensor of lightmem's testing kinds is a tensor
        return False
    kind = type(owner)
    return kind.__module__.startswith("lightmem.") and not getattr(kind, "dry_run_copies", False)


def _copied_hook(hook: Any, memo: dict[int, Any]) -> Any:
    """A hook as the attributes were copied: bound to a module of the tree, bound to its twin; bound
    to an object an attribute holds, bound to the same copy; otherwise the hook itself (a function,
    lightmem's own machinery, an object the attributes do not hold)."""
    if _lightmems(hook):
        return hook
    if isinstance(hook, types.MethodType) and id(hook.__self__) in memo:
        return types.MethodType(hook.__func__, memo[id(hook.__self__)])
    if isinstance(hook, (types.FunctionType, functools.partial)):
        try:
            return _copy_value(hook, memo)
        except Exception:  # noqa: BLE001 - shared, as any attribute that cannot be copied
            return hook
    return hook


def _run_eagerly(twin: nn.Module) -> None:
    """A compiled module's twin calls its own module, eagerly: ``torch.compile`` bound the compiled
    callable (``OptimizedModule.forward``, ``Module.compile``'s ``_compiled_call_impl``) to the real
    module."""
    if getattr(twin, "_compiled_call_impl", None) is not None:
        twin._compiled_call_impl = None
    inner = twin.__dict__.get("_modules", {}).get("_orig_mod")
    if inner is not None and "forward" in twin.__dict__ and type(twin).__name__ == "OptimizedModule":
        twin.__dict__["forward"] = inner.__call__
