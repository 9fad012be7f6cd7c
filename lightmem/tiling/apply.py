"""``apply_tiling``: chosen position-wise modules run in sequence shards, keeping only their input.

The module's ``forward`` is replaced on the instance only (as ``apply_checkpointing`` does): names,
``state_dict`` keys and parameters do not change, and the handle restores the original forwards.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from lightmem.checkpoint import BufferSnapshots, is_checkpointed, release_forward
from lightmem.config import APPLY_TILING, TileSettings
from lightmem.matching import Target, select_outermost
from lightmem.tiling.function import SEQUENCE_DIM, TiledCall, TiledFunction, shard_lengths
from lightmem.tiling.position_wise import check_position_wise


class TiledForward:
    """The instance ``forward`` of a tiled module.

    A plain picklable object (not a closure), so ``copy.deepcopy`` and ``pickle`` of the model rebind
    it to the copied module. Its first argument is cut into shards along its second-to-last dimension;
    the other arguments go to every shard unchanged. The first call with at least two positions
    checks that the module is position-wise (``lightmem.tiling.position_wise``). Without grad
    (validation, inference) the shards run one after the other too, keeping nothing.

    Dynamo does not trace it (``torch.compiler.disable``): under ``torch.compile`` the graph breaks
    around a tiled module, which runs eagerly; the rest of the model stays compiled.
    """

    dry_run_copies = True
    """Copied into the estimator's stand-in of the model, bound to its module (``lightmem.estimate.trace.stand_in``)."""

    def __init__(self, inner: Any, had_instance_forward: bool, module: nn.Module, settings: TileSettings, name: str) -> None:
        self.inner = inner
        self.had_instance_forward = had_instance_forward
        self.module = module
        self.settings = settings
        self.describe = f"{settings.flag('modules')}: {_named(name, module)}"
        self.buffers = BufferSnapshots(module)
        self.checked = False
        self.users = 0

    @torch.compiler.disable
    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
            got = f"a tensor of shape {list(x.shape)} ({x.dtype})" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{self.describe} got {got} as its first argument; tiling cuts a floating-point input shaped "
                "[..., T, d] along its positions T"
            )
        function = functools.partial(self.inner, *args, **kwargs) if args or kwargs else self.inner
        if not self.checked and not is_fake(x):  # the dry run's fakes have no values to compare
            self.checked = check_position_wise(self.module, function, x, self.buffers, self.describe)
        lengths = shard_lengths(x.shape[SEQUENCE_DIM], x.shape[-1], self.settings)
        call = TiledCall(self.module, function, lengths, self.buffers, self.describe)
        if not torch.is_grad_enabled():
            return call.forward(x, keep_rng=False)
        return TiledFunction.apply(call, x, *call.trainable_parameters())


def _named(name: str, module: nn.Module) -> str:
    """A module as messages name it: ``module 'layers.0.mlp' (LlamaMLP)``, or ``the model (MLP)``."""
    return f"module {name!r} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


def is_tiled(module: nn.Module) -> bool:
    """True when ``apply_tiling`` has wrapped ``module``."""
    return isinstance(module.__dict__.get("forward"), TiledForward)


class TilingHandle:
    """What ``apply_tiling`` returns.

    Attributes:
        modules: qualified names of the modules this call tiles, in module order.
        settings: the parsed targets and shard size.
    """

    def __init__(self, modules: dict[str, nn.Module], settings: TileSettings) -> None:
        self.modules: list[str] = list(modules)
        self.settings = settings
        self._modules = list(modules.values())
        self._removed = False

    def remove(self) -> None:
        """Undo this call. A module tiled by several calls unwraps when the last one is removed."""
        if self._removed:
            return
        self._removed = True
        for module in self._modules:
            release_forward(module, TiledForward)

    def describe(self) -> str:
        """The line at fit start: what is tiled, in shards of how many positions."""
        names = self.modules
        listed = f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
        settings = self.settings
        if settings.shards is not None:
            size = f"{settings.shards} shards per sequence"
        elif settings.tile_tokens is not None:
            size = f"shards of {settings.tile_tokens} positions"
        else:
            size = "shards as long as the module's input is wide"
        return f"tiling {len(names)} module{'s' if len(names) != 1 else ''} ({listed}) in {size}"

    def __len__(self) -> int:
        return len(self.modules)

    def __repr__(self) -> str:
        return f"TilingHandle(modules={self.modules!r})"


