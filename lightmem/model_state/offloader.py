"""Model-state offload: gradients and optimizer state on the host, parameters on the device.

``offload_optimizer(model, optimizer)`` keeps the model's parameters where they are and moves
everything else a training step holds for them to host memory:

1. **Gradients stream out during backward.** A post-accumulate-grad hook per parameter queues the
   copy of its final gradient to a host buffer on the device-to-host stream and releases the device
   gradient (``param.grad = None``) once the copy has run; at most ``max_grad_inflight_bytes`` of
   gradients wait on the device for their copy.
2. **The user's optimizer steps on the host.** The optimizer object itself is kept: its
   ``param_groups`` (the same dicts LR schedulers and Lightning see) are pointed at host copies of
   the parameters (same dtype, so the arithmetic is the one the device would do, bit for bit on
   CPU), its ``state`` moves with them, and its own class and hyperparameters run the step, with
   the fastest CPU implementation where the user left foreach/fused unset (torch's fused kernel
   where one exists: ``lightmem.model_state.host_kernel``), otherwise the user's choice. Clipping
   (``clip_grad_norm_`` over ``optimizer.param_groups``), zeroing and ``state_dict`` all see host
   tensors, so a checkpoint is in the optimizer's standard form.
3. **Parameters come back before they are read.** After each step the updated host copies are
   queued to the device on the host-to-device stream and the current compute stream waits for
   them (on the device: the host runs on), so whatever reads a parameter next is ordered after its
   copy; a forward on another stream waits too. Every host read of a gradient waits for its copy
   to host (docs/gpu-path.md says why a compute-stream wait would not do).

Under Lightning, ``lightmem.model_state.trainer_optimizers`` offloads every optimizer of a Trainer.

Gradient accumulation adds on the host in the gradient's dtype (``grad += new``, as autograd does
on the device). ``close()`` (or leaving the ``with`` block) puts everything back: the optimizer's
groups and state on the device parameters, pending host gradients in ``param.grad``.

With ``device_dtype=torch.bfloat16`` (opt-in, not exact) the device parameters are bf16 and the
host copies fp32 masters: ``lightmem.model_state.device_dtype``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightmem.config import DEFAULT_GRAD_INFLIGHT, OptimizerOffloadSettings, warn_once
from lightmem.model_state import host_grads
from lightmem.model_state.device_dtype import DeviceDtype, refuse_device_dtype
from lightmem.model_state.grad_clip import GradClip, tensor_norms, total_norm
from lightmem.model_state.host_kernel import HostKernel
from lightmem.model_state.overlap import OverlappedStep, _Landing, overlap_refusal
from lightmem.transfer.arena import HostArena
from lightmem.transfer.inflight import InflightTensors
from lightmem.transfer.transport import Transport, default_transport

_HOST = torch.device("cpu")

# Optimizers whose step re-evaluates the closure at parameter values the step itself moved to:
# with parameters updated on the host, the device forward would not see those values.
_RE_EVALUATING = ("LBFGS",)


@dataclass
class OptimizerOffloadStats:
    """What model-state offload held and moved. Byte counts of host memory are current values;
    ``grad_bytes_out``, ``param_bytes_in`` and ``waited_s`` cover the last optimizer step (and the
    backward passes accumulated into it); ``steps`` and the ``total_`` figures the whole run."""

    host_param_bytes: int = 0
    """Host copies of the parameters the optimizer steps (with ``device_dtype``: the fp32 masters
    and their bf16 copies that travel to the device)."""
    host_grad_bytes: int = 0
    """Host gradient buffers (accumulators and accumulation staging; with ``device_dtype``: the
    bf16 buffers the gradients land in and the masters' fp32 gradients)."""
    host_state_bytes: int = 0
    """Optimizer state (momentum, Adam moments, step counters) on the host."""
    grad_bytes_out: int = 0
    param_bytes_in: int = 0
    waited_s: float = 0.0
    """Time the training thread or compute stream waited for gradient and parameter copies."""
    peak_device_grad_bytes: int = 0
    """The most gradient bytes held on the device waiting for their copy to host (whole run)."""
    steps: int = 0
    total_grad_bytes_out: int = 0
    total_param_bytes_in: int = 0
    overlapped_bytes: int = 0
    """With ``overlap_step``: bytes of the parameters whose host step was over when the last
    backward ended (hidden behind backward); 0 without it."""
    overlapped_steps: int = 0
    """Optimizer steps (whole run) that took parameters stepped while backward ran."""
    host_kernel: str = ""
    """The implementation running the host step: "fused", "foreach", "for-loop" or "custom"."""
    grad_norm: float | None = None
    """The global 2-norm of the gradients the last step took (accumulated, before clipping),
    bitwise ``torch.nn.utils.get_total_norm``, where it was taken for that step (``clip_grad_norm``;
    under Lightning, a step whose metrics are read); None otherwise."""

    @property
    def host_bytes(self) -> int:
        """All host bytes model-state offload holds."""
        return self.host_param_bytes + self.host_grad_bytes + self.host_state_bytes


class _InstanceAttribute:
    """A handle whose ``remove()`` deletes an attribute set on one object (its class's comes back),
    or puts back the one set there before (``previous``: another offloader's, still open)."""

    def __init__(self, owner: Any, name: str, previous: Any = None) -> None:
        self.owner, self.name, self.previous = owner, name, previous

    def remove(self) -> None:
        if self.previous is not None:
            self.owner.__dict__[self.name] = self.previous
        else:
            self.owner.__dict__.pop(self.name, None)


@dataclass
class _Slot:
    """One offloaded parameter: the device tensor, its host copy and its gradient buffers."""

    param: nn.Parameter
    master: nn.Parameter
    grad_buffer: torch.Tensor | None = None
    staging: torch.Tensor | None = None
    landing: str | None = None  # "direct" (into grad_buffer) or "staged" (to add) while a copy runs
    group: int = 0  # index of its param group
    overlapped: bool = False  # handed to the overlapped step since the last optimizer.step()
    seen: _Written | None = None  # the device parameter as lightmem last wrote or read it


class _Written:
    """A parameter's version, data pointer and storage (weakly): anything that writes it in place
    bumps the version, and replacing its ``.data`` changes the storage, even where the new one
    lands at the old address (the weak reference keeps the old storage's identity taken)."""

    __slots__ = ("version", "data_ptr", "storage")

    def __init__(self, param: torch.Tensor) -> None:
        self.version, self.data_ptr = param._version, param.data_ptr()
        self.storage = StorageWeakRef(param.untyped_storage())

    def after_own_write(self, param: torch.Tensor) -> None:
        """lightmem wrote ``param`` in place (its copy back): the storage seen stays, the version moves."""
        if param.data_ptr() == self.data_ptr:
            self.version = param._version
        else:  # replaced since it was last seen (a write that broke overlap_step's contract)
            self.__init__(param)  # type: ignore[misc]

    def still(self, param: torch.Tensor) -> bool:
        storage = self.storage
        return (
            param._version == self.version
            and param.data_ptr() == self.data_ptr
            and not storage.expired()
            and storage.cdata == param.untyped_storage()._cdata
        )



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


def _optimized_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            seen.setdefault(id(param), param)
    return list(seen.values())


def _check_params(params: list[nn.Parameter], settings: OptimizerOffloadSettings, flag: str) -> torch.device:
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


def _refuse_sparse_gradients(model: nn.Module, params: list[nn.Parameter], flag: str) -> None:
    """Embeddings with ``sparse=True`` give sparse gradients, which have no host buffer layout
    (and no fused kernel): refuse them before anything changed."""
    stepped = {id(param) for param in params}
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) and id(getattr(module, "weight", None)) in stepped:
            raise ValueError(
                f"{flag}: module '{name}' is {type(module).__name__}(sparse=True): its sparse gradients "
                "cannot be offloaded; construct it with sparse=False or turn the option off"
            )


