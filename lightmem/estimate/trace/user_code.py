"""The user's training step, run in the dry run as Lightning runs it.

Lightning does not call ``training_step`` and then step the optimizer: it hands the optimizer a
closure (``training_step``, ``zero_grad``, ``backward``) through the module's ``optimizer_step``
hook (automatic optimization), or it calls ``training_step`` alone and the step drives its
optimizers itself (manual optimization: ``self.optimizers()``, ``self.manual_backward``,
``opt.step()``, ``self.toggle_optimizer``). ``lightning_step`` runs both on the stand-in module
(``lightmem.estimate.trace.stand_in``), with:

- ``DryRunTrainer`` as ``self.trainer``: the dry run's optimizers and schedulers (built by the
  stand-in's ``configure_optimizers``), a strategy whose ``backward`` and ``optimizer_step`` run
  the module's own hooks, loggers that record nothing, and everything else read from the real
  Trainer (``global_step``, ``gradient_clip_val``, ``accumulate_grad_batches``...), never written to it;
- the steps Lightning supports: a step returning a tensor, a dict with ``"loss"`` or ``None`` (no
  backward), a step taking ``dataloader_iter`` (it yields the dry run's batch), optimizers whose
  ``step`` takes a closure (LBFGS) or none, the module's ``optimizer_step``, ``optimizer_zero_grad``,
  ``backward``, ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step`` and
  ``configure_gradient_clipping`` hooks, and gradient accumulation (the step that steps the optimizer:
  the gradients of the steps before it are alive throughout, so nothing zeroes them);
- ``StepBoundaries``: wherever a backward starts (``Tensor.backward``, ``torch.autograd.backward``
  or ``grad``, whoever calls it) and wherever an optimizer steps, the step driver is told, so the
  trace knows its phases in any order the user's code runs them.

Callbacks' hooks are not called (they are the user's objects, not the stand-in's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

from lightmem.lightning_packages import PACKAGES

Loss = torch.Tensor


def lightning_package(module: Any) -> str:
    """Which Lightning package ``module``'s class comes from (``pytorch_lightning`` or ``lightning.pytorch``)."""
    for package in PACKAGES:
        loaded = sys.modules.get(package)
        if loaded is not None and isinstance(module, loaded.LightningModule):
            return package
    raise TypeError(f"{type(module).__name__} is not a LightningModule")


def _from(package: str, module: str, name: str) -> Any:
    """``name`` of ``<package>.<module>`` (a package the module's class comes from: installed)."""
    return getattr(importlib.import_module(f"{package}.{module}"), name)


def _nothing(*args: Any, **kwargs: Any) -> None:
    """``self.log``, ``self.log_dict`` and ``self.print`` in the dry run: nothing is recorded."""


