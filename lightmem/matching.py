"""Select modules of a model by class name, class, or glob over qualified module names.

Used by offload scoping (``include`` / ``exclude``), checkpoint targets and tile targets, so all
read the same way and fail the same way: a pattern that selects nothing is an error naming the closest names.
Names are the ones the user wrote, also on a compiled model (no ``_orig_mod``).
"""

from __future__ import annotations

import difflib
import functools
import fnmatch
from collections.abc import Iterable

from torch import nn

from lightmem.compiled import user_named_modules

Target = str | type


def _describe(target: Target) -> str:
    return target.__name__ if isinstance(target, type) else repr(target)


def target_matches(target: Target, name: str, module: nn.Module) -> bool:
    """True when ``module`` (qualified name ``name``) is selected by ``target``.

    A class selects its instances (subclasses included); a string selects modules whose class, or
    any class it derives from, has that name, or whose qualified name matches it as a glob
    (``"encoder.layers.*"``). Matching through base classes is what lets ``"GPT2Block"`` find the
    blocks after FSDP2's ``fully_shard`` swapped their class for a dynamic ``FSDPGPT2Block``
    subclass, and a user's ``MyBlock(GPT2Block)`` too. ``nn.Module`` and ``object`` themselves are
    not names a target can match.
    """
    if isinstance(target, type):
        return isinstance(module, target)
    return target in class_names(module) or fnmatch.fnmatchcase(name, target)


def class_names(module: nn.Module) -> frozenset[str]:
    """The names a class-name target matches: the module's class and its base classes (MRO)."""
    return _class_names(type(module))


@functools.lru_cache(maxsize=None)
def _class_names(cls: type) -> frozenset[str]:
    return frozenset(base.__name__ for base in cls.__mro__ if base not in (nn.Module, object))


def closest_names(target: Target, model: nn.Module, limit: int = 5) -> list[str]:
    """Module names and class names that look most like ``target``, for error messages."""
    key = target.__name__ if isinstance(target, type) else target
    modules = list(user_named_modules(model))
    module_names = [name for name, _ in modules if name]
    class_names = sorted({type(module).__name__ for _, module in modules})
    candidates = module_names + class_names
    close = difflib.get_close_matches(key, candidates, n=limit, cutoff=0.6)
    if not close:
        # A glob such as "layer.*" compares badly as a whole; try its literal prefix.
        prefix = key.split("*")[0].split("?")[0].split("[")[0].rstrip(".")
        close = [c for c in candidates if prefix and c.startswith(prefix)][:limit]
    return close


def select_modules(
    model: nn.Module, targets: Iterable[Target], *, flag: str
) -> dict[str, nn.Module]:
    """Return ``{qualified_name: module}`` for every module selected by any target, in module order.

    Raises:
        ValueError: when a target is neither a string nor an ``nn.Module`` class, or selects no
            module; the message names ``flag`` and lists the closest module and class names.
    """
    targets = list(targets)
    for target in targets:
        if not (isinstance(target, str) and target) and not (
            isinstance(target, type) and issubclass(target, nn.Module)
        ):
            raise ValueError(
                f"{flag}: expected class names, nn.Module classes or glob patterns over module "
                f"names; got {target!r}"
            )
    selected: dict[str, nn.Module] = {}
    hits = [0] * len(targets)
    for name, module in user_named_modules(model):
        for i, target in enumerate(targets):
            if target_matches(target, name, module):
                hits[i] += 1
                selected[name] = module
    for target, count in zip(targets, hits):
        if count == 0:
            close = closest_names(target, model)
            hint = f"; closest names: {', '.join(close)}" if close else ""
            raise ValueError(f"{flag}: {_describe(target)} matches no module of the model{hint}")
    return selected


def select_outermost(model: nn.Module, targets: Iterable[Target], *, flag: str) -> dict[str, nn.Module]:
    """``select_modules``, without a module whose ancestor is selected too: what an action that wraps
    a module's forward (checkpointing, tiling) applies to, in module order."""
    outermost: dict[str, nn.Module] = {}
    for name, module in select_modules(model, targets, flag=flag).items():  # pre-order: ancestors first
        if not any(kept == "" or name.startswith(f"{kept}.") for kept in outermost):
            outermost[name] = module
    return outermost
