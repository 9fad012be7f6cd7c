"""One fake step run as the device runs it: fakes of the model's parameters and buffers on the
dry run's device, the user's code on a stand-in, the tracer with the device's rules (CUDA's block
sizes, op rules and kernels), what the allocator must reserve for it, and, for a mixture of
experts, the same step under the worst-case routing."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from lightmem.blocks import Blocks, find_blocks
from lightmem.checkpoint import apply_checkpointing, op_policy
from lightmem.estimate.device.caching_allocator import Reserve
from lightmem.estimate.device.cuda_memory import CublasWorkspaces, allocation_rounding
from lightmem.estimate.device.cuda_ops import CudaBehaviour
from lightmem.estimate.device.kernels import CORRECTIONS, RealKernel, real_output
from lightmem.estimate.trace.batch import batch_tensors, fake_batch
from lightmem.estimate.trace.dry_run_device import DRY_RUN_DEVICE, OnDryRunDevice, known_value
from lightmem.estimate.trace.errors import EstimateError
from lightmem.estimate.trace.logits import loss_logits, price_as_chunked
from lightmem.estimate.trace.optimizers import optimizers_of_the_fit
from lightmem.estimate.trace.position_wise import PositionWatch
from lightmem.estimate.trace.records import BUFFER, INPUT, PARAMETER, PeakInfo, RoutingBound
from lightmem.estimate.trace.stand_in import stand_in
from lightmem.estimate.trace.step import ChunkedStep, StepRequest, StepTrace, steady_step
from lightmem.estimate.trace.tracer import StorageTracer
from lightmem.estimate.trace.user_code import DryRunTrainer, attach, lightning_package, no_trace_of_user_code, use_optimizers
from lightmem.estimate.trace.values import BALANCED, WORST, StandIns
from lightmem.lightning_packages import is_lightning_module
from lightmem.tiling.apply import tile_modules
from lightmem.tiling.function import sampled_shards


def run_step(model: nn.Module, batch: Any, request: StepRequest) -> StepTrace:
    """Run one steady-state step of ``model`` on fake tensors and trace its memory.

    The step runs on a stand-in of ``model`` (``lightmem.estimate.trace.stand_in``): whatever the
    user's code does to the module, its optimizers, schedulers, loggers and random generators,
    the real ones are left as they were.

    A step whose sizes follow a top-k routing (``StepTrace.routed``) under ``request.routing``
    "balanced" is traced a second time under "worst" (``StepTrace.routing_bound``); a step that
    routes nothing is traced once. With ``request.chunked_too``, what the step gives priced as if its
    loss were chunked comes with it (``StepTrace.as_chunked``).

    Raises:
        EstimateError: the step reads tensor values (``.item()``, data-dependent shapes), a
            LightningModule hook needs a Trainer, or the model fails on fake tensors.
        ValueError: the loss is not a scalar, or a module pattern matches nothing.
    """
    trace = _run_once(model, batch, request)
    if trace.routed and request.routing == BALANCED:
        worst = _run_once(model, batch, dataclasses.replace(request, routing=WORST, priced=False))
        assert worst.reserve is not None
        trace.routing_bound = RoutingBound(worst.peak, worst.reserve)
        if trace.as_chunked is not None and worst.as_chunked is not None:
            trace.as_chunked.routing_bound = RoutingBound(worst.as_chunked.peak, worst.as_chunked.reserve)
        trace.seconds += worst.seconds
    return trace


def _run_once(model: nn.Module, batch: Any, request: StepRequest) -> StepTrace:
    """``run_step`` under ``request.routing`` alone."""
    started = time.perf_counter()
    is_lightning = is_lightning_module(model)
    blocks = find_blocks(model)
    failure = FailureSite({})
    try:
        with warnings.catch_warnings(), _quiet_fake_tensor_log(), no_trace_of_user_code():
            warnings.simplefilter("ignore")  # the user's code warns in the real step, not here
            trace = _run(model, batch, request, blocks, is_lightning, failure)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise EstimateError(
            f"the training step reads tensor values{failure.where(error, ' in ')} (e.g. .item(), "
            ".tolist(), a Python `if` on a tensor, boolean-mask indexing or nonzero), which fake "
            "tensors do not have. Move such code out of the step or pass loss_fn=... that avoids "
            f"it. ({type(error).__name__}: {error})"
        ) from None
    except EstimateError:
        raise
    except RuntimeError as error:
        raise failure.explain(error) from error
    trace.seconds = time.perf_counter() - started
    return trace


class FailureSite:
    """Where the fake step failed: the innermost module running and the op that raised.

    Both are written on the exception they belong to (an attribute), so an error caught and handled
    inside the model cannot be blamed for a later one, and nothing here holds an exception: an
    exception holds its traceback's frames and their tensors. Checkpoint's early stop raises inside
    every re-run block; holding that exception kept the block's recomputed tensors alive in the
    trace until the next re-run, which a real step frees once backward is past them.
    """

    _MODULE = "_lightmem_failed_module"
    _OP = "_lightmem_failed_op"

    def __init__(self, module_names: dict[int, str]) -> None:
        self.module_names = module_names

    def module_failed(self, module: nn.Module, error: BaseException) -> None:
        if self._MODULE in vars(error):
            return  # the innermost module, which the error left first, is already known
        name = self.module_names.get(id(module))
        if name is not None:
            setattr(error, self._MODULE, (name, type(module).__name__))

    def op_failed(self, func: Any, args: Any, error: BaseException, real: tuple | None = None) -> None:
        shapes = [list(a.shape) for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        verdict, why = (real[0], real[2]) if real is not None else (None, "no real run was tried")
        setattr(error, self._OP, (str(func.name()).replace("::", ".").removesuffix(".default"), shapes, verdict, why))

    def where(self, error: BaseException, prefix: str) -> str:
        """`` in body.1 (Stats)`` for the innermost module that ``error`` left, or ""."""
        site = vars(error).get(self._MODULE)
        if site is None:
            return ""
        name, cls = site
        return f"{prefix}{name or 'the model'} ({cls})"

    def explain(self, error: RuntimeError) -> EstimateError:
        message = str(error).strip().rstrip(".")
        if "numpy" in message.lower() and "tensor subclass" in message:
            return EstimateError(
                f"the training step calls .numpy() (or another conversion to NumPy)"
                f"{self.where(error, ' in ')}; fake tensors have no values to convert. Keep NumPy out "
                "of the training step's forward for the estimate (compute with torch ops, or pass "
                "loss_fn=... that skips it)."
            )
        place = self.where(error, " in ") or " outside the model's modules"
        failed_op = vars(error).get(self._OP)
        if failed_op is None:
            return EstimateError(
                f"the training step fails{place}: {message}. Check the batch's shapes and dtypes against the model."
            )
        op, shapes, verdict, why = failed_op
        place += f" at {op} with inputs of shape {', '.join(map(str, shapes))}"
        if verdict is RealKernel.REFUSES:
            return EstimateError(
                f"the training step fails{place}: {message}. A real step fails there too: check the "
                "batch's shapes and dtypes against the model."
            )
        return EstimateError(
            f"the training step fails on fake tensors{place}: {message}. lightmem did not run the real kernel "
            f"({why}), so it cannot tell whether a real step fails: a fake kernel can be stricter than the real "
            "one. If a real step runs, measure it (lightmem.testing.measure.measure_cpu_step) and please report the op."
        )


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback for every failing meta kernel; the EstimateError says it."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _checkpointed_names(model: nn.Module, handle: Any) -> list[str]:
    return list(handle.modules)


def _fake_like(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return torch.empty_strided(tuple(tensor.shape), tensor.stride(), dtype=target, device=DRY_RUN_DEVICE)


def _fake_state(
    model: nn.Module, param_dtype: torch.dtype | None, fake_mode: FakeTensorMode,
    trainable_dtype: torch.dtype | None = None,
) -> tuple[dict[int, torch.Tensor], list[nn.Parameter], list[torch.Tensor]]:
    """Fake parameters and buffers, by the id of the real tensor each stands for (tied weights stay tied).
    ``trainable_dtype``: the dtype of the trainable parameters on the device (model-state offload's
    ``device_dtype``: what the engine casts the parameters it steps to)."""
    by_id: dict[int, torch.Tensor] = {}
    params: list[nn.Parameter] = []
    buffers: list[torch.Tensor] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        fake = by_id.get(id(param))
        if fake is None:
            dtype = trainable_dtype if trainable_dtype is not None and param.requires_grad else param_dtype
            fake = nn.Parameter(_fake_like(param, dtype), requires_grad=param.requires_grad)
            by_id[id(param)] = fake
            params.append(fake)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        fake = by_id.get(id(buffer))
        if fake is None:
            fake = known_value(fake_mode, buffer, param_dtype)
            if fake is None:
                fake = _fake_like(buffer, param_dtype)
            by_id[id(buffer)] = fake
            buffers.append(fake)
    return by_id, params, buffers


def _run(
    model: nn.Module, batch: Any, request: StepRequest, blocks: Blocks, is_lightning: bool,
    failure: FailureSite,
) -> StepTrace:  # fmt: skip
    precision = request.precision
    workspaces = CublasWorkspaces.for_gpu(request.gpu) if request.device == "cuda" else None
    tracer = StorageTracer(allocation_rounding(request.device), CORRECTIONS, workspaces)
    tracer.on_failure = failure.op_failed
    tracer.when_fake_refuses = real_output
    tracer.op_policy = op_policy(request.checkpoint_policy)
    tracer.log_prices = request.priced
    tracer.stand_ins = StandIns(mode=request.routing)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fakes, params, buffers = _fake_state(model, precision.param_dtype, fake_mode, request.trainable_dtype)
        package = lightning_package(model) if is_lightning else None
        trainer = DryRunTrainer(getattr(model, "_trainer", None), package) if package is not None else None
        fit_optimizers = optimizers_of_the_fit(trainer, fakes) if request.optimizer.factory is None else None
        twin = stand_in(
            model, fakes, fake_mode, replacements={id(trainer._real): trainer} if trainer is not None and trainer._real is not None else None,
            attributes=(lambda module, state: attach(module, trainer)) if trainer is not None else None,
            with_it=(fit_optimizers,) if fit_optimizers is not None else (),
        )  # fmt: skip
        step_model = twin.module
        step_model.train()
        if trainer is not None:
            trainer.lightning_module = step_model
            if fit_optimizers is not None:
                optimizers, trainer.lr_scheduler_configs = twin.copies[0]
                for optimizer in optimizers:  # its state is made as the previous step's (create_state)
                    optimizer.state = collections.defaultdict(dict)
                use_optimizers(trainer, optimizers)
        failure.module_names = {id(module): name for name, module in step_model.named_modules()}
        if request.priced:  # the priced baseline: which modules a plan may tile
            tracer.watch = PositionWatch(failure.module_names, tracer)
        step_blocks = Blocks({name: twin.twin(module) for name, module in blocks.modules.items()}, set(blocks.repeated))
        checkpointed: list[str] = []
        if request.checkpoint:
            checkpointed = list(apply_checkpointing(step_model, list(request.checkpoint), policy=request.checkpoint_policy).modules)
        # After checkpointing, as a fit applies them: a module checkpointed itself is refused.
        tiled = list(tile_modules(step_model, request.tile).modules) if request.tile is not None else []

        def make_batch() -> Any:
            made = fake_batch(
                batch, device=DRY_RUN_DEVICE, batch_size=request.batch_size,
                original_batch_size=request.original_batch_size, float_dtype=precision.param_dtype,
                sequence=request.sequence,
            )  # fmt: skip
            for tensor in batch_tensors(made):
                tracer.track(tensor, INPUT)
            return made

        protected = {id(t.untyped_storage()) for t in params + buffers}
        for param in params:
            tracer.track(param, PARAMETER)
        for buffer in buffers:
            tracer.track(buffer, BUFFER)
        for fake in twin.fakes:  # held before the step, outside the parameters and buffers: not the step's
            tracer.excluded.add(tracer.track(fake))
        inputs = make_batch()
        # A real tensor from another device enters as a real CPU tensor does: not counted.
        on_dry_run_device = OnDryRunDevice(fake_mode, entered=lambda fake: tracer.excluded.add(tracer.track(fake)))
        # An unpriced step traces a tiled call's first and last shards only: the same memory (``sampled_shards``).
        shards = sampled_shards() if not request.priced else contextlib.nullcontext()
        with tracer, torch.enable_grad(), on_dry_run_device, shards:
            trace = steady_step(
                step_model, inputs, request, step_blocks, trainer, tracer, params, buffers, protected,
                failure.module_failed, make_batch, device_modes=[CudaBehaviour()] if request.device == "cuda" else [],
            )  # fmt: skip
    trace.checkpointed, trace.tiled = checkpointed, tiled
    if tracer.watch is not None:
        trace.modules, tracer.watch = tracer.watch.modules, None
    trace.stand_ins, trace.routed = tracer.stand_ins.summary(), tracer.stand_ins.routed
    named = {name: fakes[id(tensor)] for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))}
    trace.loss_logits = loss_logits(  # the step's statements named the stand-in's modules
        tracer, trace.peak, named, blocks.repeated, product_dtype=precision.autocast_dtype, model=step_model
    )
    replaceable = trace.loss_logits is not None and trace.loss_logits.replaceable
    if replaceable and request.loss_as_chunked:
        # Priced as chunked, the step's requests lose the logits and gain what the chunked loss holds.
        trace.peak = price_as_chunked(tracer, trace.loss_logits)
    trace.reserve = _reserve(tracer, trace.peak, request)
    if request.chunked_too and replaceable and not request.loss_as_chunked and trace.loss_logits.dominates(trace.peak.bytes):
        # Where the logits dominate, the same step priced as chunked (the what-if a refusal asks) from this trace.
        chunked = price_as_chunked(tracer, trace.loss_logits)
        trace.as_chunked = ChunkedStep(chunked, _reserve(tracer, chunked, request))
    return trace


def _reserve(tracer: StorageTracer, peak: PeakInfo, request: StepRequest) -> Reserve:
    """What the allocator must reserve for the traced step: its requests replayed (the CPU: the peak)."""
    allocations = tracer.step_allocations() if request.device == "cuda" else None
    return Reserve(peak.bytes, allocations, request.expandable_segments)