class _NullLogger:
    """A logger that records nothing: every call returns it again (``self.logger.experiment.add_image(...)``)."""

    def __init__(self, real: Any = None) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name in ("name", "version", "save_dir", "log_dir", "root_dir") and self._real is not None:
            return getattr(self._real, name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _NullLogger:
        return self

    def __bool__(self) -> bool:
        return True


class _DryRunStrategy:
    """``trainer.strategy`` in the dry run: backward and the optimizer step through the stand-in's
    own hooks; collectives that return what they are given; the rest read from the real strategy."""

    def __init__(self, trainer: DryRunTrainer, real: Any) -> None:
        self._trainer = trainer
        self._real = real
        self._lightning_optimizers: list[Any] = []

    @property
    def lightning_module(self) -> Any:
        return self._trainer.lightning_module

    @property
    def model(self) -> Any:
        return self._trainer.lightning_module

    def backward(self, closure_loss: Loss, optimizer: Any, *args: Any, **kwargs: Any) -> Loss:
        module = self.lightning_module
        module.on_before_backward(closure_loss)
        if overrides(module, "backward", self._trainer.package):
            module.backward(closure_loss, *args, **kwargs)
        else:  # Lightning's own hook: the backward itself, not through Tensor.backward (which may be patched)
            self._trainer.around_backward(functools.partial(_tensor_backward, closure_loss, *args, **kwargs))
        module.on_after_backward()
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return optimizer.step(closure=closure, **kwargs)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def broadcast(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return obj

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if self._real is None:
            raise AttributeError(f"lightmem's dry run has no Trainer: self.trainer.strategy.{name} is not known")
        return getattr(self._real, name)


class DryRunTrainer:
    """``self.trainer`` of the stand-in module (module docstring). What the step sets on it stays
    on it; ``real`` is the module's own Trainer (None: the estimate runs outside a fit, and the
    Trainer's figures are their defaults)."""

    _DEFAULTS = {
        "global_step": 0, "current_epoch": 0, "global_rank": 0, "local_rank": 0, "node_rank": 0, "world_size": 1,
        "num_devices": 1, "num_nodes": 1, "is_global_zero": True, "training": True, "sanity_checking": False,
        "accumulate_grad_batches": 1, "gradient_clip_val": None, "gradient_clip_algorithm": None,
        "max_epochs": None, "max_steps": -1, "should_stop": False, "fast_dev_run": False, "datamodule": None,
        "log_every_n_steps": 50,
    }  # fmt: skip

    def __init__(self, real: Any, package: str) -> None:
        self._real = real
        self.package = package
        self.around_backward: Callable[[Callable[[], Any]], Any] = lambda run: run()
        """Runs a backward in the step's backward phase (``StepBoundaries``' callback)."""
        self.strategy = _DryRunStrategy(self, getattr(real, "strategy", None))
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[Any] = []
        self.lightning_module: Any = None
        self.callbacks: list[Any] = []
        loggers = list(getattr(real, "loggers", []) or [])
        self.loggers = [_NullLogger(logger) for logger in loggers]
        self.logger = self.loggers[0] if self.loggers else None
        self.precision_plugin = _from(package, "plugins.precision", "Precision")()
        self.profiler = _from(package, "profilers", "PassThroughProfiler")()

    @property
    def model(self) -> Any:
        return self.lightning_module

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__.get("_real")
        if real is not None:
            return getattr(real, name)
        if name in self._DEFAULTS:
            return self._DEFAULTS[name]
        raise AttributeError(
            f"lightmem's dry run runs training_step outside a Trainer: self.trainer.{name} is not known there "
            "(estimate within a fit, with LightMem(plan='auto'), or pass loss_fn(model, batch) -> loss)"
        )


def overrides(module: Any, hook: str, package: str) -> bool:
    """Whether ``module``'s class overrides Lightning's ``hook``."""
    return getattr(type(module), hook) is not getattr(_from(package, "core.module", "LightningModule"), hook)


def attach(module: Any, trainer: DryRunTrainer) -> None:
    """A stand-in LightningModule (any in the tree: the root is ``trainer.lightning_module``) runs
    under ``trainer`` and records nothing; other modules are left as they are."""
    state = module.__dict__
    if "_trainer" not in state or "_fabric" not in state:
        return
    state["_trainer"] = trainer
    state["_fabric"] = None
    state["log"] = state["log_dict"] = state["print"] = _nothing


def configure(module: Any, trainer: DryRunTrainer) -> list[torch.optim.Optimizer]:
    """The stand-in's ``configure_optimizers``, read as Lightning reads it: its optimizers and
    scheduler configs on ``trainer``, each optimizer wrapped as ``self.optimizers()`` gives it."""
    optimizer_module = importlib.import_module(f"{trainer.package}.core.optimizer")
    config = module.configure_optimizers()
    if config is None:  # Lightning fits with an optimizer over nothing
        config = optimizer_module._MockOptimizer()
    optimizers, schedulers, monitor = optimizer_module._configure_optimizers(config)
    if module.automatic_optimization:
        trainer.lr_scheduler_configs = optimizer_module._configure_schedulers_automatic_opt(schedulers, monitor)
    else:
        trainer.lr_scheduler_configs = optimizer_module._configure_schedulers_manual_opt(schedulers)
    use_optimizers(trainer, optimizers)
    return trainer.optimizers


def use_optimizers(trainer: DryRunTrainer, optimizers: list[torch.optim.Optimizer]) -> None:
    """``optimizers`` are the step's: ``self.trainer.optimizers``, and ``self.optimizers()`` wrapping them."""
    wrap = importlib.import_module(f"{trainer.package}.core.optimizer").LightningOptimizer._to_lightning_optimizer
    trainer.optimizers = list(optimizers)
    trainer.strategy._lightning_optimizers = [wrap(optimizer, trainer.strategy) for optimizer in optimizers]


class StepBoundaries(TorchFunctionMode):
    """Tells the step driver where a backward runs, whoever starts it: ``Tensor.backward``,
    ``torch.autograd.backward`` and ``torch.autograd.grad`` run the autograd engine here, with every
    other mode of the dry run still in place (a mode's own handler runs with that mode off, so a
    backward run by a mode below would re-run checkpointed blocks outside it). Enter it last."""

    def __init__(self, around_backward: Callable[[Callable[[], Any]], Any]) -> None:
        super().__init__()
        self.around_backward = around_backward

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            return self.around_backward(functools.partial(_tensor_backward, *args, **kwargs))
        if func is torch.autograd.backward:
            return self.around_backward(functools.partial(_backward, *args, **kwargs))
        if func is torch.autograd.grad:
            return self.around_backward(functools.partial(_grad, *args, **kwargs))
        return func(*args, **kwargs)


def _tensor_backward(
    tensor: torch.Tensor, gradient: Any = None, retain_graph: bool | None = None, create_graph: bool = False, inputs: Any = None
) -> None:
    _backward(tensor, gradient, retain_graph, create_graph, inputs=inputs)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (torch.Tensor, torch.autograd.graph.GradientEdge)):
        return (value,)
    return tuple(value)


def _backward(
    tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None, create_graph: bool = False,
    grad_variables: Any = None, inputs: Any = None,
) -> None:  # fmt: skip
    """``torch.autograd.backward``, run by the engine directly (not through the torch-function
    modes, which would switch themselves off for the whole backward)."""
    from torch.autograd import _make_grads

    outputs = _as_tuple(tensors)
    given = _as_tuple(grad_tensors if grad_tensors is not None else grad_variables)
    grads = _make_grads(outputs, given or (None,) * len(outputs), is_grads_batched=False)
    retain = create_graph if retain_graph is None else retain_graph
    Variable._execution_engine.run_backward(outputs, grads, retain, create_graph, _as_tuple(inputs), True, True)


def _grad(
    outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: bool | None = None, create_graph: bool = False,
    only_inputs: bool = True, allow_unused: bool | None = None, is_grads_batched: bool = False,
    materialize_grads: bool = False,
) -> tuple[Any, ...]:  # fmt: skip
    """``torch.autograd.grad``, by the engine directly (as ``_backward``)."""
    from torch.autograd import _make_grads

    outs, ins = _as_tuple(outputs), _as_tuple(inputs)
    given = _as_tuple(grad_outputs)
    grads = _make_grads(outs, given or (None,) * len(outs), is_grads_batched=False)
    retain = create_graph if retain_graph is None else retain_graph
    unused = materialize_grads if allow_unused is None else allow_unused
    result = Variable._execution_engine.run_backward(outs, grads, retain, create_graph, ins, unused, False)
    if materialize_grads:
        result = tuple(torch.zeros_like(i) if g is None else g for g, i in zip(result, ins))
    return result


class _PhasedOptimizer:
    """An optimizer's ``step`` that tells the driver when the update runs: after the closure (the
    forward and backward it runs: LBFGS calls it again and again), or at once without one."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, forward: Callable[[], None], update: Callable[[], None], updates: bool
    ) -> None:
        self.step = optimizer.step if updates else _closure_only
        self.forward = forward
        self.update = update

    def __call__(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is None:
            self.update()
            try:
                return self.step(**kwargs)
            finally:
                self.forward()

        def phased() -> Any:
            self.forward()
            try:
                return closure()
            finally:
                self.update()

        try:
            return self.step(closure=phased, **kwargs)
        finally:
            self.forward()


def _closure_only(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
    """The step of an optimizer that steps on the host (model-state offload): the device runs its closure only."""
    return closure() if closure is not None else None


def phase_optimizers(
    optimizers: list[torch.optim.Optimizer], forward: Callable[[], None], update: Callable[[], None], updates: bool = True
) -> None:
    """Each of the dry run's ``optimizers`` tells the driver when its update runs (``_PhasedOptimizer``);
    ``updates=False``: the update runs on the host (model-state offload), not in the traced step."""
    for optimizer in optimizers:
        optimizer.step = _PhasedOptimizer(optimizer, forward, update, updates)  # type: ignore[method-assign]


class DryRunBatches:
    """What a ``training_step(self, dataloader_iter)`` is given: ``(batch, batch_idx, dataloader_idx)``
    at each ``next``, a new fake batch each time (``make``)."""

    def __init__(self, make: Callable[[], Any], batch_idx: int) -> None:
        self.make = make
        self.batch_idx = batch_idx
        self.fetched = 0

    def __iter__(self) -> DryRunBatches:
        return self

    def __next__(self) -> tuple[Any, int, int]:
        batch, index = self.make(), self.batch_idx + self.fetched
        self.fetched += 1
        return batch, index, 0

    @property
    def done(self) -> bool:
        return False


class StepOutputError(RuntimeError):
    """The training step's output is not one Lightning accepts (its own message)."""


def lightning_step(
    module: Any, trainer: DryRunTrainer, batch: Any, batch_idx: int, package: str, *,
    training_step: Callable[[Callable[[], Any]], Any], forward_ended: Callable[[], None],
    before_update: Callable[[], None], batches: Callable[[], Any] | None = None,
) -> None:  # fmt: skip
    """One training batch of ``module`` as Lightning runs it (module docstring).

    ``training_step(call)`` runs ``call`` (the module's ``training_step``) in the forward's context
    (autocast, saved-tensor hooks) and returns its output; ``forward_ended`` is called once the
    automatic closure's ``training_step`` returned, before its ``zero_grad``; ``before_update`` once
    its backward is done (what follows, clipping included, is the optimizer step's); ``batches``
    makes a new fake batch (for ``dataloader_iter``)."""
    signature = _from(package, "utilities.signature_utils", "is_param_in_hook_signature")
    if signature(module.training_step, "dataloader_iter", explicit=True):
        step_args: tuple[Any, ...] = (DryRunBatches(batches or (lambda: batch), batch_idx),)
    elif signature(module.training_step, "batch_idx", min_args=2):
        step_args = (batch, batch_idx)
    else:
        step_args = (batch,)
    if not module.automatic_optimization:
        training_step(lambda: module.training_step(*step_args))
        forward_ended()
        return
    automatic = importlib.import_module(f"{package}.loops.optimization.automatic")
    optimizer = trainer.strategy._lightning_optimizers[0]
    epoch = trainer.current_epoch
    # The step that steps the optimizer: with accumulation, gradients of the steps before are alive.
    zero_grad = trainer.accumulate_grad_batches == 1
    ran: list[bool] = []

    def closure() -> Any:
        output = training_step(lambda: module.training_step(*step_args))
        result = automatic.ClosureResult.from_training_step_output(output, trainer.accumulate_grad_batches)
        forward_ended()
        if zero_grad:
            module.on_before_zero_grad(optimizer)
            module.optimizer_zero_grad(epoch, batch_idx, optimizer)
        if result.closure_loss is not None:
            trainer.strategy.backward(result.closure_loss, optimizer)
        before_update()
        module.on_before_optimizer_step(optimizer)
        module.configure_gradient_clipping(
            optimizer, gradient_clip_val=trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )
        ran.append(True)
        return result.loss

    module.optimizer_step(epoch, batch_idx, optimizer, closure)
    if not ran:
        raise StepOutputError(
            "The closure hasn't been executed: the module's optimizer_step did not call optimizer_closure() "
            "(Lightning raises this too)"
        )


@contextlib.contextmanager
def no_trace_of_user_code() -> Iterator[None]:
    """Every random generator the user's code may draw from (torch's, CUDA's where initialised,
    NumPy's global one, ``random``'s) as it was, and nothing the code prints reaches the user."""
    import random

    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with contextlib.redirect_stdout(_Discard()):
            yield
    finally:
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
