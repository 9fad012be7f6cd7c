"""Optimizer state in the fake step: the optimizers the step uses (named, or the module's own
``configure_optimizers``), the state the previous step left (created by a shortcut that leaves
exactly what a full update leaves), its roles in the trace, and model-state offload's gradients
leaving the device and its host bytes."""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch
from torch import nn

from lightmem.config.estimator import OptimizerChoice
from lightmem.estimate.trace.dry_run_device import DRY_RUN_DEVICE
from lightmem.estimate.trace.errors import EstimateError
from lightmem.estimate.trace.tracer import StorageTracer
from lightmem.estimate.trace.user_code import DryRunTrainer, configure, use_optimizers
from lightmem.lightning_packages import is_mock_optimizer

MASTER_DTYPE = torch.float32
"""The host masters' dtype under model-state offload's ``device_dtype`` (the engine refuses others)."""


def gradients_leave(
    tracer: StorageTracer, trainable: list[nn.Parameter], inflight_bytes: int
) -> tuple[list[Any], set[int]]:
    """Model-state offload's backward: each final gradient waits on the device for its copy to
    host, at most ``inflight_bytes`` of them (the engine's bound, with copies assumed slow: the
    oldest is released only when the bound is passed), then leaves the device."""
    waiting: collections.deque[torch.Tensor] = collections.deque()
    waiting_bytes = 0
    graded: set[int] = set()

    def leave(param: torch.Tensor) -> None:
        nonlocal waiting_bytes
        grad = param.grad
        if grad is None:
            return
        tracer.mark_gradient(grad)
        graded.add(id(param))
        param.grad = None
        waiting.append(grad)
        waiting_bytes += grad.nbytes
        while waiting and waiting_bytes > inflight_bytes:
            waiting_bytes -= waiting.popleft().nbytes

    return [p.register_post_accumulate_grad_hook(leave) for p in trainable], graded


def host_model_state_bytes(
    optimizers: list[torch.optim.Optimizer], params: list[nn.Parameter], graded: set[int], unused: set[int],
    device_dtype: torch.dtype | None = None,
) -> int:
    """Host bytes of model-state offload (no allocator rounding on the host): a copy of each
    stepped parameter, its gradient buffer, its optimizer state.

    With ``device_dtype`` the copy is an fp32 master plus its ``device_dtype`` copy that travels
    to the device, the gradient a ``device_dtype`` landing buffer plus the master's fp32 gradient,
    and the state the optimizer makes for fp32 masters: what it made here for the fake
    ``device_dtype`` parameters, in fp32."""
    copies = sum(p.nbytes for p in params if id(p) in graded)
    if device_dtype is not None:
        copies += sum(p.numel() * MASTER_DTYPE.itemsize for p in params if id(p) in graded)
    state = sum(
        value.numel() * MASTER_DTYPE.itemsize if value.dtype == device_dtype else value.nbytes
        for optimizer in optimizers
        for param, values in optimizer.state.items()
        if id(param) not in unused
        for value in values.values()
        if isinstance(value, torch.Tensor)
    )
    return 2 * copies + state


def unique_storages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    result = []
    for tensor in tensors:
        key = id(tensor.untyped_storage())
        if key not in seen:
            seen.add(key)
            result.append(tensor)
    return result


def state_records(tracer: StorageTracer, optimizers: list[torch.optim.Optimizer], device: str) -> list[int]:
    rids = []
    seen: set[int] = set()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    rid = tracer.track(value)
                    if rid not in seen and rid not in tracer.excluded:
                        seen.add(rid)
                        rids.append(rid)
    return rids


# torch.optim classes whose state for one parameter depends only on that parameter and its
# gradient (shape, strides, dtype, device) and on its group's settings, never on other parameters.
_PER_PARAMETER_STATE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
)  # fmt: skip


def _no_loss() -> torch.Tensor:
    """The closure of the previous step's update, for an optimizer whose ``step`` needs one: what
    a closure returns, without a forward (its state is what is wanted)."""
    return torch.zeros((), device=DRY_RUN_DEVICE)