def tile_modules(model: nn.Module, settings: TileSettings) -> TilingHandle:
    """Tile the modules ``settings`` names (the callback, the estimator's dry run and
    ``apply_tiling`` all come here); errors name the flags as ``settings.spelling`` spells them."""
    modules = select_outermost(model, settings.modules, flag=settings.flag("modules"))
    for name, module in modules.items():
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, TiledForward) and wrapper.settings != settings:
            raise ValueError(
                f"{settings.flag('modules')}: {_named(name, module)} is already tiled "
                f"({wrapper.settings.flag('modules')}, other shards); remove that handle first"
            )
        if is_checkpointed(module):
            raise ValueError(
                f"{settings.flag('modules')}: {_named(name, module)} is checkpointed itself; a "
                "tiled module keeps only its input, as a checkpointed one does: tile it or checkpoint it (or "
                "checkpoint the block around it)"
            )
    for name, module in modules.items():
        wrapper = module.__dict__.get("forward")
        if not isinstance(wrapper, TiledForward):
            had_instance_forward = "forward" in module.__dict__
            wrapper = TiledForward(module.forward, had_instance_forward, module, settings, name)
            module.forward = wrapper
        wrapper.users += 1
    return TilingHandle(modules, settings)


def apply_tiling(
    model: nn.Module,
    targets: Target | Iterable[Target],
    *,
    tile_tokens: int | None = None,
    shards: int | None = None,
) -> TilingHandle:
    """Run the position-wise modules of ``model`` selected by ``targets`` in sequence shards.

    A tiled module (an MLP taking ``[..., T, d]``) keeps only its input in forward: each shard of
    the T positions runs without grad and the outputs are joined. Backward runs each shard again
    with grad (the same dropout masks: each shard's RNG state is kept), writes the input's gradient
    shard by shard, and hands the parameters' gradients, summed over the shards, to autograd, which
    accumulates them once as without tiling. One shard's intermediates live at a time instead of the
    whole sequence's, for one more forward of the module in backward. Composes with
    ``apply_checkpointing`` (a tiled module inside a checkpointed block), activation offload (the
    kept input goes through its hooks), autocast, ``torch.compile`` (the tiled module runs eagerly
    between compiled graphs), DDP and FSDP2. A buffer the module updates in forward is updated once
    per call, by the first shard; the re-runs write only copies.

    Exact up to rounding: with one shard the loss and every gradient are bitwise those without
    tiling; with several, the parameters' gradients are sums over shards (fp32: within 1e-6 of
    the largest gradient entry, relative, in the tests).

    Args:
        model: the model whose modules to wrap (in place).
        targets: class names (``"LlamaMLP"``; subclasses match too), ``nn.Module`` classes, or glob
            patterns over qualified module names (``"layers.*.mlp"``), as ``apply_checkpointing``
            takes them. When a module and one of its descendants both match, only the outer one is
            tiled.
        tile_tokens: positions per shard (the last may be shorter).
        shards: shards per sequence, of lengths that differ by at most one, instead.
            With neither, a shard has as many positions as the module's input is wide (its last
            dimension), as Arctic Long Sequence Training does.

    Returns:
        A :class:`TilingHandle` with ``.modules`` and ``.remove()``.

    Raises:
        ValueError: a target matches no module (the message lists the closest names), both or a bad
            ``tile_tokens`` / ``shards``, or a module already tiled differently or checkpointed
            itself. At the module's first call with two positions or more: the module mixes
            positions (attention, a convolution along the sequence, a normalisation over positions,
            routing with capacity limits: seen by running a few positions of its input alone and
            changed one at a time, see ``lightmem.tiling.position_wise``), writes a buffer from its
            input's values, or depends on tensors requiring grad other than its input and its own
            parameters; the message names the module and what was seen.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from lightmem import apply_tiling
        >>> model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> handle = apply_tiling(model, ["Sequential"], tile_tokens=16)
        >>> x = torch.randn(2, 64, 8, requires_grad=True)
        >>> model(x).sum().backward()   # 4 shards of 16 positions
        >>> handle.modules
        ['']
        >>> handle.remove()
    """
    settings = TileSettings.parse(targets, tile_tokens=tile_tokens, shards=shards, spelling=APPLY_TILING)
    if settings is None:
        raise ValueError(
            f"{APPLY_TILING.flag('modules')}: expected class names, nn.Module classes or glob patterns; got None"
        )
    return tile_modules(model, settings)
