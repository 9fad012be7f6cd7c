"""The dry run's one device: every fake tensor of the estimator's step lives on the CPU.

The model and the batch may be on CUDA (or any device); the step runs on fakes of them made on
``DRY_RUN_DEVICE``, whatever device the real tensors are on, and prices them for the device it was
asked about (``StepRequest.device``). Fakes on two devices would not mix: ``FakeTensorMode`` keeps
the device a tensor is made on and refuses an op across two (``FakeTensorDeviceMismatchError``),
as CUDA does. So every tensor the step makes lands on the dry run's device too:

- a one-element buffer whose value the step reads is copied to it before its fake is made
  (``lightmem.estimate.step._known_value``);
- inside the step, ``OnDryRunDevice`` turns a factory's ``device=`` (``torch.zeros(...,
  device=self.device)``, ``device="cuda"``), ``.to(device)`` and ``.cuda()`` towards any other
  device into the dry run's: user code that builds a tensor on the device the model reports
  (Lightning's ``self.device``) meets fakes of its own kind, as it meets real tensors on that
  device in a real step. ``x.device`` of a fake already is the dry run's.
"""

from __future__ import annotations

from typing import Any

import torch
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


class OnDryRunDevice(TorchFunctionMode):
    """Tensors made or moved towards another device inside the step are made on the dry run's."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _elsewhere(kwargs.get("device")):
            kwargs = {**kwargs, "device": DRY_RUN_DEVICE}
        elif func is torch.Tensor.to and not (len(args) > 1 and isinstance(args[1], torch.Tensor)):
            options = {key: value for key, value in kwargs.items() if key != "copy"}
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **options)
            if _elsewhere(device):
                kwargs = {"device": DRY_RUN_DEVICE, "dtype": dtype, "non_blocking": non_blocking, "copy": kwargs.get("copy", False)}
                if memory_format is not None:
                    kwargs["memory_format"] = memory_format
                args = args[:1]
        elif func is torch.Tensor.cuda:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            args, kwargs = args[:1], {"device": DRY_RUN_DEVICE, "non_blocking": non_blocking}
            func = torch.Tensor.to
        return func(*args, **kwargs)
