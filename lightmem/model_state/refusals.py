"""What model-state offload cannot serve, refused before anything changed, each with the flag named.

``refuse_unservable`` runs every check ``offload_optimizer`` and the Lightning plumbing make before
an optimizer is touched; a param group added while offloaded runs ``check_params`` and
``refuse_sparse_gradients`` on its own parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightmem.config import OptimizerOffloadSettings
from lightmem.model_state.device_dtype import refuse_device_dtype
from lightmem.model_state.host_copies import optimized_params
from lightmem.model_state.overlap import overlap_refusal

# Optimizers whose step re-evaluates the closure at parameter values the step itself moved to:
# with parameters updated on the host, the device forward would not see those values.
_RE_EVALUATING = ("LBFGS",)


def refuse_unservable(
    model: Any, optimizer: Any, settings: OptimizerOffloadSettings, reducer: Any, overlap: str | None
) -> tuple[list[nn.Parameter], torch.device]:
    """The optimizer's parameters (each once, in its groups' order) and their device, once every
    check passed.

    Raises:
        ValueError: naming the flag: not a model, an optimizer whose step cannot run on host
            copies, parameters on several devices or a device type not in ``settings.devices``,
            sparse gradients, ``device_dtype`` where it cannot serve, an overlapped step
            (``overlap``) the optimizer's step or DDP does not allow.
    """
    flag = settings.flag("enabled")
    if not isinstance(model, nn.Module):
        raise ValueError(f"{flag}: expected the model (an nn.Module) first; got {type(model).__name__}")
    _check_optimizer(optimizer, settings)
    params = optimized_params(optimizer)
    device = check_params(params, settings, flag)
    refuse_sparse_gradients(model, params, flag)
    if settings.device_dtype is not None:
        refuse_device_dtype(params, settings, reducer)
    if overlap is not None:
        refusal = overlap_refusal(optimizer) or (
            "under DDP a gradient is final only once the reducer averaged it, at the end of backward"
            if reducer is not None
            else None
        )
        if refusal is not None:
            raise ValueError(f"{settings.flag('overlap_step')}: {refusal}; leave it off")
    return params, device


def _check_optimizer(optimizer: Any, settings: OptimizerOffloadSettings) -> None:
    """Refuse an optimizer whose step cannot run on host copies of the parameters."""
    flag = settings.flag("enabled")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"{flag}: expected a torch.optim.Optimizer (its step runs on host copies of the "
            f"parameters); got {type(optimizer).__name__}"
        )
    name = type(optimizer).__name__
    if name in _RE_EVALUATING:
        raise ValueError(
            f"{flag}: {name} re-evaluates the closure at parameter values it moved to inside one "
            "step, which the device forward would not see with the step on the host; use a "
            "first-order optimizer (SGD, Adam, AdamW, ...) or turn the option off"
        )
    for index, group in enumerate(optimizer.param_groups):
        if group.get("capturable"):
            raise ValueError(
                f"{flag}: {name}(capturable=True) (param group {index}) steps only on "
                "CUDA/XPU tensors and cannot run on the host; construct it with capturable=False"
            )
    if any(group.get("fused") for group in optimizer.param_groups):
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        if "cpu" not in _get_fused_kernels_supported_devices():
            raise ValueError(
                f"{flag}: {name}(fused=True) has no CPU kernel in this PyTorch; construct it with "
                "fused=False (without a fused kernel the for-loop is the fastest on CPU)"
            )


def check_params(params: list[nn.Parameter], settings: OptimizerOffloadSettings, flag: str) -> torch.device:
    """The one device of ``params``, a device type ``settings.devices`` names."""
    devices = sorted({str(param.device) for param in params})
    if not devices:
        raise ValueError(f"{flag}: the optimizer has no parameters")
    if len(devices) > 1:
        raise ValueError(
            f"{flag}: the optimizer's parameters are on several devices ({', '.join(devices)}); "
            "optimizer offload handles one device per process"
        )
    device = params[0].device
    if device.type not in settings.devices:
        raise ValueError(
            f"{flag}: the parameters are on {device}, not a device type in "
            f"{settings.flag('devices')} {list(settings.devices)}; pass devices=('{device.type}',) "
            "to drive the path there"
        )
    return device


def refuse_sparse_gradients(model: nn.Module, params: list[nn.Parameter], flag: str) -> None:
    """Embeddings with ``sparse=True`` give sparse gradients, which have no host buffer layout
    (and no fused kernel): refuse them before anything changed."""
    stepped = {id(param) for param in params}
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) and id(getattr(module, "weight", None)) in stepped:
            raise ValueError(
                f"{flag}: module '{name}' is {type(module).__name__}(sparse=True): its sparse gradients "
                "cannot be offloaded; construct it with sparse=False or turn the option off"
            )


def refuse_bucket_views(reducer: Any, flag: str, remedy: str) -> None:
    """DDP with ``gradient_as_bucket_view=True``: its gradients are views of its buckets."""
    if getattr(reducer, "gradient_as_bucket_view", False):
        raise ValueError(
            f"{flag}: DDP's gradient_as_bucket_view=True makes gradients views of DDP's buckets, "
            f"which must stay on the device; {remedy}"
        )
