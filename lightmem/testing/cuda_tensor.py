"""Tensors that report a CUDA device on a machine without one: the device half of the simulated GPU.

Code that meets a CUDA batch, parameter or buffer must never mix it with a CPU tensor; on a CPU-only
machine every tensor is on the CPU and no test can see such a mix. Inside ``with simulated_cuda():``

- ``device="cuda"`` (or ``"cuda:0"``, ``torch.device("cuda", 0)``, ``0``) in any factory
  (``torch.zeros``, ``ones``, ``empty``, ``full``, ``arange``, ``tensor``, ``rand*``, ``randint``,
  ``*_like``, ``Tensor.new_*``), ``.to("cuda")``, ``.cuda()``, ``Module.to("cuda")`` and
  ``Module.cuda()`` make a ``SimulatedCudaTensor``: its values live in CPU memory, its ``device`` is
  ``cuda:0``, ``is_cuda`` is True, and what ops make from it is simulated CUDA too, also where
  autograd sees it first (the tensors a ``saved_tensors_hooks`` pack hook gets, gradients, the
  recompute of a checkpointed block, which ``Tensor.backward`` runs under this simulation);
- an op that mixes it with a CPU tensor raises CUDA's error, ``SAME_DEVICE_ERROR``, except where
  CUDA allows a CPU tensor: a 0-dim CPU tensor as an input (not as the output of an in-place op or
  ``out=``), ``copy_`` either way, indexing (``x[cpu_index]``, ``x[...] = cpu_values``),
  ``new_tensor``; ``.numpy()`` raises CUDA's error too;
- ``.to("cpu")`` / ``.cpu()`` copy it back to a plain CPU tensor;
- a module's parameters keep their identity across ``Module.to`` (an optimizer made before still
  steps them): each is the same object, now a ``SimulatedCudaTensor`` that is still an
  ``nn.Parameter`` (``isinstance``), as ``nn.Parameter(simulated)`` is.

Under a ``FakeTensorMode`` (the estimator's dry run) the simulation steps aside: a simulated tensor
that enters an op becomes a fake on ``cuda:0`` (what a real CUDA tensor becomes there), and
factories and moves go to ``FakeTensorMode``, which keeps CUDA devices on a CPU-only build and
raises its own device-mismatch error, as it does on a GPU.

What it cannot model:

- Device errors come from this module's check, one message for every op: ``SAME_DEVICE_ERROR`` is
  the wording of CUDA's elementwise and reduction kernels (TensorIterator); ops that check their
  arguments one by one (``mm``, ``cat``, ``embedding``, ``index_select``) word it "Expected all tensors
  to be on the same device, but got mat2 is on cpu, different from other tensors on cuda:0 ..." on a
  GPU. Kernels that accept more than one CPU scalar, or refuse a second one, are not told apart.
- torch carries no function mode into a backward that ``torch.autograd.grad`` runs: a factory
  asked for ``"cuda"`` there (a checkpointed block run again) fails as on a CPU-only build
  (``Tensor.backward`` and ``torch.autograd.backward`` carry this simulation, and lightmem's
  estimator calls the engine itself).
- ``torch.cuda`` is not simulated (``is_available()`` stays False, no streams, no memory
  statistics: :mod:`lightmem.testing.simulated` and :mod:`lightmem.testing.device` model those);
  storages (``untyped_storage().device``) report the CPU; ``torch.autocast("cuda")`` does not cast
  simulated tensors (autocast follows the CPU dispatch); optimizers take their single-tensor path
  (their foreach and fused checks accept only plain types); one device, ``cuda:0``.
- Simulated tensors are meant to live inside the ``with`` block: outside it, factories and moves
  to ``"cuda"`` fail as on any CPU-only build, and ``plain_param.data = simulated`` keeps the plain
  class.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from lightmem.lightning_packages import callback_bases

CUDA_DEVICE = torch.device("cuda", 0)
SAME_DEVICE_ERROR = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
"""CUDA's error for an elementwise or reduction op given a CPU tensor beside a CUDA one (torch's
TensorIterator names the first CUDA device first, whichever argument it is)."""
NUMPY_ERROR = (
    "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
)


class SimulatedCudaTensor(torch.Tensor):
    """A tensor whose values are in CPU memory and whose device is ``cuda:0`` (see the module doc)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA_DEVICE

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:  # type: ignore[override]
        return CUDA_DEVICE.index

    def __deepcopy__(self, memo: dict) -> SimulatedCudaTensor:
        # torch's deepcopy of a plain tensor (storages shared as in the original, gradient,
        # attributes), the copy simulated too
        if id(self) in memo:
            return memo[id(self)]
        self.__class__ = torch.Tensor
        try:
            copied = copy.deepcopy(self, memo)
        finally:
            self.__class__ = SimulatedCudaTensor
        copied.__class__ = SimulatedCudaTensor
        return copied

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        fake_mode = _active_fake_mode()
        if fake_mode is not None:  # what a CUDA tensor is in a fake step: a fake on cuda:0
            with torch._C.DisableTorchFunctionSubclass():
                args, kwargs = tree_map_only(SimulatedCudaTensor, fake_mode.from_tensor, (args, kwargs))
                return func(*args, **kwargs)
        moved = _move(func, args, kwargs)
        if moved is not NotImplemented:
            return moved
        if func is torch.Tensor.numpy:
            raise TypeError(NUMPY_ERROR)
        if func not in _ANY_DEVICE:
            _check_same_device(func, args, kwargs)
        return _call_on_cuda(func, args, kwargs)


