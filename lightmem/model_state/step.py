"""The optimizer's step on the host, between torch's step hooks.

Before the step's arithmetic (``before_step``, first among the optimizer's step pre-hooks): the
groups adopt parameters put in them behind lightmem's back, optimizer state moved to the device
goes back to the host, every gradient is landed, every copy of the host copies to the device has
run (the step rewrites them), device writes are taken, clipping given to lightmem is applied and
the gradient norm taken where wanted, or an overlapped step's parameters are taken as stepped.
Under Lightning the step's closure (forward and backward) runs first: the host waits for nothing
before the forward is queued. After it (``after_step``, first among the post-hooks): the stepped
host copies travel back to the device (``params_back``) and the step's figures go to ``stats``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightmem.model_state.grad_clip import GradClip, GradNorm
from lightmem.model_state.host_copies import HostCopies, optimized_params
from lightmem.model_state.landing import GradientLanding
from lightmem.model_state.overlap_control import OverlapControl
from lightmem.model_state.params_back import ParamsBack
from lightmem.model_state.stats import OptimizerOffloadStats
from lightmem.model_state.user_changes import UserChanges

_HOST = torch.device("cpu")


class HostStep:
    """The step pre- and post-hook of one offloaded optimizer; see the module docstring. ``clip``:
    the clipping this offloader applies before every step that no overlapped step took."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        copies: HostCopies,
        landing: GradientLanding,
        params_back: ParamsBack,
        overlap: OverlapControl,
        changes: UserChanges,
        clip: GradClip | None,
        grad_norm: GradNorm,
        stats: OptimizerOffloadStats,
    ) -> None:
        self._optimizer = optimizer
        self._copies = copies
        self._landing = landing
        self._params_back = params_back
        self._overlap = overlap
        self._changes = changes
        self._clip = clip
        self._grad_norm = grad_norm
        self._stats = stats
        self._transport = params_back.transport
        self._waited_base_s = self._transport.waited_s()

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        self._overlap.restore_hidden()
        self._changes.adopt_param_groups()
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
            self._overlap.in_step_closure = True
            try:
                loss = closure()
            finally:
                self._overlap.in_step_closure = False
            self._ready_for_step()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_ready}
        return (args[0], closure_then_ready, *args[2:]), kwargs

    def _ready_for_step(self) -> None:
        """Before the host arithmetic: every gradient landed, every copy of the host parameters to
        the device has read them (the step rewrites them)."""
        self._landing.land_everything()  # a backward that raised never reached its callback
        self._params_back.host_wait()
        if self._overlap.pending:
            self._overlap.take_step()
            return
        self._changes.take_device_writes()
        if self._clip is not None and self._overlap.mode != "step-closure":
            self._grad_norm.took(self._clip.clip(optimized_params(self._optimizer)), self._stats.steps + 1)
        else:
            self.take_grad_norm()

    def take_grad_norm(self) -> None:
        """Take the global 2-norm of the step now running's gradients, if wanted and not taken yet
        (not while an overlapped step is pending: it takes the norm as gradients land)."""
        grad_norm = self._grad_norm
        if grad_norm.step > self._stats.steps or self._overlap.pending or not grad_norm.wanted():
            return
        grads = [param.grad for param in optimized_params(self._optimizer) if param.grad is not None]
        grad_norm.take(grads, self._stats.steps + 1)  # type: ignore[arg-type]

    def after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._overlap.after_step()
        stepped = [slot for slot in self._copies.by_param.values() if slot.master.grad is not None]
        stats, grad_norm = self._stats, self._grad_norm
        stats.steps += 1
        taken = grad_norm.step == stats.steps and grad_norm.value is not None
        stats.grad_norm = float(grad_norm.value) if taken else None  # type: ignore[arg-type]
        stats.grad_bytes_out, self._landing.sent_bytes = self._landing.sent_bytes, 0
        stats.total_grad_bytes_out += stats.grad_bytes_out
        self._params_back.send(stepped)
        waited = self._transport.waited_s()
        stats.waited_s, self._waited_base_s = waited - self._waited_base_s, waited

    def _rehost_state(self) -> None:
        """State loaded or moved to the device behind our back (Lightning moves optimizer state to
        the root device after restoring a checkpoint) goes back to the host."""
        for state in self._optimizer.state.values():
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != _HOST:
                    state[name] = value.to(_HOST)
