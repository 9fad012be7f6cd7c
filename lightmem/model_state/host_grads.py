"""The gradients of a model by parameter name, wherever optimizer offload keeps them: ``named_grads``.

While optimizer offload runs, ``param.grad`` of the model's parameters is None after backward: the
gradient the step reads is the one of the parameter's host copy. Each offloader registers here the
device parameters whose gradients it holds (weakly: a parameter or an offloader that is gone drops
out), so ``named_grads`` finds the gradient of any parameter of any module, the model's or a
submodule's, from the names ``module.named_parameters()`` gives.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


class HostGrads(Protocol):
    def host_grad(self, param: torch.Tensor) -> torch.Tensor | None: ...


_HOLDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # device parameter -> weakref to its HostGrads


def hold(params: Iterable[torch.Tensor], holder: HostGrads) -> None:
    """From now on the gradients of ``params`` are read from ``holder.host_grad``."""
    ref = weakref.ref(holder)
    for param in params:
        _HOLDERS[param] = ref


def release(params: Iterable[torch.Tensor]) -> None:
    """``params`` keep their gradients in ``param.grad`` again."""
    for param in params:
        _HOLDERS.pop(param, None)


def named_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """The gradient of each parameter of ``module`` that has one, by the name
    ``module.named_parameters()`` gives it: the names Lightning's ``grad_norm(module, norm_type)``
    puts after ``grad_<norm_type>_norm/``.

    Under optimizer offload (``LightMem(offload_optimizer=True)``, ``offload_optimizer``) the
    gradient the step reads, on the host: after backward, the gradients of every micro-batch
    accumulated so far, before clipping (in Lightning's ``on_after_backward``,
    ``on_before_optimizer_step`` and ``configure_gradient_clipping``, and after
    ``manual_backward``). Without it, ``param.grad``: code that reads gradients this way runs with
    lightmem or without it.

    The tensors are lightmem's own host buffers, rewritten by the next backward: read them, or clone
    what you keep. With a host step overlapped with backward (``overlap_step``) they are read once
    the step taken during backward is over, so clipping applied there shows.

    Example::

        >>> import torch
        >>> from lightmem import named_grads, offload_optimizer
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with offload_optimizer(model, opt, devices=("cpu",)):
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     model.weight.grad, named_grads(model)["weight"]
        (None, tensor([[1., 1.]]))
    """
    grads = {}
    for name, param in module.named_parameters():
        ref = _HOLDERS.get(param)
        holder = ref() if ref is not None else None
        host = holder.host_grad(param) if holder is not None else None
        device = param.grad
        if host is not None and device is not None:
            # Part of it still on the device (DDP's no_sync window with set_to_none=False): the two
            # together, as the step will see them.
            grads[name] = host + device.to(host.device)
        elif host is not None or device is not None:
            grads[name] = host if host is not None else device
    return grads
