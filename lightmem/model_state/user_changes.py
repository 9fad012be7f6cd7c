"""What the user changes while offloaded: device parameters written, param groups added or assigned.

While offloaded the step reads and writes the host copies, so two kinds of change made to the
user's objects must reach them:

- **Writes to the device parameters** (weight clipping after a step, ``reset_parameters()``,
  ``.data`` replaced, ``model.load_state_dict``): each parameter remembers how lightmem last wrote
  or read it (``Written``); one written since is copied into its host copy before the next step
  (``take_device_writes``), and a load refreshes them all (``refresh_host_params``).
- **Param groups added or assigned** (``optimizer.add_param_group``, as Lightning's
  ``BackboneFinetuning`` unfreezes a backbone; groups restored with device parameters on resume):
  their parameters are offloaded as those at the start were, and the groups hold the host copies
  (``add_param_group``, ``adopt_param_groups``). A group torch refuses leaves nothing offloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightmem.config import OptimizerOffloadSettings
from lightmem.model_state.device_dtype import DeviceDtype
from lightmem.model_state.host_copies import HostCopies, Slot, Written, optimized_params, take_device_grad
from lightmem.model_state.host_kernel import HostKernel
from lightmem.model_state.landing import GradientLanding
from lightmem.model_state.overlap_control import OverlapControl
from lightmem.model_state.params_back import ParamsBack
from lightmem.model_state.refusals import check_params, refuse_sparse_gradients

_HOST = torch.device("cpu")


class UserChanges:
    """Takes what the user wrote or added into the offload of ``optimizer``; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: OptimizerOffloadSettings,
        copies: HostCopies,
        landing: GradientLanding,
        params_back: ParamsBack,
        overlap: OverlapControl,
        host_kernel: HostKernel,
        device_dtype: DeviceDtype | None,
        reducer: Any,
        handles: list[Any],
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._settings = settings
        self._copies = copies
        self._landing = landing
        self._params_back = params_back
        self._overlap = overlap
        self._host_kernel = host_kernel
        self._device_dtype = device_dtype
        self._reducer = reducer
        self._handles = handles

    # -- writes to the device parameters -------------------------------------------------------

    def take_device_writes(self) -> int:
        """The device parameters written since lightmem last wrote them are copied into their host
        copies (with ``device_dtype``: their bf16 values, widened); not while an overlapped step is
        pending. Returns how many were taken."""
        if self._overlap.pending:
            return 0  # the worker may be stepping the host copies; a write now breaks overlap_step's contract
        slots = self._copies.by_param.values()
        written = [slot for slot in slots if slot.seen is None or not slot.seen.still(slot.param)]
        if not written:
            return 0
        self._params_back.host_wait()  # the host copies are rewritten: the copies from them have run
        with torch.no_grad():
            for slot in written:
                slot.master.copy_(slot.param.detach())
                slot.seen = Written(slot.param)
        return len(written)

    def refresh_host_params(self) -> None:
        """Copy every device parameter into its host copy (with ``device_dtype``, after a
        ``model.load_state_dict``: the checkpoint's fp32 values into the masters exactly)."""
        self._overlap.idle()  # no step of the host copies still running
        self._params_back.host_wait()  # every copy to the device has run: nothing left for compute to wait on
        if self._device_dtype is not None:
            self._device_dtype.refresh_masters()
        else:
            with torch.no_grad():
                for slot in self._copies.by_param.values():
                    slot.master.copy_(slot.param.detach())
        for slot in self._copies.by_param.values():
            slot.seen = Written(slot.param)

    def before_state_dict(self) -> None:
        """``model.state_dict()`` reads the parameters after their copies back; with
        ``device_dtype`` it holds the masters, which take the writes first."""
        self._params_back.wait_for_params()
        if self._device_dtype is not None and not self._overlap.pending:
            self.take_device_writes()  # the state dict holds the masters

    def before_overlapped_step(self) -> None:
        """Before the worker steps any host copy: the writes taken, and each parameter's group
        index as the groups are now."""
        self.take_device_writes()
        self.adopt_param_groups()

    # -- param groups added or assigned --------------------------------------------------------

    def add_param_group(self, users_add_param_group: Callable[[dict[str, Any]], None], param_group: dict[str, Any]) -> None:
        """``optimizer.add_param_group`` while offloaded: the group torch adds holds host copies."""
        self._overlap.refuse_pending("optimizer.add_param_group()")
        undo = self._undo_point()
        try:
            users_add_param_group(self._offload_added_group(param_group))
        except BaseException:
            self._undo_to(undo)  # torch refused the group: nothing of it stays offloaded
            raise
        self._host_kernel.select(added=len(self._optimizer.param_groups) - 1)

    def _offload_added_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """The group with its parameters offloaded as those at the start were (Lightning's
        ``BackboneFinetuning`` unfreezing a backbone)."""
        params = param_group["params"]
        if isinstance(params, set):
            return param_group  # torch refuses a set (its order is not kept) with its own message
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        held = [param for param in params if id(param) in self._copies.by_param]
        if held:
            raise ValueError(
                f"{self._settings.flag('enabled')}: add_param_group got {len(held)} parameter(s) the optimizer "
                "already holds (while offloaded its groups hold their host copies, so a check for parameters "
                "already in the optimizer does not find them); leave them out of the new group"
            )
        masters = {id(slot.master) for slot in self._copies.by_param.values()}
        # A host copy given again is left to torch, which refuses it; a parameter given twice in the
        # group gets one host copy, there twice (torch warns and steps it twice, as it would).
        new = list({id(param): param for param in params if id(param) not in masters}.values())
        if not new:
            return param_group
        swapped = self._offload_new(new, len(self._optimizer.param_groups))
        return {**param_group, "params": [swapped.get(id(param), param) for param in params]}

    def adopt_param_groups(self) -> None:
        """Parameters put in the param groups behind the offloader's back (groups assigned, as
        Lightning's ``BaseFinetuning`` does when it restores its groups on resume): a device
        parameter of ours becomes its host copy again, any other is offloaded as an added group's
        is, and optimizer state kept for either moves to the host copy. Each parameter's group
        index follows the groups' order. At the first gradient of each backward, before each step
        and before a checkpoint's optimizer state is loaded under Lightning."""
        masters, slots = self._copies.by_master, self._copies.by_param
        state = self._optimizer.state
        moved = False
        for index, group in enumerate(self._optimizer.param_groups):
            for param in group["params"]:
                slot = masters.get(id(param))
                if slot is None:
                    break
                slot.group = index
            else:
                continue
            self._overlap.refuse_pending("a param group put in the optimizer")
            new = {id(param): param for param in group["params"] if id(param) not in masters and id(param) not in slots}
            swapped = self._offload_new(list(new.values()), index) if new else {}
            swapped.update({id(param): slots[id(param)].master for param in group["params"] if id(param) in slots})
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
            self._host_kernel.select(added=index)
        if moved:  # state in the groups' order, as one step over them (or a load) puts it
            order = {id(param): position for position, param in enumerate(optimized_params(self._optimizer))}
            entries = sorted(state.items(), key=lambda entry: order.get(id(entry[0]), len(order)))
            state.clear()
            state.update(entries)

    def _offload_new(self, params: list[nn.Parameter], index: int) -> dict[int, nn.Parameter]:
        """Host copies, gradient hooks and slots for ``params`` of param group ``index``, joining
        while offloaded; returns each one's host copy by ``id``."""
        flag = self._settings.flag("enabled")
        if self._device_dtype is not None:
            raise ValueError(
                f"{flag}: add_param_group while offloaded with {self._settings.flag('device_dtype')}: add every "
                "param group before offload starts"
            )
        check_params([*params, next(iter(self._copies.by_param.values())).param], self._settings, flag)
        refuse_sparse_gradients(self._model, params, flag)
        self._overlap.idle()  # no step of the host copies running while the groups change
        slots = self._copies.add(params, dict.fromkeys(map(id, params), index))
        for slot in slots:
            if self._reducer is None:  # under DDP it stays: no_sync may be adding to it; the reduced one is sent
                take_device_grad(slot)
            slot.seen = Written(slot.param)
            self._landing.watch(slot)
        return {id(slot.param): slot.master for slot in slots}

    def _undo_point(self) -> tuple[tuple[set[int], int], int, list[Slot]]:
        return self._copies.point(), len(self._handles), list(self._landing.frozen)

    def _undo_to(self, point: tuple[tuple[set[int], int], int, list[Slot]]) -> None:
        """Forget the parameters offloaded since ``point`` (their gradients back on the device)."""
        copies, handles, frozen = point
        self._copies.forget_since(copies)
        for handle in self._handles[handles:]:
            handle.remove()
        del self._handles[handles:]
        self._landing.frozen[:] = frozen
