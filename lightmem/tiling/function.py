"""The tiled forward and backward of one call of a position-wise module: one autograd Function.

Forward keeps only the module's input: each shard of the sequence runs without grad and its output
is copied into the whole output, so one shard's intermediates live at a time. Backward runs each
shard again with grad, from the RNG state and under the autocast state its forward had, and asks
autograd for the gradients of that shard's input and of the module's parameters. The input's
gradient is written shard by shard into one tensor; the parameters' are summed over the shards and
returned as the Function's own gradients, so autograd accumulates each parameter's gradient once,
after the last shard, by its usual path: post-accumulate-grad hooks, DDP's reducer and FSDP2's
reduce-scatter run once per backward, as without tiling (DeepSpeed's TiledMLP instead accumulates
into ``.grad`` per shard and tells its own engine when the last shard is done).

A shard's re-run reads aliases of the parameters (``detach()``: the same storage, new leaves), so a
hook registered on a parameter sees the summed gradient once, not each shard's.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import get_device_states, set_device_states

from lightmem.checkpoint import BufferSnapshots
from lightmem.config import TileSettings

SEQUENCE_DIM = -2
"""Where the positions are, in the input and the output of a tiled module: ``[..., T, d]``."""
_RERUNS = [0]
"""Tiled backwards running their shards again now (``rerunning``)."""
_SAMPLED = [0]
"""Dry runs asking for a tiled call's first and last shards only (``sampled_shards``)."""


@contextlib.contextmanager
def sampled_shards() -> Iterator[None]:
    """Within it, a tiled call on fake tensors runs its first and last shards only, forward and
    backward: the shards between allocate and free what the first does (its output and its input's
    gradient are made whole at once), so the step's memory is the same, and a dry run at 500K
    positions traces 2 shards per call, not 128. The estimator's unpriced steps use it; a priced
    step runs every shard (each one's ops are priced)."""
    _SAMPLED[0] += 1
    try:
        yield
    finally:
        _SAMPLED[0] -= 1


def rerunning() -> bool:
    """Whether a tiled module's backward is running its shards again: the estimator prices what runs
    then as backward, not as a checkpointed block's re-run (both call module forwards in backward)."""
    return _RERUNS[0] > 0


def shard_lengths(length: int, width: int, settings: TileSettings) -> list[int]:
    """The lengths of the shards a sequence of ``length`` positions is cut into, in order.

    ``tile_tokens`` positions each (the last shard shorter), or ``shards`` shards whose lengths
    differ by at most one; with neither, as many positions as the module's input is wide (``width``,
    its last dimension), as Arctic Long Sequence Training does: one shard's intermediates are then
    about the size of the module's weights.
    """
    if length <= 0:
        return [length]
    if settings.shards is not None:
        count = min(settings.shards, length)
        size, longer = divmod(length, count)
        return [size + 1] * longer + [size] * (count - longer)
    size = max(1, settings.tile_tokens if settings.tile_tokens is not None else width)
    return [min(size, length - start) for start in range(0, length, size)]


def rng_state(x: torch.Tensor) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """The RNG states a shard starts from: the CPU's and that of ``x``'s accelerator."""
    devices, states = get_device_states(x)
    return torch.get_rng_state(), devices, states


def set_rng_state(state: tuple[torch.Tensor, list[int], list[torch.Tensor]], device_type: str) -> None:
    cpu, devices, states = state
    torch.set_rng_state(cpu)
    if devices:
        set_device_states(devices, states, device_type=device_type)


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype, bool]]:
    """Autocast as the forward runs it, for the input's device and the CPU (backward re-enters it)."""
    kinds = [kind for kind in dict.fromkeys((device_type, "cpu")) if torch.amp.is_autocast_available(kind)]
    cache = torch.is_autocast_cache_enabled()
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), cache) for kind in kinds]