class _SimulatedCudaMode(TorchFunctionMode):
    """Turns CUDA factories and moves of plain tensors into simulated CUDA tensors."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            # torch takes a mode off its stack while the mode handles a call, and the engine runs
            # backward (checkpoint's recompute, hooks) under the modes it finds: put this one back.
            with self:
                if func is torch.autograd.backward:
                    _backward(*args, **kwargs)
                else:
                    _backward(*_tensor_backward_args(*args, **kwargs))
            return None
        if _active_fake_mode() is None:
            moved = _move(func, args, kwargs)
            if moved is not NotImplemented:
                return moved
            if _is_cuda(kwargs.get("device")):
                return _call_on_cuda(func, args, kwargs)
        return func(*args, **kwargs)


class _OutputsOnCuda(TorchDispatchMode):
    """What an op makes from simulated CUDA tensors is one before autograd sees it: a tensor autograd
    saves (a pack hook, checkpoint's recompute check) or passes on in backward reports CUDA too.
    (The subclass's ``__torch_function__`` sees a composite op, e.g. ``linear``, only as a whole;
    this mode sees each op it runs.)"""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if kwargs.get("device") is not None or _active_fake_mode() is not None:
            return out  # asked for a device (.cpu()): the caller's to say which; fakes keep their own
        leaves = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if any(isinstance(leaf, SimulatedCudaTensor) for leaf in leaves):
            inputs = {id(leaf) for leaf in leaves}
            out = tree_map(lambda leaf: _to_simulated(leaf, inputs), out)
        return out


@contextlib.contextmanager
def simulated_cuda() -> Iterator[None]:
    """Inside, ``device="cuda"`` makes ``SimulatedCudaTensor``s (see the module doc).

    Example:
        >>> with simulated_cuda():
        ...     x = torch.ones(3, device="cuda")
        ...     (x.device, x.is_cuda, (x * 2).device, x.cpu().device)
        (device(type='cuda', index=0), True, device(type='cuda', index=0), device(type='cpu'))
    """
    with _SimulatedCudaMode(), _OutputsOnCuda():
        yield


class SimulatedCudaFit(*callback_bases()):  # type: ignore[misc]
    """A Lightning fit on the simulated CUDA device: the accelerator is the CPU's, the model and
    every training batch are on ``cuda:0`` as on a GPU.

    Fit inside ``with simulated_cuda():`` and list this callback before ``LightMem``: at fit start
    (after the strategy put the model on the CPU and set up its optimizers, before ``LightMem``'s
    own ``on_fit_start``) it moves the model to ``cuda:0`` (each parameter stays the object the
    optimizers hold), and each batch goes there after Lightning's transfer to the CPU.
    """

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.to(CUDA_DEVICE)
        to_cpu = pl_module.transfer_batch_to_device
        pl_module.transfer_batch_to_device = lambda batch, device, dataloader_idx: tree_map_only(
            torch.Tensor, lambda tensor: tensor.to(CUDA_DEVICE), to_cpu(batch, device, dataloader_idx)
        )

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        vars(pl_module).pop("transfer_batch_to_device", None)


def _tensor_backward_args(
    tensor: torch.Tensor, gradient: Any = None, retain_graph: Any = None, create_graph: bool = False,
    inputs: Any = None,
) -> tuple:  # fmt: skip
    """``Tensor.backward``'s arguments as ``torch.autograd.backward`` takes them."""
    return tensor, gradient, retain_graph, create_graph, None, inputs


def _backward(
    tensors: Any, grad_tensors: Any = None, retain_graph: Any = None, create_graph: bool = False,
    grad_variables: Any = None, inputs: Any = None,
) -> None:  # fmt: skip
    """``torch.autograd.backward`` without its torch-function check, which would take the mode off again."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grads = _tensor_or_tensors_to_tuple(grad_tensors if grad_tensors is not None else grad_variables, len(tensors))
    grads = _make_grads(tensors, grads, is_grads_batched=False)
    retain = create_graph if retain_graph is None else retain_graph
    _engine_run_backward(tensors, grads, retain, create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


def _active_fake_mode() -> Any:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _is_cuda(device: Any) -> bool:
    if device is None or isinstance(device, bool):
        return False
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return False
    if device.index not in (None, CUDA_DEVICE.index):
        raise RuntimeError(f"the simulated CUDA device is cuda:0 alone; got {device}")
    return True


def _call_on_cuda(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` run on the CPU values; what it makes is on the simulated device unless it was asked
    for another device (``device="cpu"``)."""
    asked = kwargs.get("device")
    if asked is not None:
        if not _is_cuda(asked):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        kwargs = {**kwargs, "device": "cpu"}
    inputs = {id(leaf) for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    return tree_map(lambda leaf: _to_simulated(leaf, inputs), out)


def _to_simulated(leaf: Any, inputs: set[int]) -> Any:
    # Re-classed in place, not wrapped: the same object is the one autograd and the optimizer hold.
    if type(leaf) is torch.Tensor and id(leaf) not in inputs:
        leaf.__class__ = SimulatedCudaTensor
    return leaf


def _move(func: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.to``, ``.cuda``, ``.cpu`` and ``.data = ...`` between the CPU and the simulated
    device; NotImplemented for any other function."""
    if func is torch.Tensor.to:
        tensor, rest = args[0], args[1:]
        if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
            other = rest[0]
            rest = (other.device, other.dtype, *rest[1:])
        kwargs = dict(kwargs)
        copy = kwargs.pop("copy", False)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
        if device is None and isinstance(tensor, SimulatedCudaTensor):
            device = CUDA_DEVICE
    elif func is torch.Tensor.cuda:
        tensor, device = args[0], CUDA_DEVICE
        dtype, copy, non_blocking, memory_format = None, False, False, kwargs.get("memory_format")
        _is_cuda(args[1] if len(args) > 1 else kwargs.get("device", CUDA_DEVICE))
    elif func is torch.Tensor.cpu:
        tensor, device = args[0], torch.device("cpu")
        dtype, copy, non_blocking, memory_format = None, False, False, kwargs.get("memory_format")
    elif func == torch.Tensor.data.__set__:  # a new method-wrapper at each access: compared by ==
        _set_data(*args)
        return None
    else:
        return NotImplemented
    to_cuda = _is_cuda(device)
    on_cuda = isinstance(tensor, SimulatedCudaTensor)
    if not (to_cuda or on_cuda):  # a plain tensor moved off the CPU to somewhere else: torch's own
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    options = {"dtype": dtype, "non_blocking": non_blocking, "copy": copy or to_cuda != on_cuda}
    if memory_format is not None:
        options["memory_format"] = memory_format
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.Tensor.to(tensor, **({} if to_cuda else {"device": device}), **options)
    return _to_simulated(out, {id(tensor)}) if to_cuda else out


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.data = value``: ``tensor`` takes ``value``'s device, as on CUDA (``Module.to``
    moves parameters this way, keeping each parameter object)."""
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.data.__set__(tensor, value)
    if isinstance(value, SimulatedCudaTensor) and not isinstance(tensor, SimulatedCudaTensor):
        is_param = type(tensor) is nn.Parameter
        tensor.__class__ = SimulatedCudaTensor
        if is_param:
            tensor._is_param = True  # what nn.Parameter(simulated) sets: isinstance(..., Parameter) holds
    elif isinstance(tensor, SimulatedCudaTensor) and not isinstance(value, SimulatedCudaTensor):
        tensor.__class__ = nn.Parameter if vars(tensor).pop("_is_param", False) else torch.Tensor


_IN_PLACE_OPERATORS = {
    f"__i{name}__"
    for name in (
        "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
    )
}  # fmt: skip


def _is_output(func: Any, position: int, leaf: torch.Tensor, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS
    return (in_place and position == 0) or any(leaf is out for out in tree_leaves(kwargs.get("out")))


def _check_same_device(func: Any, args: tuple, kwargs: dict) -> None:
    for position, leaf in enumerate(tree_leaves((args, kwargs))):
        if not isinstance(leaf, torch.Tensor) or isinstance(leaf, SimulatedCudaTensor):
            continue
        if leaf.device.type != "cpu":  # fakes on cuda, meta: not this check's
            continue
        if leaf.dim() == 0 and not _is_output(func, position, leaf, kwargs):
            continue  # a CPU scalar: CUDA kernels take it as an input
        raise RuntimeError(SAME_DEVICE_ERROR)


_ANY_DEVICE = {
    torch.Tensor.copy_,  # copies go either way
    torch.Tensor.__getitem__,  # CPU indices index a CUDA tensor
    torch.Tensor.__setitem__,  # and CPU values are copied into it
    torch.Tensor.new_tensor,  # copies its data to self's device
    torch._has_compatible_shallow_copy_type,  # a question Module.to asks before moving a parameter
}
