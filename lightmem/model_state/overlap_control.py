"""When the host step overlaps backward, and what keeps its contract (``overlap_step``).

``overlap.py`` runs the worker that steps parameters as their gradients land. This module decides,
for each final gradient, whether it goes to that worker, and keeps the contract the overlap rests
on: every backward is followed by ``optimizer.step()``, with nothing in between that changes a
gradient or a param group.

- **Which backward overlaps.** In a plain loop ("every-backward") every backward does, except
  those run inside ``accumulating()``. Under Lightning ("step-closure") the backward of the
  closure ``optimizer.step()`` runs does, once a first step has passed its probation: it runs
  after backward and watches for nested backward passes (reentrant checkpointing) or a parameter
  given two gradients in one step, either of which would make a gradient look final before it is
  (then the overlap is off for the fit, with one warning).
- **At the step** (``take_step``): what the parameters were stepped with must be what the step
  would use (gradients, hyperparameters, the device values); their gradients are hidden from the
  rest of the step (torch's optimizers skip a parameter without one) and come back after it.
- **What breaks the contract** (a second gradient for a stepped parameter, ``zero_grad``, added
  param groups, other clipping, a ``load_state_dict`` before the step) raises at that point: a
  step taken cannot be undone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightmem.config import OptimizerOffloadSettings, warn_once
from lightmem.model_state.grad_clip import GradClip, GradNorm
from lightmem.model_state.host_copies import HostCopies, Slot, optimized_params
from lightmem.model_state.overlap import OverlappedStep, _Landing
from lightmem.model_state.params_back import ParamsBack
from lightmem.model_state.stats import OptimizerOffloadStats


class OverlapControl:
    """The overlapped host step of one offloaded optimizer (``mode``: None, "every-backward" or
    "step-closure"); see the module docstring. ``prepare()`` runs before the worker first steps a
    host copy in a backward: the host copies and the param groups as they are now."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        settings: OptimizerOffloadSettings,
        copies: HostCopies,
        params_back: ParamsBack,
        mode: str | None,
        clip: GradClip | None,
        grad_norm: GradNorm,
        stats: OptimizerOffloadStats,
        prepare: Callable[[], None],
    ) -> None:
        self._optimizer = optimizer
        self._settings = settings
        self._copies = copies
        self._params_back = params_back
        self._grad_norm = grad_norm
        self._stats = stats
        self._prepare = prepare
        self.mode = mode
        self.step: OverlappedStep | None = None
        if mode is not None:
            # About eight steps per backward: few enough that their Python is small beside the
            # kernels, enough that all but the last layers' step hides behind backward.
            batch_bytes = max(copies.first_arena_bytes // 8, 1)
            transport = params_back.transport
            self.step = OverlappedStep(optimizer, transport.host_wait, batch_bytes, params_back.device, clip)
        self.note = "host step overlapped with backward" if mode else "host step after backward"
        """For the line at fit start: whether the host step overlaps backward, and why not."""
        self._accumulating = False
        self.in_step_closure = False
        """Under Lightning: the closure ``optimizer.step()`` runs (its backward is the one the step follows)."""
        self._on_probation = mode == "step-closure"
        self.nested_backward = False
        """A graph task inside a backward was seen (reentrant checkpointing): noted by the landing."""
        self.repeated_gradient = False
        """A parameter was given two gradients in one backward: noted by the landing."""
        self._order_state = False  # the step took parameters stepped during backward
        self._hidden: list[tuple[nn.Parameter, torch.Tensor]] = []  # stepped during backward: grads hidden from the step

    @property
    def pending(self) -> bool:
        """Parameters were handed to the overlapped step since the last ``optimizer.step()``."""
        return self.step is not None and self.step.pending

    # -- backward: gradients handed over -----------------------------------------------------

    def takes_gradients(self) -> bool:
        """Whether a gradient final now goes to the overlapped step (else it lands after backward)."""
        return self.step is not None and (
            (self.mode == "every-backward" and not self._accumulating)
            or (self.in_step_closure and not self._on_probation)
        )

    def hand_over(self, slot: Slot) -> None:
        """``slot``'s gradient goes to the overlapped step; the first of a backward begins it."""
        step = self.step
        assert step is not None
        slot.overlapped = True
        if not step.pending:
            self._prepare()  # before the worker steps any host copy
            step.begin(self._params_back.copies_back, take_norms=self._grad_norm.wanted())

    def submit(self, slot: Slot, buffer: torch.Tensor, staged: bool, event: Any) -> None:
        """The copy of ``slot``'s gradient into ``buffer`` (to add, ``staged``) is queued: the worker lands it."""
        self.step.submit(_Landing(slot.master, slot.group, buffer, staged, event))  # type: ignore[union-attr]

    def land_now(self) -> None:
        """At the end of backward: every gradient handed over is in place, as without the overlap."""
        step = self.step
        if step is None:
            return
        self._stats.overlapped_bytes = step.stepped_bytes if step.pending else 0
        if step.pending:
            step.land_now()

    def end_backward(self) -> None:
        """Every gradient of the backward landed: by norm the worker clips and steps them all."""
        if self.pending:
            self.step.end_backward()  # type: ignore[union-attr]

    # -- the step ------------------------------------------------------------------------------

    def take_step(self) -> None:
        """The parameters stepped during backward are this step's: check that what they were
        stepped with is what the step would have used, and hide their gradients from the rest of
        the step (torch's optimizers skip a parameter without one) until it is over."""
        step = self.step
        assert step is not None
        clip = step.clip
        try:
            step.end_backward()  # by norm, after a backward that raised before its end: clip and step what landed
            step.join()
            changes = step.changes()
            written = sum(  # of parameters the copy back rewrites: those with a gradient
                slot.master.grad is not None and slot.seen is not None and not slot.seen.still(slot.param)
                for slot in self._copies.by_param.values()
            )
            if written:  # the copy back would write over them
                changes.append(f"the device values of {written} parameters (written after backward)")
        except BaseException:
            self.end()
            raise
        if changes:
            stepped = len(step.stepped)
            self.end()
            raise RuntimeError(
                f"{self._settings.flag('overlap_step')}: {stepped} parameters were stepped on the host as "
                f"their gradients landed, and since then {'; '.join(changes)} changed: they keep the step "
                "taken with the values at the end of backward. Turn overlap_step off where anything between "
                "backward and optimizer.step() changes gradients or param groups (clipping: give it to "
                "clip_grad_norm or clip_grad_value instead; a GradScaler; an LR change)"
            )
        params = optimized_params(self._optimizer)
        this_step = self._stats.steps + 1
        if clip is not None and clip.by_norm:
            self._grad_norm.took(step.grad_norm, this_step)
        elif step.takes_norms:  # from the norms taken as gradients landed; before the clamp below
            grads = [param.grad for param in params if param.grad is not None]
            self._grad_norm.took(step.norm_of(grads), this_step)  # type: ignore[arg-type]
        if clip is not None and not clip.by_norm:
            # By value: gradients that did not land in this backward (accumulated) too.
            stepped = {id(master) for master, _, _ in step.stepped}
            clip.clamp([param for param in params if id(param) not in stepped])
        with torch.no_grad():
            for master, grad, _ in step.stepped:
                master.grad = None
                self._hidden.append((master, grad))
        self.end()
        self._order_state = True
        self._stats.overlapped_steps += 1

    def after_step(self) -> None:
        """``optimizer.step()`` is over: hidden gradients back, probation over, new state in order."""
        self.restore_hidden()
        if self._on_probation:
            self._end_probation()
        if self._order_state:
            self._order_state = False
            self.step.order_new_state()  # type: ignore[union-attr]

    def restore_hidden(self) -> None:
        for master, grad in self._hidden:
            master.grad = grad
        self._hidden.clear()

    def end(self) -> None:
        """What was stepped belongs to the step now (or is given up)."""
        for slot in self._copies.by_param.values():
            slot.overlapped = False
        self.step.commit()  # type: ignore[union-attr]

    def _end_probation(self) -> None:
        self._on_probation = False
        if self.nested_backward or self.repeated_gradient:
            why = "nested backward passes (reentrant checkpointing)" if self.nested_backward else (
                "a parameter given two gradients in one step"
            )
            self.mode = None
            self.step.close()  # type: ignore[union-attr]
            self.step = None
            self.note = f"host step after backward: the first step showed {why}"
            warn_once(
                f"lightmem: {self._settings.flag('overlap_step')}: off from now on, the first step showed {why}: "
                "a gradient may look final before it is; the host step runs after backward"
            )

    # -- the contract ----------------------------------------------------------------------------

    def refuse_pending(self, what: str) -> None:
        """Parameters were stepped during a backward whose optimizer.step() has not come: ``what``
        breaks the contract of overlap_step, and a step taken cannot be undone: say so, loudly."""
        step = self.step
        if step is None or not step.pending:
            return
        try:
            step.join()  # raises what the worker raised
        finally:
            stepped = len(step.stepped)
            self.end()
        if not stepped:  # by norm the step waits for the end of backward: a backward that raised stepped nothing
            return
        raise RuntimeError(
            f"{self._settings.flag('overlap_step')}: {what} came after a backward whose gradients were "
            f"being stepped on the host as they landed ({stepped} parameters stepped), before "
            "optimizer.step(): those parameters keep that step. With overlap_step every backward must be "
            "followed by optimizer.step(): run the backward passes that accumulate inside "
            "`with handle.accumulating():`, and skip no step after a backward that raised"
        )

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """The backward passes inside add to the host gradients and step nothing."""
        if self.pending:
            self.refuse_pending("accumulating()")
        outer, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = outer

    def takes_clipping(self, clip_val: float | None, algorithm: str | None) -> bool:
        """Under Lightning: whether the clipping Lightning is about to apply was already applied by
        the overlapped step of this backward (raises where it was another clipping)."""
        step = self.step
        if step is None or not step.pending:
            return False
        clip = step.clip
        asked = GradClip.lightning(clip_val, algorithm)
        if asked == clip:
            return clip is not None  # no clipping asked nor done: Lightning's call does nothing either
        step.idle()
        stepped = len(step.stepped)
        self.end()
        raise RuntimeError(
            f"{self._settings.flag('overlap_step')}: {stepped} parameters were stepped on the host as their "
            f"gradients landed with {clip or 'no clipping'} (the Trainer's gradient_clip_val and "
            f"gradient_clip_algorithm at fit start), and this step asks for "
            f"{asked or 'no clipping'}: they keep the step "
            "taken. Keep the clipping of a fit fixed, or turn offload_overlap_step off"
        )

    def idle(self) -> None:
        """Wait until the worker has done what it was handed (no step of the host copies running)."""
        if self.step is not None:
            self.step.idle()

    def join(self) -> None:
        """Wait until every parameter handed over is stepped; raise what that step raised."""
        if self.pending:
            self.step.join()  # type: ignore[union-attr]

    def give_back(self) -> list[nn.Parameter]:
        """``close()``: the worker stops. Returns the host copies it stepped during a backward whose
        ``optimizer.step()`` never came: they keep that step."""
        step = self.step
        stepped_early: list[nn.Parameter] = []
        if step is not None:
            step.idle()
            if step.pending and step.stepped:
                stepped_early = [master for master, _, _ in step.stepped]
                warn_once(
                    f"lightmem: {self._settings.flag('overlap_step')}: {len(stepped_early)} parameters were "
                    "stepped on the host during a backward whose optimizer.step() never came; they keep that "
                    "step (their device values included)"
                )
            if step.pending:
                self.end()
            step.close()
        self.restore_hidden()
        return stepped_early
