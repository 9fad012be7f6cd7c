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

This module holds the offload's lifecycle: the refusals run, the parts built and wired into the
user's model and optimizer, the optimizer pointed at the host copies, and at ``close()`` everything
given back. Each job is its own module: ``host_copies`` (slots and host arenas), ``landing``
(gradients out), ``step`` (the step between torch's step hooks), ``params_back`` (copies back and
their waits), ``user_changes`` (device writes, param groups added), ``overlap_control`` (the step
overlapped with backward).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lightmem.config import DEFAULT_GRAD_INFLIGHT, OptimizerOffloadSettings, warn_once
from lightmem.model_state.grad_clip import GradClip, GradNorm
from lightmem.model_state.host_copies import HostCopies, Slot, Written, take_device_grad
from lightmem.model_state.host_kernel import HostKernel
from lightmem.model_state.landing import GradientLanding
from lightmem.model_state.overlap_control import OverlapControl
from lightmem.model_state.params_back import ParamsBack
from lightmem.model_state.refusals import refuse_bucket_views, refuse_unservable
from lightmem.model_state.stats import OptimizerOffloadStats
from lightmem.model_state.step import HostStep
from lightmem.model_state.user_changes import UserChanges
from lightmem.transfer.transport import Transport, default_transport

_HOST = torch.device("cpu")


