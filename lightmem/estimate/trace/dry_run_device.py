"""The dry run's one device: every fake tensor of the estimator's step lives on the CPU.

The model and the batch may be on CUDA (or any device); the step runs on fakes of them made on
``DRY_RUN_DEVICE``, whatever device the real tensors are on, and prices them for the device it was
asked about (``StepRequest.device``). Fakes on two devices would not mix: ``FakeTensorMode`` keeps
the device a tensor is made on and refuses an op across two (``FakeTensorDeviceMismatchError``),
as CUDA does. So every tensor the step makes lands on the dry run's device too:

- a one-element buffer whose value the step reads is copied to it before its fake is made
  (``known_value``);
- inside the step, ``OnDryRunDevice`` turns a factory's ``device=`` (``torch.zeros(...,
  device=self.device)``, ``device="cuda"``), ``.to(device)`` and ``.cuda()`` towards any other
  device into the dry run's: user code that builds a tensor on the device the model reports
  (Lightning's ``self.device``) meets fakes of its own kind, as it meets real tensors on that
  device in a real step. ``x.device`` of a fake already is the dry run's;
- a real tensor from another device that the step reads (a cache an earlier real step left in a
  plain attribute of a module, met when ``plan="auto"`` plans again) enters as a fake on the dry
  run's device, one fake per tensor, with its value if it has one element. The step counts it as
  it counts a real CPU tensor the step reads (``entered``: not at all): memory held outside the
  parameters and buffers before the step is not the step's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

DRY_RUN_DEVICE = torch.device("cpu")
_KEPT = (DRY_RUN_DEVICE.type, "meta")


def _elsewhere(device: Any) -> bool:
    """Whether ``device`` (as a factory or ``.to`` takes it: a device, a string, an index) is a
    device other than the dry run's (the meta device stays what it is)."""
    if device is None or isinstance(device, bool):
        return False
    if isinstance(device, int):  # an index: of the accelerator
        return True
    return torch.device(device).type not in _KEPT


def known_value(fake_mode: FakeTensorMode, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
    """A fake on the dry run's device that carries ``tensor``'s value, for a tensor of one element
    (None for any other, a meta tensor or a fake).

    Modules read such tensors as Python numbers (BatchNorm with ``momentum=None`` divides by
    ``num_batches_tracked``; a temperature, a scale); their values are known, so the step can read
    them. ``dtype`` converts a floating-point value. The fake holds a copy: what the step writes to
    it never reaches the model.
    """
    if tensor.numel() > 1 or tensor.is_meta or isinstance(tensor, FakeTensor):
        return None
    with unset_fake_temporarily():  # a copy on the dry run's device, where every other fake is
        target = dtype if dtype is not None and tensor.is_floating_point() else None
        value = tensor.detach().to(DRY_RUN_DEVICE, target, copy=True)
    return fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, value, make_constant=True)


class OnDryRunDevice(TorchFunctionMode):
    """Tensors made or moved towards another device inside the step are made on the dry run's,
    and real tensors from another device enter it as fakes there (module doc)."""

    def __init__(self, fake_mode: FakeTensorMode, entered: Callable[[FakeTensor], None]) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.entered = entered
        """Called with the fake of each real tensor from another device, when it enters."""
        self._fakes: dict[int, tuple[torch.Tensor, FakeTensor]] = {}
        """id of a real tensor from another device -> (the tensor, kept so the id stays its; its fake)."""

    def _here(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if isinstance(value, FakeTensor) or value.device.type in _KEPT:
                return value
            held = self._fakes.get(id(value))
            if held is None:
                fake = known_value(self.fake_mode, value)
                if fake is None:
                    with unset_fake_temporarily():
                        meta = value.detach().to("meta")
                    converter = self.fake_mode.fake_tensor_converter
                    fake = converter.from_meta_and_device(self.fake_mode, meta, DRY_RUN_DEVICE)
                held = self._fakes[id(value)] = (value, fake)
                self.entered(fake)
            return held[1]
        if type(value) in (list, tuple) and any(isinstance(item, torch.Tensor) for item in value):
            return type(value)(self._here(item) for item in value)
        return value

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        args = tuple(self._here(arg) for arg in args)
        if kwargs:
            kwargs = {key: self._here(value) for key, value in kwargs.items()}
        if _elsewhere(kwargs.get("device")):
            kwargs = {**kwargs, "device": DRY_RUN_DEVICE}
        elif func is torch.Tensor.to and not (len(args) > 1 and isinstance(args[1], torch.Tensor)):
            options = {key: value for key, value in kwargs.items() if key != "copy"}
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **options)
            if _elsewhere(device):
                copy = kwargs.get("copy", False)
                kwargs = {"device": DRY_RUN_DEVICE, "dtype": dtype, "non_blocking": non_blocking, "copy": copy}
                if memory_format is not None:
                    kwargs["memory_format"] = memory_format
                args = args[:1]
        elif func is torch.Tensor.cuda:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            args, kwargs = args[:1], {"device": DRY_RUN_DEVICE, "non_blocking": non_blocking}
            func = torch.Tensor.to
        return func(*args, **kwargs)
