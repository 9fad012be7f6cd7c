"""A real CPU step measured by an independent tracker, to check the estimator against.

``measure_cpu_step`` runs the same steady-state step as the estimator (a first step, then a
measured one: forward, zero_grad(set_to_none=True), backward, optimizer step) with real tensors on
the CPU, under ``torch.distributed._tools.mem_tracker.MemTracker``: torch's own tracker of live
storages by category. Its categories map onto the estimator's as follows:

    Parameter + Buffer  -> parameters        Gradient -> gradients
    Optstate            -> optimizer_state   Activation -> activations
    Temp + Other        -> temporaries

Two adjustments make the definitions the same: MemTracker files every tensor created during the
optimizer step under "Optstate", temporaries included, so at the peak only the bytes of the
optimizer's state tensors (all present in a steady step) count as optimizer state and the rest
as temporaries; and the input batch, registered as "Other", counts as activations, as it does in
the estimator. The real model is stepped twice: pass a copy if its values matter. MemTracker's module hooks
keep the measured model alive from C++ after the measurement, so run it in a separate process
where the rest of the process counts live tensors (the test suite does).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightmem.estimate.trace.batch import batch_tensors
from lightmem.config.estimator import parse_optimizer, parse_precision
from lightmem.estimate.trace.records import CATEGORIES

_MAPPING = {
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "activations",  # only the batch is registered as external tensors
}


@dataclass
class MeasuredStep:
    peak_bytes: int
    breakdown: dict[str, int]
    input_bytes: int


def measure_cpu_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
    precision: str = "32-true",
    first_batch: Any = None,
) -> MeasuredStep:
    """Peak and breakdown of a real steady-state CPU step, by MemTracker (see the module docstring).
    ``first_batch``: the batch of the first (unmeasured) step, where it is not ``batch`` (a step
    whose routing differs from the steps before it: every expert has gradients and state)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    choice = parse_optimizer(optimizer, flag="measure_cpu_step(optimizer=...)")
    mode = parse_precision(precision, flag="measure_cpu_step(precision=...)")
    if mode.param_dtype is not None:
        model = model.to(mode.param_dtype)
    model.train()
    opt = choice.factory([p for p in model.parameters() if p.requires_grad])

    def forward(batch: Any = batch) -> torch.Tensor:
        context = (
            torch.autocast("cpu", dtype=mode.autocast_dtype)
            if mode.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with context:
            return loss_fn(model, batch)

    loss = forward(batch if first_batch is None else first_batch)
    loss.backward()
    opt.step()
    del loss
    tracker = MemTracker()
    tracker.track_external(model, opt, *batch_tensors(batch))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            loss = forward()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            del loss
    return _measured(tracker.get_tracker_snapshot("peak"), [opt], batch)


def _measured(snapshot: Any, optimizers: list[torch.optim.Optimizer], batch: Any) -> MeasuredStep:
    """MemTracker's peak snapshot in the estimator's categories (the module docstring's mapping and
    its optimizer-state adjustment)."""
    breakdown = dict.fromkeys(CATEGORIES, 0)
    total = 0
    for device_snapshot in snapshot.values():
        for key, value in device_snapshot.items():
            name = getattr(key, "value", key)
            if name == "Total":
                total += value
            else:
                breakdown[_MAPPING[name]] += value
    state_bytes = sum(_state_bytes(optimizer) for optimizer in optimizers)
    if breakdown["optimizer_state"] > state_bytes:
        breakdown["temporaries"] += breakdown["optimizer_state"] - state_bytes
        breakdown["optimizer_state"] = state_bytes
    input_bytes = sum(t.untyped_storage().nbytes() for t in batch_tensors(batch))
    return MeasuredStep(total, breakdown, input_bytes)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_lightning_step(module: Any, loader: Any, package: Any, measured_batch: int = 1) -> MeasuredStep:
    """Peak and breakdown of a LightningModule's training batch ``measured_batch`` (the second by
    default: the gradients and optimizer state of the first are alive, as in the estimator's steady
    step), as a CPU ``Trainer`` of ``package`` runs it, by MemTracker (module docstring): what
    Lightning itself runs around ``training_step`` (automatic or manual optimization, hooks) included."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """MemTracker refuses a module called again from outside every module within its context (it
        takes that for a next iteration): a step calling its network twice (two optimizers in turn)
        is one iteration here, so that module's own figures start again; the tracker's peak is kept."""

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            outside = set(self._mod_tracker.parents) - {name} == {"Global"}
            if module in self.memory_tracking and outside and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    snapshots: list[Any] = []
    optimizers: list[Any] = []

    class Measure(package.Callback):
        tracker: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == measured_batch:
                self.tracker = StepTracker()
                self.tracker.track_external(pl_module, *trainer.optimizers, *batch_tensors(batch))
                optimizers.extend(trainer.optimizers)
                self.tracker.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
                snapshots.append(self.tracker.get_tracker_snapshot("peak"))
                self.tracker = None

    trainer = package.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=measured_batch + 1, logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Measure()],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    (snapshot,) = snapshots
    return _measured(snapshot, optimizers, next(iter(loader)))