class InstanceAttribute:
    """A handle whose ``remove()`` deletes an attribute set on one object (its class's comes back),
    or puts back the one set there before (``previous``: another offloader's, still open)."""

    def __init__(self, owner: Any, name: str, previous: Any = None) -> None:
        self.owner, self.name, self.previous = owner, name, previous

    def remove(self) -> None:
        if self.previous is not None:
            self.owner.__dict__[self.name] = self.previous
        else:
            self.owner.__dict__.pop(self.name, None)


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
        params, self.device = refuse_unservable(model, optimizer, settings, reducer, overlap)
        self.model = model
        self.optimizer = optimizer
        self.settings = settings
        self.transport = transport if transport is not None else default_transport(settings.devices)
        self._stats = OptimizerOffloadStats()
        self._handles: list[Any] = []  # removed at close: hooks, methods set on the user's objects
        self._closed = False
        self._copies = HostCopies(self.transport, self.device, self._stats, holder=self)
        group_of = {id(param): index for index, group in enumerate(optimizer.param_groups) for param in group["params"]}
        self._copies.add(params, group_of)
        dtype = settings.device_dtype
        self._device_dtype = self._copies.device_dtype(dtype) if dtype is not None else None
        self._params_back = ParamsBack(self.transport, self.device, self._device_dtype, self._stats)
        self._grad_norm = GradNorm()
        self._overlap = OverlapControl(
            optimizer, settings, self._copies, self._params_back, overlap, clip, self._grad_norm, self._stats,
            prepare=lambda: self._changes.before_overlapped_step(),
        )  # fmt: skip
        self.host_kernel = HostKernel(optimizer)
        self.host_kernel.select()  # before the swap: "step" counters go where the kernel keeps them
        self._landing = GradientLanding(
            self._copies, self._params_back, self._overlap, settings, reducer, self._device_dtype, self._stats,
            self._handles,
        )  # fmt: skip
        self._changes = UserChanges(
            model, optimizer, settings, self._copies, self._landing, self._params_back, self._overlap,
            self.host_kernel, self._device_dtype, reducer, self._handles,
        )  # fmt: skip
        # Plain loop: clipping this offloader applies before every step (in the overlapped step as
        # gradients land). "step-closure" (Lightning): the clipping Lightning asks for, which the
        # overlapped step applies while Lightning's own call is taken as done (``takes_clipping``).
        self._step = HostStep(
            optimizer, self._copies, self._landing, self._params_back, self._overlap, self._changes,
            clip if overlap != "step-closure" else None, self._grad_norm, self._stats,
        )  # fmt: skip
        self._swap_optimizer(to_host=True)
        if reducer is None:  # gradients already there (a backward before offload) go where the step reads them
            for slot in self._copies.by_param.values():
                take_device_grad(slot)
        if self._device_dtype is not None:
            self._device_dtype.cast_device_params()  # after every refusal: nothing raises past here
        for slot in self._copies.by_param.values():
            slot.seen = Written(slot.param)  # the device parameters as lightmem leaves them
            self._landing.watch(slot)
        self._hook_into(model, optimizer)

    def _hook_into(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Everything lightmem sets on the user's model and optimizer; ``close()`` takes it all off."""
        handles = self._handles
        device_dtype = self._device_dtype
        if device_dtype is not None:
            # The state dict holds the fp32 masters; a load sets them (hooks take functions, not methods).
            handles.append(model.register_state_dict_post_hook(lambda *args: device_dtype.put_masters(*args)))
            handles.append(model.register_load_state_dict_pre_hook(lambda *args: device_dtype.take_loaded(*args)))
        params_back, changes, landing, overlap = self._params_back, self._changes, self._landing, self._overlap
        # Any forward of the model, on whichever stream is current, reads the parameters only after
        # their copies back (one wait per stream and step; the step waits on its own stream).
        handles.append(model.register_forward_pre_hook(lambda *args: params_back.wait_for_params(), prepend=True))
        handles.append(model.register_state_dict_pre_hook(lambda *args, **kwargs: changes.before_state_dict()))
        handles.append(model._register_load_state_dict_pre_hook(lambda *args, **kwargs: params_back.wait_for_params()))
        handles.append(model.register_load_state_dict_post_hook(lambda *args: changes.refresh_host_params()))
        handles += _wrap_user_calls(model, optimizer, overlap, landing, changes)
        # First among the step hooks: a hook the user registered earlier (weight averaging, logging
        # the weights after a step) must see the host step's parameters back on the device.
        for register, hooks, hook in (
            (optimizer.register_step_pre_hook, optimizer._optimizer_step_pre_hooks, self._step.before_step),
            (optimizer.register_step_post_hook, optimizer._optimizer_step_post_hooks, self._step.after_step),
        ):
            handle = register(hook)
            hooks.move_to_end(handle.id, last=False)
            handles.append(handle)
        # A checkpoint's param groups replace ours, with their own foreach/fused: choose again.
        host_kernel = self.host_kernel
        handles.append(optimizer.register_load_state_dict_post_hook(lambda _: host_kernel.select()))
        handles.append(optimizer.register_state_dict_post_hook(lambda _, state: host_kernel.in_state_dict(state)))
        if overlap.step is not None:
            # The worker writes the optimizer's state while backward runs: a state_dict waits for it.
            handles.append(optimizer.register_state_dict_pre_hook(lambda _: overlap.idle()))
            refuse = optimizer.register_load_state_dict_pre_hook(
                lambda *_: overlap.refuse_pending("optimizer.load_state_dict()")
            )
            handles.append(refuse)

    # -- what the user and Lightning ask ----------------------------------------------------------

    def host_copies(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """``(parameter, its host copy)`` for every parameter offloaded: the param groups hold the
        host copies while offloaded."""
        return [(slot.param, slot.master) for slot in self._copies.by_param.values()]

    def host_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the step reads for the device parameter ``param`` (its host copy's), None
        for none or a parameter not offloaded here; with a step overlapped with backward pending,
        once the worker has done what it was handed (it may clip). ``lightmem.named_grads`` reads
        the gradients of a module's parameters by name."""
        slot = self._copies.by_param.get(id(param))
        if slot is None:
            return None
        if self._overlap.pending:
            self._overlap.idle()
        return slot.master.grad

    def remove_at_close(self, handle: Any) -> None:
        """``handle.remove()`` runs when this offloader closes (a hook set on its behalf elsewhere)."""
        self._handles.append(handle)

    @property
    def stats(self) -> OptimizerOffloadStats:
        """Host bytes held now, and the traffic of the last step (see ``OptimizerOffloadStats``)."""
        self._stats.host_grad_bytes = self._copies.grad_bytes()
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
    def host_bytes_held(self) -> int:
        """Host bytes of parameter copies, gradients and optimizer state (for the host budget and guard)."""
        return self.stats.host_bytes

    @property
    def device_dtype_note(self) -> str:
        """For the line at fit start: "bf16 parameters on the device, fp32 masters on the host", or ""."""
        return self._device_dtype.note if self._device_dtype is not None else ""

    @property
    def overlap_note(self) -> str:
        """For the line at fit start: whether the host step overlaps backward, and why not."""
        return self._overlap.note

    @overlap_note.setter
    def overlap_note(self, note: str) -> None:
        self._overlap.note = note

    def wait_for_params(self) -> None:
        """Make the device parameters current for work queued from now on on the current compute
        stream: it waits (on the device, the host does not) for the copies of the last step."""
        self._params_back.wait_for_params()

    def refresh_host_params(self) -> None:
        """Copy every device parameter into the host copy the optimizer steps. Done for you: after
        ``model.load_state_dict``, and before each step for the parameters written since lightmem
        last did (``take_device_writes``). With ``device_dtype`` a ``model.load_state_dict`` sets
        the fp32 masters to the checkpoint's values exactly; otherwise the masters take the
        device's bf16 values."""
        self._changes.refresh_host_params()

    def take_device_writes(self) -> int:
        """The device parameters written since lightmem last wrote them (an in-place write, e.g.
        weight clipping after a step or ``reset_parameters()``, or ``.data`` replaced) are copied
        into their host copies, so the next step starts from them, as it would without lightmem
        (with ``device_dtype``: their bf16 values, widened). Runs by itself before each step (with
        ``overlap_step``, at the first gradient of the backward), before ``model.state_dict()``
        and at ``close()``; not while an overlapped step is pending. Returns how many were taken."""
        return self._changes.take_device_writes()

    def adopt_param_groups(self) -> None:
        """Parameters put in the param groups behind the offloader's back (groups assigned, as
        Lightning's ``BaseFinetuning`` does when it restores its groups on resume) are offloaded,
        their state moved to the host copies. Runs by itself at the first gradient of each
        backward, before each step and before a checkpoint's optimizer state is loaded under
        Lightning."""
        self._changes.adopt_param_groups()

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """With ``overlap_step``: the backward passes inside add to the host gradients and step
        nothing (gradient accumulation); the backward after them, the one ``optimizer.step()``
        follows, overlaps its step. Without ``overlap_step`` it changes nothing."""
        return self._overlap.accumulating()

    def wait_for_host_step(self) -> None:
        """With ``overlap_step``: block until every parameter whose gradient was handed to the
        overlapped step so far is stepped (``optimizer.step()`` does this itself; profiling and
        tests use it to see what ran during backward). Raises what that step raised."""
        self._overlap.join()

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """With ``clip_grad_norm``: the global norm of the gradients of the last step, before
        clipping (what ``clip_grad_norm_`` returns); None before the first step. Without it, that
        of the last step that took one (``stats.grad_norm``)."""
        return self._grad_norm.value

    @property
    def grad_norm_wanted(self) -> Callable[[], bool]:
        """Whether the step now running takes the gradients' global norm (under Lightning: the steps
        whose metrics are read); clipping by norm takes it every step anyway."""
        return self._grad_norm.wanted

    @grad_norm_wanted.setter
    def grad_norm_wanted(self, wanted: Callable[[], bool]) -> None:
        self._grad_norm.wanted = wanted

    def take_grad_norm(self) -> None:
        """Take the global 2-norm of the step now running's gradients, if ``grad_norm_wanted()``
        and not taken yet: once every gradient of the step is in place and before anything clips
        them (under Lightning: at its clipping call, which comes after ``on_before_optimizer_step``,
        or at the step). Bitwise ``torch.nn.utils.get_total_norm`` of the gradients in the param
        groups' order. An overlapped step takes it as gradients land instead."""
        self._step.take_grad_norm()

    def takes_clipping(self, clip_val: float | None, algorithm: str | None) -> bool:
        """Under Lightning: whether the clipping Lightning is about to apply (``clip_val``: 0 or
        None for none) was already applied by the overlapped step of this backward, so Lightning
        must not apply it again. False where no step is overlapping (Lightning clips as usual).

        Raises:
            RuntimeError: parameters were stepped with other clipping than this (it changed
                during the fit): a step taken cannot be undone.
        """
        return self._overlap.takes_clipping(clip_val, algorithm)

    # -- the optimizer between device and host ----------------------------------------------------

    def _swap_optimizer(self, *, to_host: bool, state_on_host: bool = False) -> None:
        """Point the optimizer's groups and state at the host copies (or back at the parameters;
        with ``state_on_host`` the state stays in host memory). Nothing changes if a move fails."""
        _point_optimizer(self.optimizer, self._copies.by_param.values(), to_host=to_host, state_on_host=state_on_host)

    # -- leaving -------------------------------------------------------------------------------

    def close(self) -> None:
        """Give the optimizer back its device parameters, state on their device, and any pending
        host gradient in ``param.grad``; remove every hook."""
        if self._closed:
            return
        try:
            self._give_back()
        finally:  # whatever failed (a device out of memory after an exception), nothing stays hooked or pinned
            self._copies.release()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._copies.close()  # page-locked memory goes back now, not when the last view dies
            self._closed = self._landing.closed = True

    def _give_back(self) -> None:
        stepped_early = self._overlap.give_back()
        self._landing.land_pending()
        self._params_back.host_wait()
        self._changes.take_device_writes()  # with device_dtype the parameters are given back from the masters
        slots = self._copies.by_param.values()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._device_dtype is not None:
            self._device_dtype.give_back()  # fp32 parameters again, from the masters
        with torch.no_grad():
            for master in stepped_early:  # weights and optimizer state of one step, not half of one
                slot = self._copies.by_master[id(master)]
                slot.param.copy_(slot.master.to(slot.param.device))
            for slot in slots:
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


def _point_optimizer(
    optimizer: torch.optim.Optimizer, slots: Iterable[Slot], *, to_host: bool, state_on_host: bool = False
) -> None:
    """Point ``optimizer``'s groups and state at the host copies of ``slots`` (or back at their
    parameters; with ``state_on_host`` the state stays in host memory). Nothing changes if a move
    fails."""
    by_id = {id(slot.param): slot for slot in slots}
    by_id.update({id(slot.master): slot for slot in slots})

    def swapped(tensor: torch.Tensor) -> torch.Tensor:
        slot = by_id.get(id(tensor))  # None: put in a group since the last step, never ours
        if slot is None:
            return tensor
        return slot.master if to_host else slot.param

    beside_param: dict[int, bool] = {}  # fused/capturable keep "step" beside the parameter
    for group in optimizer.param_groups:
        for param in group["params"]:
            beside_param[id(param)] = bool(group.get("fused") or group.get("capturable"))
    new_state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
    for key, state in optimizer.state.items():
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
    for group in optimizer.param_groups:  # every move above succeeded
        group["params"] = [swapped(param) for param in group["params"]]
    # In place: wrappers that copied the optimizer's attributes (Lightning's LightningOptimizer)
    # keep seeing the same state object.
    state = optimizer.state
    state.clear()
    state.update(new_state)


def _wrap_user_calls(
    model: nn.Module, optimizer: torch.optim.Optimizer, overlap: OverlapControl, landing: GradientLanding,
    changes: UserChanges,
) -> list[InstanceAttribute]:
    """``optimizer.zero_grad``, ``model.zero_grad`` and ``optimizer.add_param_group`` as lightmem
    needs them while offloaded; the handles put the user's back."""
    handles: list[InstanceAttribute] = []
    # Gradients of a backward that raised never reach its end-of-backward callback: they land
    # before the next zero_grad, which then clears them as it clears the device's.
    users_zero_grad = optimizer.zero_grad

    def zero_grad(*args: Any, **kwargs: Any) -> None:
        overlap.refuse_pending("optimizer.zero_grad()")
        landing.land_everything()  # cleared with the host gradients, as the device's would be
        users_zero_grad(*args, **kwargs)

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    handles.append(InstanceAttribute(optimizer, "zero_grad"))
    # model.zero_grad() clears the gradients of the model's parameters: theirs are on the host.
    # Called as the caller called it (set_to_none by keyword, by position or not at all): an
    # override of the module's zero_grad, or a recorder of its calls, sees the call it expects.
    users_model_zero_grad, previous = model.zero_grad, model.__dict__.get("zero_grad")

    def model_zero_grad(*args: Any, **kwargs: Any) -> None:
        users_model_zero_grad(*args, **kwargs)
        optimizer.zero_grad(*args, **kwargs)

    model.zero_grad = model_zero_grad  # type: ignore[method-assign]
    handles.append(InstanceAttribute(model, "zero_grad", previous))
    users_add_param_group = optimizer.add_param_group

    def add_param_group(param_group: dict[str, Any]) -> None:
        changes.add_param_group(users_add_param_group, param_group)

    optimizer.add_param_group = add_param_group  # type: ignore[method-assign]
    handles.append(InstanceAttribute(optimizer, "add_param_group"))
    return handles


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
    refuse_bucket_views(reducer, settings.flag("enabled"), "wrap the model with gradient_as_bucket_view=False")
    overlap = "every-backward" if settings.overlap_step is True else None
    clip = GradClip.parse(
        clip_grad_norm, clip_grad_value, (settings.flag("clip_grad_norm"), settings.flag("clip_grad_value"))
    )
    return OptimizerOffloader(
        model, optimizer, settings=settings, transport=transport, reducer=reducer, overlap=overlap, clip=clip
    )