def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state the previous step left, without paying for a full fake update.

    For the classes above the update runs on one parameter of each kind (per group) and every other
    parameter of that kind gets a clone of its state: same shapes, strides, dtypes and devices, so
    the same bytes and roles as a full step (a clone also keeps a fake scalar's known value, e.g.
    Adam's ``step``). Any other optimizer (a subclass included) runs its full step.
    """
    if type(optimizer) not in _PER_PARAMETER_STATE:
        optimizer.step(_no_loss)
        return
    kept = [group["params"] for group in optimizer.param_groups]
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for group in optimizer.param_groups:
            firsts: dict[tuple, torch.Tensor] = {}
            reduced = []
            for param in group["params"]:
                grad = param.grad
                if grad is None:  # skipped by the update either way
                    reduced.append(param)
                    continue
                kind = (
                    param.shape, param.stride(), param.dtype, param.device, param.layout,
                    grad.shape, grad.stride(), grad.dtype, grad.device, grad.layout,
                )  # fmt: skip
                first = firsts.setdefault(kind, param)
                if first is param:
                    reduced.append(param)
                else:
                    copies.append((param, first))
            group["params"] = reduced
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, kept):
            group["params"] = params
    for param, first in copies:
        optimizer.state[param] = {
            key: value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            for key, value in optimizer.state[first].items()
        }
    # The order a full step would have left (state_dict and reports follow the groups' order).
    state, ordered = optimizer.state, collections.defaultdict(dict)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param in state:
                ordered[param] = state[param]
    optimizer.state = ordered


def mark_state(
    tracer: StorageTracer, optimizers: list[torch.optim.Optimizer], device: str
) -> dict[int, int]:
    """Give optimizer state its role; returns record id -> id of the parameter it belongs to."""
    owners: dict[int, int] = {}
    for optimizer in optimizers:
        host_steps = {
            id(p) for group in optimizer.param_groups if not (group.get("capturable") or group.get("fused"))
            for p in group["params"]
        }  # fmt: skip
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                rid = tracer.mark_state(value)
                owners[rid] = id(param)
                if device == "cuda" and key == "step" and value.dim() == 0 and id(param) in host_steps:
                    tracer.excluded.add(rid)  # torch keeps this step counter in host memory
    return owners


def build_optimizers(
    model: nn.Module, choice: OptimizerChoice, trainer: DryRunTrainer | None
) -> list[torch.optim.Optimizer]:
    """The step's optimizers: ``choice``'s over the trainable parameters, or a LightningModule's
    own (its ``configure_optimizers``, run on the stand-in); in a LightningModule's step, what
    ``self.optimizers()`` gives (``trainer``)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if choice.factory is not None:
        optimizer = choice.factory(trainable)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"estimate_memory(optimizer=...): the callable returned {type(optimizer).__name__}, "
                "not a torch.optim.Optimizer"
            )
        if trainer is not None:
            use_optimizers(trainer, [optimizer])
        return [optimizer]
    if trainer is None:
        raise ValueError(
            "estimate_memory(optimizer=None): a plain nn.Module needs an optimizer name or callable"
        )
    if trainer.optimizers:  # copies of the fit's own (optimizers_of_the_fit)
        return trainer.optimizers
    try:
        optimizers = configure(model, trainer)
    except Exception as error:
        raise EstimateError(
            f"configure_optimizers() failed in the dry run ({type(error).__name__}: {error}); "
            "pass optimizer='adamw' (or another name, or a callable params -> Optimizer)"
        ) from None
    if trainer._real is None and all(not group["params"] or is_mock_optimizer(o) for o in optimizers for group in o.param_groups):
        raise EstimateError(
            "configure_optimizers() returned no optimizer; pass optimizer='adamw' (or another name, "
            "or a callable params -> Optimizer)"
        )
    return optimizers


def optimizers_of_the_fit(trainer: DryRunTrainer | None, fakes: dict[int, torch.Tensor]) -> tuple[list[Any], list[Any]] | None:
    """The fit's own optimizers and scheduler configs, to be copied into the dry run (so planning
    runs no ``configure_optimizers`` and constructs no scheduler: a scheduler steps in its
    constructor), when they step exactly the module's parameters; None outside a fit, or where they
    hold other tensors (model-state offload's host copies): then the stand-in's ``configure_optimizers``."""
    real = trainer._real if trainer is not None else None
    optimizers = list(getattr(real, "optimizers", None) or [])
    if not optimizers or any(is_mock_optimizer(optimizer) for optimizer in optimizers):
        return None
    if not all(id(p) in fakes for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]):
        return None
    return optimizers, list(getattr(real, "lr_scheduler_configs", None) or [])