@contextlib.contextmanager
def _autocast(state: list[tuple[str, bool, torch.dtype, bool]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for kind, enabled, dtype, cache in state:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield


class TiledCall:
    """One call of a tiled module: its shards, and what its backward needs besides the saved input.

    Args:
        module: the tiled module (its parameters are re-read as aliases in backward).
        function: ``shard -> output``: the module's own forward with the call's other arguments.
        lengths: the shards' lengths (``shard_lengths``).
        buffers: the module's ``BufferSnapshots``: the first shard's forward updates the buffers,
            every other shard and every re-run sees them as they were before the call and writes
            only copies, so a buffer is updated once per call, as without tiling.
        describe: the module as messages name it (``module 'mlp' (MLP)``) and the flag that tiled it.
    """

    def __init__(
        self, module: nn.Module, function: Callable[[torch.Tensor], Any], lengths: list[int],
        buffers: BufferSnapshots, describe: str,
    ) -> None:  # fmt: skip
        self.module = module
        self.function = function
        self.lengths = lengths
        starts = [0, *itertools.accumulate(lengths)][:-1]
        self.shards = list(zip(starts, lengths))
        """(start, length) of each shard run: every one, or in a sampled dry run the first and last."""
        self.forward_buffers, self.other_buffers = buffers.contexts()
        self.describe = describe
        self.rng_states: list[tuple[torch.Tensor, list[int], list[torch.Tensor]]] = []
        self.autocast: list[tuple[str, bool, torch.dtype, bool]] = []
        self.names: list[list[str]] = []  # every name of each parameter handed to the Function
        self.params: list[torch.Tensor] = []
        self.input_is_leaf = False

    def trainable_parameters(self) -> list[torch.Tensor]:
        """The module's parameters that require grad, each once (a tied one has several names)."""
        index: dict[int, int] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                continue
            if id(param) not in index:
                index[id(param)] = len(self.params)
                self.params.append(param)
                self.names.append([])
            self.names[index[id(param)]].append(name)
        return self.params

    def forward(self, x: torch.Tensor, *, keep_rng: bool) -> torch.Tensor:
        """The module's output for ``x``, one shard at a time; ``keep_rng``: each shard's RNG state
        and the autocast state are kept for its re-run in backward."""
        if keep_rng:
            self.autocast = _autocast_state(x.device.type)
            # Autocast caches its cast of a leaf (not a view) that requires grad, and the gradients
            # of that one cast's users then add up in the low precision: the re-run's input is such
            # a leaf exactly when the module's input was.
            self.input_is_leaf = x.requires_grad and x.is_leaf and not x._is_view()
        output: torch.Tensor | None = None
        if _SAMPLED[0] and is_fake(x) and len(self.shards) > 2:
            self.shards = [self.shards[0], self.shards[-1]]
        x = x.detach()  # a view made without grad would still say it requires grad (hooks would ask its grad_fn)
        with self.forward_buffers:
            for index, (start, length) in enumerate(self.shards):
                if keep_rng:
                    self.rng_states.append(rng_state(x))
                with contextlib.nullcontext() if index == 0 else self.other_buffers:
                    piece = self.function(_shard(x, start, length))
                self._check_output(piece, length)
                if len(self.lengths) == 1:
                    return piece
                if output is None:
                    shape = (*piece.shape[:SEQUENCE_DIM], x.shape[SEQUENCE_DIM], piece.shape[-1])
                    output = piece.new_empty(shape)
                output.narrow(SEQUENCE_DIM, start, length).copy_(piece)
                del piece  # before the next shard's intermediates
        assert output is not None
        return output

    def _check_output(self, piece: Any, length: int) -> None:
        if not isinstance(piece, torch.Tensor):
            raise TypeError(
                f"{self.describe} returned {type(piece).__name__}; a tiled module returns one tensor shaped "
                "[..., T, d_out] (its output for each position of its input)"
            )
        if piece.dim() < 2 or piece.shape[SEQUENCE_DIM] != length:
            raise ValueError(
                f"{self.describe} returned shape {list(piece.shape)} for a shard of {length} positions; a tiled "
                "module's output keeps its input's positions in its second-to-last dimension ([..., T, d_out])"
            )

    def backward(
        self, x: torch.Tensor, grad_output: torch.Tensor, x_wanted: bool, wanted: list[bool]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Each shard re-run with grad: the input's gradient and the parameters' summed gradients."""
        x = x.detach()
        aliases = [param.detach().requires_grad_(True) for param in self.params]
        named = {name: alias for names, alias in zip(self.names, aliases) for name in names}
        asked = [alias for alias, want in zip(aliases, wanted) if want]
        gradients = _ShardGradients(x, len(self.lengths) == 1, len(asked))
        devices = self.rng_states[0][1] if self.rng_states else []
        with (
            _rerun(),
            torch.random.fork_rng(devices=devices, device_type=x.device.type),
            _reparametrize_module(self.module, named),
            _autocast(self.autocast),
        ):  # fmt: skip
            for index, (start, length) in enumerate(self.shards):
                set_rng_state(self.rng_states[index], x.device.type)
                leaf = _shard(x, start, length).detach().requires_grad_(x_wanted)
                with torch.enable_grad(), self.other_buffers:
                    piece = self.function(leaf if self.input_is_leaf else leaf.view_as(leaf))
                inputs = ([leaf] if x_wanted else []) + asked
                if inputs and piece.requires_grad:
                    grads = torch.autograd.grad(
                        piece, inputs, grad_output.narrow(SEQUENCE_DIM, start, length), allow_unused=True
                    )
                else:
                    grads = (None,) * len(inputs)
                del piece
                if x_wanted:
                    gradients.write_input(start, length, grads[0])
                gradients.add_parameters(grads[1:] if x_wanted else grads)
                del grads
        by_param = iter(gradients.sums)
        return gradients.input, [next(by_param) if want else None for want in wanted]


def _shard(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Positions ``start`` to ``start + length`` of ``x``, contiguous: a module may ``view`` its input
    (Hugging Face's GPT-2 ``Conv1D``), and a shard of a batch of several sequences is not contiguous."""
    return x.narrow(SEQUENCE_DIM, start, length).contiguous()


@contextlib.contextmanager
def _rerun() -> Iterator[None]:
    """A tiled backward runs its shards again (``rerunning``)."""
    _RERUNS[0] += 1
    try:
        yield
    finally:
        _RERUNS[0] -= 1


class _ShardGradients:
    """The gradients of one tiled backward: the input's written shard by shard into one tensor (the
    shard's own gradient when one shard is the whole), the parameters' summed over the shards."""

    def __init__(self, x: torch.Tensor, one_shard: bool, parameters: int) -> None:
        self.x = x
        self.one_shard = one_shard
        self.input: torch.Tensor | None = None
        self.sums: list[torch.Tensor | None] = [None] * parameters
        self.owned = [False] * parameters  # a sum this backward made may be added to in place

    def write_input(self, start: int, length: int, grad: torch.Tensor | None) -> None:
        if self.one_shard:
            self.input = grad
            return
        if self.input is None:
            self.input = torch.empty_like(self.x)
        target = self.input.narrow(SEQUENCE_DIM, start, length)
        if grad is None:  # the output does not depend on this shard's input
            target.zero_()
        else:
            target.copy_(grad)

    def add_parameters(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        for slot, grad in enumerate(grads):
            current = self.sums[slot]
            if grad is None:
                continue
            if current is None:
                self.sums[slot] = grad
            elif self.owned[slot]:
                current.add_(grad)
            else:  # the first shard's gradient may alias what autograd holds: add out of place once
                self.sums[slot] = current + grad
                self.owned[slot] = True


class TiledFunction(torch.autograd.Function):
    """``apply(call, x, *params)``: ``call``'s module on ``x``, one shard at a time, keeping only ``x``.

    ``params`` are the module's trainable parameters (``TiledCall.trainable_parameters``): inputs of
    the Function, so their gradients reach them through autograd's own accumulation.
    """

    @staticmethod
    def forward(ctx: Any, call: TiledCall, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.call = call
        ctx.save_for_backward(x)  # through the saved-tensor hooks around the call (offload, checkpoint)
        return call.forward(x, keep_rng=True)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        call: TiledCall = ctx.call
        x_grad, param_grads = call.backward(x, grad_output, ctx.needs_input_grad[1], list(ctx.needs_input_grad[2:]))
        return (None, x_grad, *param_grads)