class OptimizerOffloader:
    """Gradients and optimizer state of ``optimizer`` on the host; see the module docstring.

    Built by :func:`offload_optimizer`. The user's optimizer object keeps working as before:
    ``optimizer.step()``, ``zero_grad()``, LR schedulers, ``clip_grad_norm_`` over its
    ``param_groups`` params, ``state_dict()`` / ``load_state_dict()``.

    What changes for the user: ``param.grad`` of the model's parameters is ``None`` after backward
    (the gradient is on the host, in ``p.grad`` for ``p`` in ``optimizer.param_groups``); read the
    parameters' gradients there, or by name with ``lightmem.named_grads(model)``. That host
    gradient is one buffer per parameter, rewritten by each backward: clone it to keep a gradient
    beyond its step.

    ``host_kernel`` names what runs the step on the host (``.name``: "fused", "foreach",
    "for-loop" or "custom"; ``str()`` adds why), also in ``stats.host_kernel``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        settings: OptimizerOffloadSettings,
        transport: Transport | None = None,
        reducer: Any = None,
        overlap: str | None = None,
        clip: GradClip | None = None,
    ) -> None:
        flag = settings.flag("enabled")
        if not isinstance(model, nn.Module):
            raise ValueError(f"{flag}: expected the model (an nn.Module) first; got {type(model).__name__}")
        _check_optimizer(optimizer, settings)
        params = _optimized_params(optimizer)
        self.device = _check_params(params, settings, flag)
        _refuse_sparse_gradients(model, params, flag)
        if settings.device_dtype is not None:
            refuse_device_dtype(params, settings, reducer)
        self.model = model
        self.optimizer = optimizer
        self.settings = settings
        self.transport = transport if transport is not None else default_transport(settings.devices)
        self._stats = OptimizerOffloadStats()
        self._inflight = InflightTensors(settings.max_grad_inflight_bytes, self.transport)  # device gradients still copied
        self._unlanded: list[Any] = []  # every gradient copy event since the last landing
        self._landing: list[_Slot] = []
        self._callback_task: int | None = None
        self._callback: weakref.ref[Any] | None = None  # the end-of-backward callback queued, until it ran
        self._closed = False
        self._step_grad_bytes = 0
        self._waited_base_s = self.transport.waited_s()
        self._reducer = reducer
        self._copies_back: Any = None  # event of the last copy of the parameters to the device
        self._ordered_streams: list[Any] = []  # compute streams ordered after those copies
        self._params_arena = HostArena(params, self.transport, self.device)
        self._added_arenas: list[HostArena] = []  # host copies of param groups added while offloaded
        self._grads_arena: HostArena | None = None
        self._staging_arena: HostArena | None = None
        self._slots: dict[int, _Slot] = {}
        self._slot_of_master: dict[int, _Slot] = {}  # the groups hold the masters
        self._frozen: list[_Slot] = []  # no gradient hook (autograd refuses one) until unfrozen
        group_of = {id(param): index for index, group in enumerate(optimizer.param_groups) for param in group["params"]}
        self._add_host_copies(params, self._params_arena, group_of)
        self._device_dtype: DeviceDtype | None = None
        self._device_dtype_arenas: list[HostArena] = []
        if settings.device_dtype is not None:
            # The bf16 copies that travel to the device (page-locked) and the masters' fp32
            # gradients (host only: nothing copies them).
            slots = list(self._slots.values())
            dtype = settings.device_dtype
            narrow = [torch.empty(slot.master.shape, dtype=dtype, device="meta") for slot in slots]
            self._device_dtype_arenas = [
                HostArena(narrow, self.transport, self.device),
                HostArena([slot.master for slot in slots], self.transport, self.device, page_locked=False),
            ]
            narrow_arena, wide_arena = self._device_dtype_arenas
            self._device_dtype = DeviceDtype(slots, dtype, narrow_arena.tensors, wide_arena.tensors)
        self._overlap_mode = overlap  # None, "every-backward" or "step-closure"
        # Plain loop: clipping this offloader applies before every step (in the overlapped step as
        # gradients land). "step-closure" (Lightning): the clipping Lightning asks for, which the
        # overlapped step applies while Lightning's own call is taken as done (``takes_clipping``).
        self._clip = clip if overlap != "step-closure" else None  # applied here when no step overlaps
        self._grad_norm: torch.Tensor | None = None
        self._grad_norm_step = 0  # the step (counted from 1, as stats.steps) _grad_norm was taken for
        self.grad_norm_wanted: Callable[[], bool] = lambda: False
        """Whether the step now running takes the gradients' global norm (under Lightning: the steps
        whose metrics are read); clipping by norm takes it every step anyway."""
        self._accumulating = False
        self.overlap_note = "host step overlapped with backward" if overlap else "host step after backward"
        """For the line at fit start: whether the host step overlaps backward, and why not."""
        self._overlap: OverlappedStep | None = None
        self._in_step_closure = False
        # Under Lightning ("step-closure") the first step runs after backward and watches: nested
        # backward passes (reentrant checkpointing) or a parameter given two gradients in one
        # step (one shared across such passes) would make a gradient look final before it is.
        self._on_probation = overlap == "step-closure"
        self._nested_backward = self._repeated_gradient = False
        self._order_state = False  # the step took parameters stepped during backward
        self._hidden: list[tuple[nn.Parameter, torch.Tensor]] = []  # stepped during backward: grads hidden from the step
        if overlap is not None:
            refusal = overlap_refusal(optimizer) or (
                "under DDP a gradient is final only once the reducer averaged it, at the end of backward"
                if reducer is not None
                else None
            )
            if refusal is not None:
                raise ValueError(f"{settings.flag('overlap_step')}: {refusal}; leave it off")
            # About eight steps per backward: few enough that their Python is small beside the
            # kernels, enough that all but the last layers' step hides behind backward.
            batch_bytes = max(self._params_arena.nbytes // 8, 1)
            self._overlap = OverlappedStep(optimizer, self.transport.host_wait, batch_bytes, self.device, clip)
        self.host_kernel = HostKernel(optimizer)
        self.host_kernel.select()  # before the swap: "step" counters go where the kernel keeps them
        self._swap_optimizer(to_host=True)
        self._handles: list[Any] = []
        if reducer is None:  # gradients already there (a backward before offload) go where the step reads them
            for slot in self._slots.values():
                self._take_device_grad(slot)
        device_dtype = self._device_dtype
        if device_dtype is not None:
            # The state dict holds the fp32 masters; a load sets them (hooks take functions, not methods).
            put_masters = model.register_state_dict_post_hook(lambda *args: device_dtype.put_masters(*args))
            take_loaded = model.register_load_state_dict_pre_hook(lambda *args: device_dtype.take_loaded(*args))
            self._handles += [put_masters, take_loaded]
            device_dtype.cast_device_params()  # after every refusal: nothing raises past here
        for slot in self._slots.values():
            slot.seen = _Written(slot.param)  # the device parameters as lightmem leaves them
            self._watch(slot)
        # Any forward of the model, on whichever stream is current, reads the parameters only after
        # their copies back (one wait per stream and step; the step waits on its own stream).
        self._handles.append(model.register_forward_pre_hook(lambda *args: self.wait_for_params(), prepend=True))
        self._handles.append(model.register_state_dict_pre_hook(lambda *args, **kwargs: self._before_state_dict()))
        self._handles.append(model._register_load_state_dict_pre_hook(lambda *args, **kwargs: self.wait_for_params()))
        self._handles.append(model.register_load_state_dict_post_hook(lambda *args: self.refresh_host_params()))
        # Gradients of a backward that raised never reach its end-of-backward callback: they land
        # before the next zero_grad, which then clears them as it clears the device's.
        users_zero_grad = optimizer.zero_grad

        def zero_grad(*args: Any, **kwargs: Any) -> None:
            self._refuse_pending_overlap("optimizer.zero_grad()")
            if self._landing or self._unlanded:
                self._land_all()
            self._land_device_grads()  # cleared with the host gradients, as the device's would be
            self._callback_task = None
            users_zero_grad(*args, **kwargs)

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        self._handles.append(_InstanceAttribute(optimizer, "zero_grad"))
        # model.zero_grad() clears the gradients of the model's parameters: theirs are on the host.
        # Called as the caller called it (set_to_none by keyword, by position or not at all): an
        # override of the module's zero_grad, or a recorder of its calls, sees the call it expects.
        users_model_zero_grad, previous = model.zero_grad, model.__dict__.get("zero_grad")

        def model_zero_grad(*args: Any, **kwargs: Any) -> None:
            users_model_zero_grad(*args, **kwargs)
            self.optimizer.zero_grad(*args, **kwargs)

        model.zero_grad = model_zero_grad  # type: ignore[method-assign]
        self._handles.append(_InstanceAttribute(model, "zero_grad", previous))
        users_add_param_group = optimizer.add_param_group

        def add_param_group(param_group: dict[str, Any]) -> None:
            self._refuse_pending_overlap("optimizer.add_param_group()")
            undo = self._undo_point()
            try:
                users_add_param_group(self._offload_added_group(param_group))
            except BaseException:
                self._undo_to(undo)  # torch refused the group: nothing of it stays offloaded
                raise
            self.host_kernel.select(added=len(optimizer.param_groups) - 1)

        optimizer.add_param_group = add_param_group  # type: ignore[method-assign]
        self._handles.append(_InstanceAttribute(optimizer, "add_param_group"))
        # First among the step hooks: a hook the user registered earlier (weight averaging, logging
        # the weights after a step) must see the host step's parameters back on the device.
        for register, hooks, hook in (
            (optimizer.register_step_pre_hook, optimizer._optimizer_step_pre_hooks, self._before_step),
            (optimizer.register_step_post_hook, optimizer._optimizer_step_post_hooks, self._after_step),
        ):
            handle = register(hook)
            hooks.move_to_end(handle.id, last=False)
            self._handles.append(handle)
        # A checkpoint's param groups replace ours, with their own foreach/fused: choose again.
        reselect = optimizer.register_load_state_dict_post_hook(lambda _: self.host_kernel.select())
        self._handles.append(reselect)
        self._handles.append(optimizer.register_state_dict_post_hook(lambda _, state: self.host_kernel.in_state_dict(state)))
        if self._overlap is not None:
            overlap_step = self._overlap
            # The worker writes the optimizer's state while backward runs: a state_dict waits for it.
            self._handles.append(optimizer.register_state_dict_pre_hook(lambda _: overlap_step.idle()))
            refuse = optimizer.register_load_state_dict_pre_hook(
                lambda *_: self._refuse_pending_overlap("optimizer.load_state_dict()")
            )
            self._handles.append(refuse)
        self._stats.host_param_bytes = self._params_arena.nbytes + (
            self._device_dtype_arenas[0].nbytes if self._device_dtype_arenas else 0
        )

    def _offload_added_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """``optimizer.add_param_group`` while offloaded (Lightning's ``BackboneFinetuning``
        unfreezing a backbone): its parameters are offloaded as those at the start were, and the
        group torch adds holds their host copies."""
        params = param_group["params"]
        if isinstance(params, set):
            return param_group  # torch refuses a set (its order is not kept) with its own message
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        held = [param for param in params if id(param) in self._slots]
        if held:
            raise ValueError(
                f"{self.settings.flag('enabled')}: add_param_group got {len(held)} parameter(s) the optimizer "
                "already holds (while offloaded its groups hold their host copies, so a check for parameters "
                "already in the optimizer does not find them); leave them out of the new group"
            )
        masters = {id(slot.master) for slot in self._slots.values()}
        # A host copy given again is left to torch, which refuses it; a parameter given twice in the
        # group gets one host copy, there twice (torch warns and steps it twice, as it would).
        new = list({id(param): param for param in params if id(param) not in masters}.values())
        if not new:
            return param_group
        swapped = self._offload_new(new, len(self.optimizer.param_groups))
        return {**param_group, "params": [swapped.get(id(param), param) for param in params]}

    def adopt_param_groups(self) -> None:
        """Parameters put in the param groups behind the offloader's back (groups assigned, as
        Lightning's ``BaseFinetuning`` does when it restores its groups on resume): a device
        parameter of ours becomes its host copy again, any other is offloaded as an added group's
        is, and optimizer state kept for either moves to the host copy. Each parameter's group
        index follows the groups' order. At the first gradient of each backward, before each step
        and before a checkpoint's optimizer state is loaded under Lightning."""
        masters = self._slot_of_master
        state = self.optimizer.state
        moved = False
        for index, group in enumerate(self.optimizer.param_groups):
            for param in group["params"]:
                slot = masters.get(id(param))
                if slot is None:
                    break
                slot.group = index
            else:
                continue
            self._refuse_pending_overlap("a param group put in the optimizer")
            new = {
                id(param): param for param in group["params"] if id(param) not in masters and id(param) not in self._slots
            }
            swapped = self._offload_new(list(new.values()), index) if new else {}
            swapped.update({id(param): self._slots[id(param)].master for param in group["params"] if id(param) in self._slots})
            for param in group["params"]:
                if param in state and id(param) in swapped:
                    moved = True
                    state[swapped[id(param)]] = {
                        name: value.to(_HOST) if isinstance(value, torch.Tensor) else value
                        for name, value in state.pop(param).items()
                    }
            group["params"] = [swapped.get(id(param), param) for param in group["params"]]
            for param in group["params"]:
                if id(param) in masters:
                    masters[id(param)].group = index
            self.host_kernel.select(added=index)
        if moved:  # state in the groups' order, as one step over them (or a load) puts it
            order = {id(param): position for position, param in enumerate(_optimized_params(self.optimizer))}
            entries = sorted(state.items(), key=lambda entry: order.get(id(entry[0]), len(order)))
            state.clear()
            state.update(entries)

    def _offload_new(self, params: list[nn.Parameter], index: int) -> dict[int, nn.Parameter]:
        """Host copies, gradient hooks and slots for ``params`` of param group ``index``, joining
        while offloaded; returns each one's host copy by ``id``."""
        flag = self.settings.flag("enabled")
        if self._device_dtype is not None:
            raise ValueError(
                f"{flag}: add_param_group while offloaded with {self.settings.flag('device_dtype')}: add every "
                "param group before offload starts"
            )
        _check_params([*params, next(iter(self._slots.values())).param], self.settings, flag)
        _refuse_sparse_gradients(self.model, params, flag)
        if self._overlap is not None:
            self._overlap.idle()  # no step of the host copies running while the groups change
        arena = HostArena(params, self.transport, self.device)
        self._added_arenas.append(arena)
        self._stats.host_param_bytes += arena.nbytes
        slots = self._add_host_copies(params, arena, dict.fromkeys(map(id, params), index))
        for slot in slots:
            if self._reducer is None:  # under DDP it stays: no_sync may be adding to it; the reduced one is sent
                self._take_device_grad(slot)
            slot.seen = _Written(slot.param)
            self._watch(slot)
        return {id(slot.param): slot.master for slot in slots}

    def _add_host_copies(self, params: list[nn.Parameter], arena: HostArena, group_of: dict[int, int]) -> list[_Slot]:
        """A slot per parameter: its host copy carved from ``arena``, with its value, in group ``group_of[id]``."""
        slots = []
        with torch.no_grad():
            for param, host in zip(params, arena.tensors):
                host.copy_(param.detach())
                master = nn.Parameter(host, requires_grad=param.requires_grad)
                slot = self._slots[id(param)] = self._slot_of_master[id(master)] = _Slot(param, master, group=group_of[id(param)])
                slots.append(slot)
        host_grads.hold(params, self)
        return slots

    def _watch(self, slot: _Slot) -> None:
        """From now on ``slot``'s final gradient goes to the host through a hook, or, frozen, once
        it is unfrozen (``_land_device_grads``)."""
        if slot.param.requires_grad:
            self._handles.append(slot.param.register_post_accumulate_grad_hook(self._on_grad_final))
        else:
            self._frozen.append(slot)

    def _take_device_grad(self, slot: _Slot) -> None:
        """The gradient on ``slot``'s device parameter joins its host copy's, in its dtype (a bf16
        one widened exactly), added as autograd would."""
        grad, slot.param.grad = slot.param.grad, None
        if grad is None:
            return
        with torch.no_grad():
            if slot.master.grad is None:
                slot.master.grad = grad.to(_HOST, dtype=slot.master.dtype, copy=True)
            else:
                slot.master.grad.add_(grad.to(_HOST))

    def _land_device_grads(self) -> None:
        """Gradients left on the device by parameters lightmem had no hook on when their backward
        ran (a parameter frozen when offload started, unfrozen since) join the host gradients,
        added as autograd would; an unfrozen parameter gets its hook for the backward passes to
        come. Under DDP the gradients ``no_sync`` keeps on the device land too (a step or a
        ``zero_grad`` inside the window). At the end of each backward, before each step and
        ``zero_grad``.

        Raises:
            ValueError: a gradient set on a device parameter lightmem hooks (``p.grad = ...``
                after backward): the step reads the host copy's gradient, which it would not
                replace.
        """
        unhooked = {id(slot) for slot in self._frozen}
        for slot in [slot for slot in self._frozen if slot.param.requires_grad]:
            self._frozen.remove(slot)
            slot.master.requires_grad_(True)
            self._watch(slot)
        left = [slot for slot in self._slots.values() if slot.param.grad is not None and slot.landing is None]
        if not left:
            return
        stray = [slot for slot in left if id(slot) not in unhooked] if self._reducer is None else []
        if stray:
            raise ValueError(
                f"{self.settings.flag('enabled')}: {len(stray)} parameter(s) of shape "
                f"{list(stray[0].param.shape)}{' and others' if len(stray) > 1 else ''} have a gradient on the "
                "device that lightmem did not put there (set by hand after backward?); while offloaded the step "
                "reads the gradient of each parameter's host copy: set `.grad` of the tensors in "
                "optimizer.param_groups instead"
            )
        self._host_wait_params()
        for slot in left:
            self._take_device_grad(slot)

    def _undo_point(self) -> tuple[set[int], int, list[_Slot], int]:
        return set(self._slots), len(self._handles), list(self._frozen), len(self._added_arenas)

    def _undo_to(self, point: tuple[set[int], int, list[_Slot], int]) -> None:
        """Forget the parameters offloaded since ``point`` (their gradients back on the device)."""
        slots, handles, frozen, arenas = point
        with torch.no_grad():
            for key in set(self._slots) - slots:
                slot = self._slots.pop(key)
                del self._slot_of_master[id(slot.master)]
                host_grads.release([slot.param])
                if slot.master.grad is not None:
                    slot.param.grad = slot.master.grad.to(slot.param.device, copy=True)
        for handle in self._handles[handles:]:
            handle.remove()
        del self._handles[handles:]
        self._frozen[:] = frozen
        for arena in self._added_arenas[arenas:]:
            self._stats.host_param_bytes -= arena.nbytes
            arena.close()
        del self._added_arenas[arenas:]

    @property
    def _overlap_pending(self) -> bool:
        """Parameters were handed to the overlapped step since the last ``optimizer.step()``."""
        return self._overlap is not None and self._overlap.pending

    def host_copies(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """``(parameter, its host copy)`` for every parameter offloaded: the param groups hold the
        host copies while offloaded."""
        return [(slot.param, slot.master) for slot in self._slots.values()]

    def host_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the step reads for the device parameter ``param`` (its host copy's), None
        for none or a parameter not offloaded here; with a step overlapped with backward pending,
        once the worker has done what it was handed (it may clip). ``lightmem.named_grads`` reads
        the gradients of a module's parameters by name."""
        slot = self._slots.get(id(param))
        if slot is None:
            return None
        if self._overlap_pending:
            self._overlap.idle()  # type: ignore[union-attr]
        return slot.master.grad

    def remove_at_close(self, handle: Any) -> None:
        """``handle.remove()`` runs when this offloader closes (a hook set on its behalf elsewhere)."""
        self._handles.append(handle)

    # -- public state -------------------------------------------------------------------------

    @property
    def stats(self) -> OptimizerOffloadStats:
        """Host bytes held now, and the traffic of the last step (see ``OptimizerOffloadStats``)."""
        arenas = [arena for arena in (self._grads_arena, self._staging_arena) if arena is not None]
        carved = {id(tensor) for arena in arenas for tensor in arena.tensors}
        # Buffers of their own: a gradient unlike its parameter, a parameter of a group added later.
        loose = sum(
            buffer.nbytes
            for slot in self._slots.values()
            for buffer in (slot.grad_buffer, slot.staging)
            if buffer is not None and id(buffer) not in carved
        )
        self._stats.host_grad_bytes = (
            sum(arena.nbytes for arena in arenas) + loose + sum(arena.nbytes for arena in self._device_dtype_arenas[1:])
        )
        # list(): the overlapped step may add state entries from its thread while backward runs
        self._stats.host_state_bytes = sum(
            value.nbytes
            for state in list(self.optimizer.state.values())
            for value in list(state.values())
            if isinstance(value, torch.Tensor)
        )
        self._stats.host_kernel = self.host_kernel.name
        return self._stats

    @property
    def device_dtype_note(self) -> str:
        """For the line at fit start: "bf16 parameters on the device, fp32 masters on the host", or ""."""
        return self._device_dtype.note if self._device_dtype is not None else ""

    @property
    def host_bytes_held(self) -> int:
        """Host bytes of parameter copies, gradients and optimizer state (for the host budget and guard)."""
        return self.stats.host_bytes

    def wait_for_params(self) -> None:
        """Make the device parameters current for work queued from now on on the current compute
        stream: it waits (on the device, the host does not) for the copies of the last step."""
        if self._copies_back is None or self.transport.synchronous:
            return
        compute, _, _ = self.transport.streams(self.device)
        if any(stream == compute for stream in self._ordered_streams):
            return
        self.transport.wait(compute, self._copies_back)
        self._ordered_streams.append(compute)

    def refresh_host_params(self) -> None:
        """Copy every device parameter into the host copy the optimizer steps. Done for you: after
        ``model.load_state_dict``, and before each step for the parameters written since lightmem
        last did (``take_device_writes``). With ``device_dtype`` a ``model.load_state_dict`` sets
        the fp32 masters to the checkpoint's values exactly; otherwise the masters take the
        device's bf16 values."""
        if self._overlap is not None:
            self._overlap.idle()  # no step of the host copies still running
        self._host_wait_params()  # every copy to the device has run: nothing left for compute to wait on
        if self._device_dtype is not None:
            self._device_dtype.refresh_masters()
        else:
            with torch.no_grad():
                for slot in self._slots.values():
                    slot.master.copy_(slot.param.detach())
        for slot in self._slots.values():
            slot.seen = _Written(slot.param)

    def take_device_writes(self) -> int:
        """The device parameters written since lightmem last wrote them (an in-place write, e.g.
        weight clipping after a step or ``reset_parameters()``, or ``.data`` replaced) are copied
        into their host copies, so the next step starts from them, as it would without lightmem
        (with ``device_dtype``: their bf16 values, widened). Runs by itself before each step (with
        ``overlap_step``, at the first gradient of the backward), before ``model.state_dict()``
        and at ``close()``; not while an overlapped step is pending. Returns how many were taken."""
        if self._overlap_pending:
            return 0  # the worker may be stepping the host copies; a write now breaks overlap_step's contract
        written = [slot for slot in self._slots.values() if slot.seen is None or not slot.seen.still(slot.param)]
        if not written:
            return 0
        self._host_wait_params()  # the host copies are rewritten: the copies from them have run
        with torch.no_grad():
            for slot in written:
                slot.master.copy_(slot.param.detach())
                slot.seen = _Written(slot.param)
        return len(written)

    def _before_state_dict(self) -> None:
        self.wait_for_params()
        if self._device_dtype is not None and not self._overlap_pending:
            self.take_device_writes()  # the state dict holds the masters

    # -- backward: gradients out --------------------------------------------------------------

    def _on_grad_final(self, param: torch.Tensor) -> None:
        if self._closed:
            return
        if self._reducer is not None:
            self._await_reduction()
            return
        grad, slot = param.grad, self._slots.get(id(param))
        if grad is None or slot is None:  # slot None: a hook left by a group torch refused
            return
        param.grad = None
        self._queue_landing()
        self._send(slot, grad)

    def _queue_landing(self) -> None:
        """Once per backward, queue the landing of its gradients for when the whole backward is over.

        Reentrant checkpointing runs a backward of its own per segment, nested inside the outer
        one: a callback queued there would host-sync at the end of every segment. Its callback
        finds the outer node still running (``_current_autograd_node``) and moves the landing to
        the outer backward's end instead, through a hook on that node; while a callback is pending
        (alive and not run: the engine drops it with a graph task that raised) no other is queued.
        """
        task = torch._C._current_graph_task_id()
        if task == self._callback_task:
            return
        if self._callback is not None and self._callback() is not None:
            self._nested_backward = True  # another graph task inside this backward (reentrant checkpoint)
            return
        self._callback_task = task

        def finish_backward() -> None:
            outer = torch._C._current_autograd_node()
            if outer is not None:  # the end of a nested backward: the outer one goes on
                self._nested_backward = True
                outer.register_hook(lambda grad_inputs, grad_outputs: self._queue_landing())
                return
            self._callback = None
            self._finish_backward()

        self._callback = weakref.ref(finish_backward)
        # Runs once the whole backward is over, in the thread that called backward.
        torch.autograd.Variable._execution_engine.queue_callback(finish_backward)

    def _await_reduction(self) -> None:
        """Under DDP: a gradient is final only once the reducer has averaged it, at the end of
        backward; under ``no_sync`` (accumulation) it stays on the device and DDP sums it there."""
        task = torch._C._current_graph_task_id()
        if task == self._callback_task or not self._reducer.require_backward_grad_sync:
            return
        self._callback_task = task
        # DDP queues its finalize (averaged gradients into param.grad) after the last bucket is
        # ready, so after this callback: queue ours from here to run after DDP's.
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._take_reduced))

    def _take_reduced(self) -> None:
        for slot in self._slots.values():
            grad = slot.param.grad
            if grad is not None:
                slot.param.grad = None
                self._send(slot, grad)
        self._finish_backward()

    def _send(self, slot: _Slot, grad: torch.Tensor) -> None:
        """Queue ``grad``'s copy to the host: into the gradient buffer, or into staging to add; with
        the overlap on for this backward, hand it to the overlapped step, which lands it."""
        overlap = self._overlap
        overlapping = overlap is not None and (
            (self._overlap_mode == "every-backward" and not self._accumulating)
            or (self._in_step_closure and not self._on_probation)
        )
        if slot.overlapped:
            self._refuse_pending_overlap("a second gradient for a parameter already stepped")
        if slot.landing is not None:  # one still pending from a backward that raised (or a hook that fired twice)
            self._repeated_gradient = True
            self._land_all()
        staged = slot.master.grad is not None
        if self._device_dtype is not None:  # into its bf16 buffer, widened into the master's fp32 at landing
            slot.grad_buffer = target = self._buffer(slot, grad, staging=False)
        elif staged:
            slot.staging = target = self._buffer(slot, grad, staging=True)
        else:
            slot.grad_buffer = target = self._buffer(slot, grad, staging=False)
        if overlapping:
            slot.overlapped = True
            if not overlap.pending:  # type: ignore[union-attr]
                self.take_device_writes()  # before the worker steps any host copy
                self.adopt_param_groups()  # and with each parameter's group index as the groups are now
                overlap.begin(self._copies_back, take_norms=self.grad_norm_wanted())  # type: ignore[union-attr]
        else:
            self._landing.append(slot)
            slot.landing = "staged" if staged else "direct"
        self._step_grad_bytes += grad.nbytes
        transport = self.transport
        if transport.synchronous:
            with torch.no_grad():
                transport.copy_to_host(target, grad, None)
            if overlapping:
                overlap.submit(_Landing(slot.master, slot.group, target, staged, None))  # type: ignore[union-attr]
            return
        compute, to_host, _ = transport.streams(grad.device)
        transport.wait(to_host, transport.record(compute))
        with torch.no_grad():
            transport.copy_to_host(target, grad, to_host)
        event = transport.record(to_host)
        if overlapping:
            overlap.submit(_Landing(slot.master, slot.group, target, staged, event))  # type: ignore[union-attr]
        else:
            self._unlanded.append(event)
        self._inflight.add(event, grad)
        self._stats.peak_device_grad_bytes = max(self._stats.peak_device_grad_bytes, self._inflight.bytes)
        self._inflight.retire(compute)  # the landing host-waits every copy event of the backward

    def _buffer(self, slot: _Slot, like: torch.Tensor, staging: bool) -> torch.Tensor:
        """``slot``'s host gradient (or accumulation staging) buffer, carved with every other
        parameter's from one arena the first time one is needed."""
        current = slot.staging if staging else slot.grad_buffer
        if current is not None and current.shape == like.shape and current.dtype == like.dtype:
            return current
        arena = self._staging_arena if staging else self._grads_arena
        if arena is None:
            # Shaped like the device parameters: the gradients come in their dtype.
            params = [other.param for other in self._slots.values()]
            arena = HostArena(params, self.transport, self.device)
            for other, tensor in zip(self._slots.values(), arena.tensors):
                if staging:
                    other.staging = tensor
                else:
                    other.grad_buffer = tensor
            if staging:
                self._staging_arena = arena
            else:
                self._grads_arena = arena
            current = slot.staging if staging else slot.grad_buffer
            if current.shape == like.shape and current.dtype == like.dtype:
                return current
        # A gradient unlike its parameter (another dtype): a buffer of its own.
        return torch.empty(like.shape, dtype=like.dtype, device=_HOST, pin_memory=self.transport.pin_memory)

    def _finish_backward(self) -> None:
        self._callback_task = None
        overlap = self._overlap
        if overlap is not None:
            self._stats.overlapped_bytes = overlap.stepped_bytes if overlap.pending else 0
            if overlap.pending:
                overlap.land_now()  # every host gradient in place after backward, as without overlap
        self._land_all()
        self._land_device_grads()  # into the clipping's norm too
        if overlap is not None and overlap.pending:
            overlap.end_backward()  # by norm: every gradient is in place; the worker clips and steps them all

    def _land_all(self) -> None:
        """Every gradient copy has run: accumulate on the host exactly as autograd would on the device."""
        transport = self.transport
        for event in self._unlanded:
            transport.host_wait(event)
        self._unlanded.clear()
        self._inflight.release_all(self.device)  # copies of gradients the overlapped step lands may run on
        self._host_wait_params()  # the step about to follow rewrites the host copies
        widen = self._device_dtype
        with torch.no_grad():
            for slot in self._landing:
                if widen is not None:  # device_dtype: the bf16 buffer widened, or added (fp32 += bf16)
                    if slot.landing == "direct":
                        slot.master.grad = widen.widened(slot, slot.grad_buffer)  # type: ignore[arg-type]
                    elif slot.landing == "staged":
                        slot.master.grad.add_(slot.grad_buffer)  # type: ignore[union-attr,arg-type]
                elif slot.landing == "direct":
                    slot.master.grad = slot.grad_buffer
                elif slot.landing == "staged":
                    slot.master.grad.add_(slot.staging)  # type: ignore[union-attr]
                slot.landing = None
        self._landing.clear()

    # -- the step on the host -----------------------------------------------------------------

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        self._restore_hidden()
        self.adopt_param_groups()
        self._rehost_state()
        # ``args`` starts with the optimizer itself (torch passes the step's own arguments).
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._ready_for_step()
            return None

        # Lightning passes the forward and backward as the closure: the host waits for what the
        # step reads and writes only once they are queued, never before the forward.
        # Under Lightning the backward in the closure is the one this step follows: the one
        # whose gradients an overlapped step may take ("step-closure").
        def closure_then_ready() -> Any:
            self._in_step_closure = True
            try:
                loss = closure()
            finally:
                self._in_step_closure = False
            self._ready_for_step()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_ready}
        return (args[0], closure_then_ready, *args[2:]), kwargs

    def _ready_for_step(self) -> None:
        """Before the host arithmetic: every gradient landed, every copy of the host parameters to
        the device has read them (the step rewrites them)."""
        if self._landing or self._unlanded:  # a backward that raised never reached its callback
            self._land_all()
        self._callback_task = None
        self._land_device_grads()
        self._host_wait_params()
        if self._overlap_pending:
            self._take_overlapped()
            return
        self.take_device_writes()
        if self._clip is not None and self._overlap_mode != "step-closure":
            self._took_grad_norm(self._clip.clip(_optimized_params(self.optimizer)))
        else:
            self.take_grad_norm()

    # -- the step overlapped with backward (overlap.py) ----------------------------------------

    def _take_overlapped(self) -> None:
        """The parameters stepped during backward are this step's: check that what they were
        stepped with is what the step would have used, and hide their gradients from the rest of
        the step (torch's optimizers skip a parameter without one) until it is over."""
        overlap = self._overlap
        assert overlap is not None
        clip = overlap.clip
        try:
            overlap.end_backward()  # by norm, after a backward that raised before its end: clip and step what landed
            overlap.join()
            changes = overlap.changes()
            written = sum(  # of parameters the copy back rewrites: those with a gradient
                slot.master.grad is not None and slot.seen is not None and not slot.seen.still(slot.param)
                for slot in self._slots.values()
            )
            if written:  # the copy back would write over them
                changes.append(f"the device values of {written} parameters (written after backward)")
        except BaseException:
            self._end_overlap()
            raise
        if changes:
            stepped = len(overlap.stepped)
            self._end_overlap()
            raise RuntimeError(
                f"{self.settings.flag('overlap_step')}: {stepped} parameters were stepped on the host as "
                f"their gradients landed, and since then {'; '.join(changes)} changed: they keep the step "
                "taken with the values at the end of backward. Turn overlap_step off where anything between "
                "backward and optimizer.step() changes gradients or param groups (clipping: give it to "
                "clip_grad_norm or clip_grad_value instead; a GradScaler; an LR change)"
            )
        params = _optimized_params(self.optimizer)
        if clip is not None and clip.by_norm:
            self._took_grad_norm(overlap.grad_norm)
        elif overlap.takes_norms:  # from the norms taken as gradients landed; before the clamp below
            grads = [param.grad for param in params if param.grad is not None]
            self._took_grad_norm(overlap.norm_of(grads))  # type: ignore[arg-type]
        if clip is not None and not clip.by_norm:
            # By value: gradients that did not land in this backward (accumulated) too.
            stepped = {id(master) for master, _, _ in overlap.stepped}
            clip.clamp([param for param in params if id(param) not in stepped])
        with torch.no_grad():
            for master, grad, _ in overlap.stepped:
                master.grad = None
                self._hidden.append((master, grad))
        self._end_overlap()
        self._order_state = True
        self._stats.overlapped_steps += 1

    def _end_probation(self) -> None:
        self._on_probation = False
        if self._nested_backward or self._repeated_gradient:
            why = "nested backward passes (reentrant checkpointing)" if self._nested_backward else (
                "a parameter given two gradients in one step"
            )
            self._overlap_mode = None
            self._overlap.close()  # type: ignore[union-attr]
            self._overlap = None
            self.overlap_note = f"host step after backward: the first step showed {why}"
            warn_once(
                f"lightmem: {self.settings.flag('overlap_step')}: off from now on, the first step showed {why}: "
                "a gradient may look final before it is; the host step runs after backward"
            )

    def _end_overlap(self) -> None:
        for slot in self._slots.values():
            slot.overlapped = False
        self._overlap.commit()  # type: ignore[union-attr]

    def _restore_hidden(self) -> None:
        for master, grad in self._hidden:
            master.grad = grad
        self._hidden.clear()

    def _refuse_pending_overlap(self, what: str) -> None:
        """Parameters were stepped during a backward whose optimizer.step() has not come: ``what``
        breaks the contract of overlap_step, and a step taken cannot be undone: say so, loudly."""
        overlap = self._overlap
        if overlap is None or not overlap.pending:
            return
        try:
            overlap.join()  # raises what the worker raised
        finally:
            stepped = len(overlap.stepped)
            self._end_overlap()
        if not stepped:  # by norm the step waits for the end of backward: a backward that raised stepped nothing
            return
        raise RuntimeError(
            f"{self.settings.flag('overlap_step')}: {what} came after a backward whose gradients were "
            f"being stepped on the host as they landed ({stepped} parameters stepped), before "
            "optimizer.step(): those parameters keep that step. With overlap_step every backward must be "
            "followed by optimizer.step(): run the backward passes that accumulate inside "
            "`with handle.accumulating():`, and skip no step after a backward that raised"
        )

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """With ``overlap_step``: the backward passes inside add to the host gradients and step
        nothing (gradient accumulation); the backward after them, the one ``optimizer.step()``
        follows, overlaps its step. Without ``overlap_step`` it changes nothing."""
        if self._overlap_pending:
            self._refuse_pending_overlap("accumulating()")
        outer, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = outer

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """With ``clip_grad_norm``: the global norm of the gradients of the last step, before
        clipping (what ``clip_grad_norm_`` returns); None before the first step. Without it, that
        of the last step that took one (``stats.grad_norm``)."""
        return self._grad_norm

    def take_grad_norm(self) -> None:
        """Take the global 2-norm of the step now running's gradients, if ``grad_norm_wanted()``
        and not taken yet: once every gradient of the step is in place and before anything clips
        them (under Lightning: at its clipping call, which comes after ``on_before_optimizer_step``,
        or at the step). Bitwise ``torch.nn.utils.get_total_norm`` of the gradients in the param
        groups' order. An overlapped step takes it as gradients land instead."""
        if self._grad_norm_step > self._stats.steps or self._overlap_pending or not self.grad_norm_wanted():
            return
        grads = [param.grad for param in _optimized_params(self.optimizer) if param.grad is not None]
        self._took_grad_norm(total_norm(grads, tensor_norms(grads)))  # type: ignore[arg-type]

    def _took_grad_norm(self, norm: torch.Tensor | None) -> None:
        self._grad_norm, self._grad_norm_step = norm, self._stats.steps + 1

    def takes_clipping(self, clip_val: float | None, algorithm: str | None) -> bool:
        """Under Lightning: whether the clipping Lightning is about to apply (``clip_val``: 0 or
        None for none) was already applied by the overlapped step of this backward, so Lightning
        must not apply it again. False where no step is overlapping (Lightning clips as usual).

        Raises:
            RuntimeError: parameters were stepped with other clipping than this (it changed
                during the fit): a step taken cannot be undone.
        """
        overlap = self._overlap
        if overlap is None or not overlap.pending:
            return False
        clip = overlap.clip
        asked = GradClip.lightning(clip_val, algorithm)
        if asked == clip:
            return clip is not None  # no clipping asked nor done: Lightning's call does nothing either
        overlap.idle()
        stepped = len(overlap.stepped)
        self._end_overlap()
        raise RuntimeError(
            f"{self.settings.flag('overlap_step')}: {stepped} parameters were stepped on the host as their "
            f"gradients landed with {clip or 'no clipping'} (the Trainer's gradient_clip_val and "
            f"gradient_clip_algorithm at fit start), and this step asks for "
            f"{asked or 'no clipping'}: they keep the step "
            "taken. Keep the clipping of a fit fixed, or turn offload_overlap_step off"
        )

    def wait_for_host_step(self) -> None:
        """With ``overlap_step``: block until every parameter whose gradient was handed to the
        overlapped step so far is stepped (``optimizer.step()`` does this itself; profiling and
        tests use it to see what ran during backward). Raises what that step raised."""
        if self._overlap_pending:
            self._overlap.join()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._restore_hidden()
        if self._on_probation:
            self._end_probation()
        if self._order_state:
            self._order_state = False
            self._overlap.order_new_state()  # type: ignore[union-attr]
        transport = self.transport
        stepped = [slot for slot in self._slots.values() if slot.master.grad is not None]
        stats = self._stats
        stats.steps += 1
        taken = self._grad_norm_step == stats.steps and self._grad_norm is not None
        stats.grad_norm = float(self._grad_norm) if taken else None  # type: ignore[arg-type]
        stats.grad_bytes_out, self._step_grad_bytes = self._step_grad_bytes, 0
        stats.total_grad_bytes_out += stats.grad_bytes_out
        with torch.no_grad():
            if transport.synchronous:
                for slot in stepped:
                    transport.copy_to_device(slot.param.detach(), self._copy_source(slot), None)
            elif stepped:
                compute, _, to_device = transport.streams(self.device)
                # The device parameters are rewritten only after compute's last use of them (backward).
                transport.wait(to_device, transport.record(compute))
                for slot in stepped:
                    transport.copy_to_device(slot.param.detach(), self._copy_source(slot), to_device)
                self._copies_back = transport.record(to_device)
                self._ordered_streams = []
                # Whatever reads a parameter next on this stream (the next forward, a parent module
                # reading a child's weight, a parametrization, weight averaging, load_state_dict)
                # runs after the copies: a wait on the device, so the host runs on.
                self.wait_for_params()
        for slot in stepped:  # the copy bumped the version as it was queued
            if slot.seen is None:
                slot.seen = _Written(slot.param)
            else:
                slot.seen.after_own_write(slot.param)
        moved = sum(slot.param.nbytes for slot in stepped)
        stats.param_bytes_in = moved
        stats.total_param_bytes_in += moved
        waited = transport.waited_s()
        stats.waited_s, self._waited_base_s = waited - self._waited_base_s, waited

    def _copy_source(self, slot: _Slot) -> torch.Tensor:
        """What travels to ``slot``'s device parameter: its host copy, or with ``device_dtype`` that
        copy rounded into its page-locked bf16 tensor, rewritten only once the host saw the copies
        of the last step complete (``_ready_for_step`` waited; waited again here, a no-op then)."""
        if self._device_dtype is None:
            return slot.master.detach()
        self._host_wait_params()
        return self._device_dtype.rounded(slot)

    def _host_wait_params(self) -> None:
        if self._copies_back is not None:
            self.transport.host_wait(self._copies_back)
            self._copies_back = None
            self._ordered_streams = []

    # -- moving the optimizer between device and host -----------------------------------------

    def _rehost_state(self) -> None:
        """State loaded or moved to the device behind our back (Lightning moves optimizer state to
        the root device after restoring a checkpoint) goes back to the host."""
        for state in self.optimizer.state.values():
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != _HOST:
                    state[name] = value.to(_HOST)

    def _swap_optimizer(self, *, to_host: bool, state_on_host: bool = False) -> None:
        """Point the optimizer's groups and state at the host copies (or back at the parameters;
        with ``state_on_host`` the state stays in host memory). Nothing changes if a move fails."""
        by_id = {id(slot.param): slot for slot in self._slots.values()}
        by_id.update({id(slot.master): slot for slot in self._slots.values()})

        def swapped(tensor: torch.Tensor) -> torch.Tensor:
            slot = by_id.get(id(tensor))  # None: put in a group since the last step, never ours
            if slot is None:
                return tensor
            return slot.master if to_host else slot.param

        beside_param: dict[int, bool] = {}  # fused/capturable keep "step" beside the parameter
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                beside_param[id(param)] = bool(group.get("fused") or group.get("capturable"))
        new_state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for key, state in self.optimizer.state.items():
            if id(key) not in by_id or swapped(key) is key:
                new_state[key] = state
                continue
            target = swapped(key)
            device = _HOST if to_host or state_on_host else target.device
            new_state[target] = {
                name: value.to(device)
                if isinstance(value, torch.Tensor) and (name != "step" or beside_param.get(id(key), False))
                else value
                for name, value in state.items()
            }
        for group in self.optimizer.param_groups:  # every move above succeeded
            group["params"] = [swapped(param) for param in group["params"]]
        # In place: wrappers that copied the optimizer's attributes (Lightning's LightningOptimizer)
        # keep seeing the same state object.
        state = self.optimizer.state
        state.clear()
        state.update(new_state)

    # -- leaving -------------------------------------------------------------------------------

    def close(self) -> None:
        """Give the optimizer back its device parameters, state on their device, and any pending
        host gradient in ``param.grad``; remove every hook."""
        if self._closed:
            return
        try:
            self._give_back()
        finally:  # whatever failed (a device out of memory after an exception), nothing stays hooked or pinned
            host_grads.release(slot.param for slot in self._slots.values())
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for arena in (
                self._params_arena, self._grads_arena, self._staging_arena, *self._added_arenas, *self._device_dtype_arenas,
            ):  # fmt: skip
                if arena is not None:
                    arena.close()  # page-locked memory goes back now, not when the last view dies
            self._closed = True

    def _give_back(self) -> None:
        overlap = self._overlap
        stepped_early: list[nn.Parameter] = []
        if overlap is not None:
            overlap.idle()
            if overlap.pending and overlap.stepped:
                stepped_early = [master for master, _, _ in overlap.stepped]
                warn_once(
                    f"lightmem: {self.settings.flag('overlap_step')}: {len(stepped_early)} parameters were "
                    "stepped on the host during a backward whose optimizer.step() never came; they keep that "
                    "step (their device values included)"
                )
            if overlap.pending:
                self._end_overlap()
            overlap.close()
        self._restore_hidden()
        if self._landing or self._unlanded:
            self._land_all()
        self._host_wait_params()
        self.take_device_writes()  # with device_dtype the parameters are given back from the masters
        by_master = {id(slot.master): slot for slot in self._slots.values()}
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._device_dtype is not None:
            self._device_dtype.give_back()  # fp32 parameters again, from the masters
        with torch.no_grad():
            for master in stepped_early:  # weights and optimizer state of one step, not half of one
                slot = by_master[id(master)]
                slot.param.copy_(slot.master.to(slot.param.device))
            for slot in self._slots.values():
                if slot.master.grad is not None:
                    slot.param.grad = slot.master.grad.to(slot.param.device, copy=True)
        self.host_kernel.restore()  # the implementation the user constructed, "step" placed for it
        try:
            self._swap_optimizer(to_host=False)
        except RuntimeError as error:  # the device is out of memory (an exception mid-fit)
            self._swap_optimizer(to_host=False, state_on_host=True)
            warn_once(
                f"lightmem: {self.settings.flag('enabled')}: the optimizer state could not move back to "
                f"{self.device} ({type(error).__name__}); it stays in host memory"
            )

    def __enter__(self) -> OptimizerOffloader:
        return self

    def __exit__(
        self, error_type: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def offload_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    devices: Iterable[str] = ("cuda",),
    max_grad_inflight_bytes: int | str = DEFAULT_GRAD_INFLIGHT,
    overlap_step: bool = False,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    device_dtype: torch.dtype | str | None = None,
    transport: Transport | None = None,
    settings: OptimizerOffloadSettings | None = None,
) -> OptimizerOffloader:
    """Keep ``model``'s parameters on the device; put gradients and ``optimizer``'s state and step
    on the host.

    The training loop stays as it is (``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad()``, LR schedulers, clipping over ``optimizer.param_groups`` or with
    ``clip_grad_norm``); the result on CPU is bitwise what the same loop gives without it. Call ``close()`` (or use ``with``) to
    put the optimizer back on the device parameters.

    Args:
        model: the module whose parameters ``optimizer`` steps (forward pre-hooks on its modules
            wait for each parameter's copy back to the device). Pass the
            ``DistributedDataParallel`` wrapper under DDP: gradients then leave once averaged.
        optimizer: a ``torch.optim.Optimizer`` over parameters on one device. Its class and
            hyperparameters run on the host copies; with foreach/fused left unset, torch's fused
            CPU kernel runs where one exists (Adam, AdamW, SGD, Adagrad; RAdam runs foreach), so
            the result is bitwise that of the optimizer constructed with ``fused=True``
            (``foreach=True``); an explicit choice is kept.
        devices: device types whose parameters are handled; ``("cpu",)`` drives the whole path on
            a CPU-only machine (tests; it saves nothing there).
        max_grad_inflight_bytes: most gradient bytes kept on the device while their copy to host
            runs (default 64 MiB); past it the compute stream waits for the oldest copy.
        overlap_step: step each parameter on the host as soon as its gradient has landed, in a
            worker thread while backward goes on, instead of all of them in ``optimizer.step()``
            (which then steps what is left). The result is bitwise the same **only if every
            backward is followed by** ``optimizer.step()`` **with nothing in between that changes
            a gradient or a param group**: no clipping of your own (give it to ``clip_grad_norm``
            or ``clip_grad_value``), no GradScaler, no LR change, no closure that re-runs
            backward; run the backward passes of gradient accumulation but the last inside
            ``with handle.accumulating():``. Reading the optimizer's host parameters in between
            sees them part-stepped.
            lightmem cannot see your next line, so this is yours to promise; what it can check
            (a gradient written or replaced, a hyperparameter changed, a second backward or a
            ``zero_grad`` before the step) raises ``RuntimeError`` at that point, since a step
            taken cannot be undone. Torch's per-parameter optimizers only (SGD, Adam, AdamW,
            Adagrad, RMSprop, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop); not under DDP.
        clip_grad_norm: clip the gradients by their global 2-norm before every step, bitwise
            ``torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)`` over the optimizer's
            parameters (``handle.grad_norm`` is what it returns). Don't clip yourself as well.
            With ``overlap_step`` each gradient's norm is taken as it lands, and the step of all
            parameters starts the moment backward ends, before ``optimizer.step()`` is called.
        clip_grad_value: clip every gradient element into ``[-clip_grad_value, clip_grad_value]``
            before every step, bitwise ``torch.nn.utils.clip_grad_value_``; with ``overlap_step``
            as each gradient lands, so its step still overlaps backward. Not with ``clip_grad_norm``.
        device_dtype: ``torch.bfloat16`` (or ``"bf16"``): ZeRO-Offload's scheme, **not bitwise
            equal** to training without lightmem. The optimizer steps fp32 host masters; the
            device parameters are cast to bf16 in place (half the bytes per step and of the
            device's weights). Run the forward under ``torch.autocast(device_type, torch.bfloat16)``
            (or feed it bf16 activations): fp32 activations meet bf16 weights otherwise. bf16
            gradients are widened to fp32 on the host, where accumulation, clipping and the step
            run; ``model.state_dict()`` holds the fp32 masters, ``model.load_state_dict`` sets
            them exactly, ``close()`` gives fp32 parameters back from them. fp32 parameters only;
            not with ``overlap_step``, not under DDP. None (default): parameters keep their dtype.
        transport: how copies run; by default CUDA side streams when CUDA is available, otherwise
            synchronous copies.
        settings: the flags above already parsed (``lightmem.config.OptimizerOffloadSettings``).

    Raises:
        ValueError: the optimizer cannot step on the host (not a ``torch.optim.Optimizer``, LBFGS,
            ``capturable=True``), its parameters are on several devices or on a device type not in
            ``devices``, ``overlap_step`` with an optimizer whose step it cannot split, or
            ``device_dtype`` with parameters that are not fp32, with ``overlap_step`` or under DDP,
            both clipping flags or one that is not a positive number; the message names the flag.

    Example::

        >>> import torch
        >>> from lightmem import offload_optimizer
        >>> model = torch.nn.Linear(8, 1)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> with offload_optimizer(model, opt, devices=("cpu",)) as off:
        ...     model(torch.randn(4, 8)).sum().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> off.stats.steps, off.stats.param_bytes_in
        (1, 36)
    """
    if settings is None:
        settings = OptimizerOffloadSettings.parse(
            devices=devices, max_grad_inflight_bytes=max_grad_inflight_bytes, overlap_step=overlap_step,
            device_dtype=device_dtype,
        )  # fmt: skip
    reducer = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    _refuse_bucket_views(reducer, settings.flag("enabled"), "wrap the model with gradient_as_bucket_view=False")
    overlap = "every-backward" if settings.overlap_step is True else None
    clip = GradClip.parse(
        clip_grad_norm, clip_grad_value, (settings.flag("clip_grad_norm"), settings.flag("clip_grad_value"))
    )
    return OptimizerOffloader(
        model, optimizer, settings=settings, transport=transport, reducer=reducer, overlap=overlap, clip=clip
    )


def _refuse_bucket_views(reducer: Any, flag: str, remedy: str) -> None:
    """DDP with ``gradient_as_bucket_view=True``: its gradients are views of its buckets."""
    if getattr(reducer, "gradient_as_bucket_view", False):
        raise ValueError(
            f"{flag}: DDP's gradient_as_bucket_view=True makes gradients views of DDP's buckets, "
            f"which must stay on the device; {remedy}"
        )
