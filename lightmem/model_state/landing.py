"""Gradients out during backward, landed on the host where the step reads them.

A post-accumulate-grad hook per parameter queues the copy of its final gradient to a host buffer on
the device-to-host stream and releases the device gradient (``param.grad = None``) once the copy
has run; at most ``max_grad_inflight_bytes`` of gradients wait on the device for their copy
(``lightmem.transfer.inflight``). Once the whole backward is over (one callback per backward, also
under reentrant checkpointing's nested ones) every copy is host-waited and the gradients land in
the host copies' ``.grad``, added as autograd would add them on the device (accumulation adds in the
gradient's dtype; with ``device_dtype`` bf16 gradients are widened into the fp32 masters'). Under
DDP a gradient leaves only once the reducer averaged it, at the end of backward. A gradient of a
backward that overlaps its step goes to the overlapped step instead (``overlap_control``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightmem.config import OptimizerOffloadSettings
from lightmem.model_state.device_dtype import DeviceDtype
from lightmem.model_state.host_copies import HostCopies, Slot, take_device_grad
from lightmem.model_state.overlap_control import OverlapControl
from lightmem.model_state.params_back import ParamsBack
from lightmem.model_state.stats import OptimizerOffloadStats
from lightmem.transfer.inflight import InflightTensors


class GradientLanding:
    """The gradients of the parameters in ``copies``, from their device hooks to their host copies'
    ``.grad``; see the module docstring. The gradient hooks go into ``handles`` (removed at close)."""

    def __init__(
        self,
        copies: HostCopies,
        params_back: ParamsBack,
        overlap: OverlapControl,
        settings: OptimizerOffloadSettings,
        reducer: Any,
        device_dtype: DeviceDtype | None,
        stats: OptimizerOffloadStats,
        handles: list[Any],
    ) -> None:
        self._copies = copies
        self._params_back = params_back
        self._overlap = overlap
        self._settings = settings
        self._reducer = reducer
        self._device_dtype = device_dtype
        self._stats = stats
        self._handles = handles
        self.transport = params_back.transport
        self.device = params_back.device
        self._inflight = InflightTensors(settings.max_grad_inflight_bytes, self.transport)  # device gradients still copied
        self._unlanded: list[Any] = []  # every gradient copy event since the last landing
        self._landing: list[Slot] = []
        self._callback_task: int | None = None
        self._callback: weakref.ref[Any] | None = None  # the end-of-backward callback queued, until it ran
        self.frozen: list[Slot] = []
        """Slots without a gradient hook (autograd refuses one on a frozen parameter) until unfrozen."""
        self.sent_bytes = 0
        """Gradient bytes sent to the host since the last step."""
        self.closed = False

    def watch(self, slot: Slot) -> None:
        """From now on ``slot``'s final gradient goes to the host through a hook, or, frozen, once
        it is unfrozen (``land_device_grads``)."""
        if slot.param.requires_grad:
            self._handles.append(slot.param.register_post_accumulate_grad_hook(self._on_grad_final))
        else:
            self.frozen.append(slot)

    # -- backward: gradients out --------------------------------------------------------------

    def _on_grad_final(self, param: torch.Tensor) -> None:
        if self.closed:
            return
        if self._reducer is not None:
            self._await_reduction()
            return
        grad, slot = param.grad, self._copies.by_param.get(id(param))
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
            self._overlap.nested_backward = True  # another graph task inside this backward (reentrant checkpoint)
            return
        self._callback_task = task

        def finish_backward() -> None:
            outer = torch._C._current_autograd_node()
            if outer is not None:  # the end of a nested backward: the outer one goes on
                self._overlap.nested_backward = True
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
        for slot in self._copies.by_param.values():
            grad = slot.param.grad
            if grad is not None:
                slot.param.grad = None
                self._send(slot, grad)
        self._finish_backward()

    def _send(self, slot: Slot, grad: torch.Tensor) -> None:
        """Queue ``grad``'s copy to the host: into the gradient buffer, or into staging to add; with
        the overlap on for this backward, hand it to the overlapped step, which lands it."""
        overlap = self._overlap
        overlapping = overlap.takes_gradients()
        if slot.overlapped:
            overlap.refuse_pending("a second gradient for a parameter already stepped")
        if slot.landing is not None:  # one still pending from a backward that raised (or a hook that fired twice)
            overlap.repeated_gradient = True
            self.land_all()
        staged = slot.master.grad is not None
        buffer = self._copies.grad_buffer
        if self._device_dtype is not None:  # into its bf16 buffer, widened into the master's fp32 at landing
            slot.grad_buffer = target = buffer(slot, grad, staging=False)
        elif staged:
            slot.staging = target = buffer(slot, grad, staging=True)
        else:
            slot.grad_buffer = target = buffer(slot, grad, staging=False)
        if overlapping:
            overlap.hand_over(slot)
        else:
            self._landing.append(slot)
            slot.landing = "staged" if staged else "direct"
        self.sent_bytes += grad.nbytes
        transport = self.transport
        if transport.synchronous:
            with torch.no_grad():
                transport.copy_to_host(target, grad, None)
            if overlapping:
                overlap.submit(slot, target, staged, None)
            return
        compute, to_host, _ = transport.streams(grad.device)
        transport.wait(to_host, transport.record(compute))
        with torch.no_grad():
            transport.copy_to_host(target, grad, to_host)
        event = transport.record(to_host)
        if overlapping:
            overlap.submit(slot, target, staged, event)
        else:
            self._unlanded.append(event)
        self._inflight.add(event, grad)
        self._stats.peak_device_grad_bytes = max(self._stats.peak_device_grad_bytes, self._inflight.bytes)
        self._inflight.retire(compute)  # the landing host-waits every copy event of the backward

    def _finish_backward(self) -> None:
        self._callback_task = None
        self._overlap.land_now()  # every host gradient in place after backward, as without overlap
        self.land_all()
        self.land_device_grads()  # into the clipping's norm too
        self._overlap.end_backward()  # by norm: every gradient is in place; the worker clips and steps them all

    # -- landing ---------------------------------------------------------------------------------

    def land_all(self) -> None:
        """Every gradient copy has run: accumulate on the host exactly as autograd would on the device."""
        transport = self.transport
        for event in self._unlanded:
            transport.host_wait(event)
        self._unlanded.clear()
        self._inflight.release_all(self.device)  # copies of gradients the overlapped step lands may run on
        self._params_back.host_wait()  # the step about to follow rewrites the host copies
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

    def land_pending(self) -> None:
        """Land the gradients of a backward that raised (it never reached its end-of-backward callback)."""
        if self._landing or self._unlanded:
            self.land_all()

    def land_everything(self) -> None:
        """Every gradient in place on the host, before the step's arithmetic or a ``zero_grad``:
        those of a backward that raised, and those left on the device."""
        self.land_pending()
        self._callback_task = None
        self.land_device_grads()

    def land_device_grads(self) -> None:
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
        unhooked = {id(slot) for slot in self.frozen}
        for slot in [slot for slot in self.frozen if slot.param.requires_grad]:
            self.frozen.remove(slot)
            slot.master.requires_grad_(True)
            self.watch(slot)
        left = [slot for slot in self._copies.by_param.values() if slot.param.grad is not None and slot.landing is None]
        if not left:
            return
        stray = [slot for slot in left if id(slot) not in unhooked] if self._reducer is None else []
        if stray:
            raise ValueError(
                f"{self._settings.flag('enabled')}: {len(stray)} parameter(s) of shape "
                f"{list(stray[0].param.shape)}{' and others' if len(stray) > 1 else ''} have a gradient on the "
                "device that lightmem did not put there (set by hand after backward?); while offloaded the step "
                "reads the gradient of each parameter's host copy: set `.grad` of the tensors in "
                "optimizer.param_groups instead"
            )
        self._params_back.host_wait()
        for slot in left:
            take_device_grad(slot)
