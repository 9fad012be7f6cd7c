"""One steady-state training step, run on fake tensors: the estimator's measurement.

The real model keeps its tensors: fake parameters and buffers are swapped in for the duration of
the step (``torch.nn.utils.stateless._reparametrize_module``) and swapped back afterwards. The
step follows Lightning's automatic optimization after its first step:

    (gradients and optimizer state of the previous step are alive)
    forward (training_step, under autocast for "-mixed" precision)
    zero_grad(set_to_none=True)
    backward
    optimizer.step()

or, with ``zero_grad="before_forward"``, a plain PyTorch loop's order (zero_grad, forward,
backward, step), where the previous step's gradients are gone before forward starts.

The previous step is not run: each trainable parameter is given a gradient and the optimizer
steps once, which creates its state. Parameters that then get no gradient in the measured step
are taken out again (a real run would never have given them gradient or state).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from lightmem.checkpoint import apply_checkpointing, op_policy
from lightmem.blocks import Blocks, find_blocks
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, TileSettings, format_bytes
from lightmem.estimate.batch import batch_tensors, fake_batch
from lightmem.estimate.cuda_model import CublasWorkspaces, CudaBehaviour
from lightmem.estimate.dry_run_device import DRY_RUN_DEVICE, OnDryRunDevice, known_value
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.kernels import CORRECTIONS, RealKernel, real_output
from lightmem.estimate.logits import CHUNKED_LOSS, LossLogits, loss_logits, price_as_chunked, pricing_chunked
from lightmem.estimate.offload_sim import SavedTensorHooks
from lightmem.estimate.op_chain import attention_scores
from lightmem.estimate.position_wise import ModuleForward, PositionWatch
from lightmem.estimate.settings import OptimizerChoice, Precision, allocation_rounding
from lightmem.estimate.caching_allocator import Reserve
from lightmem.estimate.values import BALANCED, StandIns
from lightmem.estimate.tracer import BUFFER, GRADIENT, INPUT, PARAMETER, BlockUsage, PeakInfo, StorageTracer
from lightmem.estimate.stand_in import stand_in
from lightmem.estimate.user_code import (
    DryRunTrainer,
    StepBoundaries,
    attach,
    configure,
    lightning_package,
    lightning_step,
    no_trace_of_user_code,
    phase_optimizers,
    use_optimizers,
)
from lightmem.lightning_packages import is_lightning_module, is_mock_optimizer
from lightmem.tiling import tile_modules
from lightmem.tiling.function import rerunning, sampled_shards

ROOT_BLOCK = "(outside blocks)"
MASTER_DTYPE = torch.float32
"""The host masters' dtype under model-state offload's ``device_dtype`` (the engine refuses others)."""


@dataclass
class StepRequest:
    """Everything that decides what one fake step allocates."""

    device: str
    precision: Precision
    optimizer: OptimizerChoice
    loss_fn: Callable[[nn.Module, Any], Any] | None
    offload: OffloadSettings | None = None
    checkpoint: tuple[Any, ...] | None = None
    checkpoint_policy: Any = "full"
    """What a checkpointed block keeps (``apply_checkpointing(policy=...)``); also what the trace
    prices op-level checkpointing of each block with."""
    tile: TileSettings | None = None
    """Position-wise modules run in sequence shards (``lightmem.tiling``); None: none."""
    batch_size: int | None = None
    """Replace dim 0 of the batch's tensors (whose dim 0 is ``original_batch_size``)."""
    original_batch_size: int | None = None
    sequence: tuple[int, int, int] | None = None
    """Replace one dim of the batch's tensors whose size there is the batch's sequence length:
    (dim, length, new length) (``lightmem.estimate.batch.SequenceAxis.grown``); None: as given."""
    zero_grad: str = "after_forward"
    """When gradients are set to None: "after_forward" (Lightning) or "before_forward" (a plain loop)."""
    gpu: str = "default"
    """The GPU a CUDA step runs on (``lightmem.devices.parse_gpu``, resolved): sets the cuBLAS workspace size."""
    optimizer_offload: OptimizerOffloadSettings | None = None
    """Model-state offload (``offload_optimizer``), as parsed: the gradient bytes that may wait on
    the device for their copy to host (``max_grad_inflight_bytes``) and the trainable parameters'
    dtype on the device (``device_dtype``); None: off (gradients and optimizer state stay on the
    device)."""
    trainable_dtype: torch.dtype | None = None
    """The trainable parameters' dtype on the device in this step; None: their own (or
    ``precision``'s). With ``optimizer_offload.device_dtype``: that dtype."""
    speeds: DeviceSpeeds | None = None
    """Price every op of the step at these speeds (``StepTrace.compute``); None: not priced."""
    expandable_segments: bool = False
    """The CUDA allocator maps pages into growing segments (what ``StepTrace.reserved_bytes`` replays)."""
    routing: str = BALANCED
    """What sizes a top-k routing gives (``lightmem.estimate.values``): ``"balanced"`` or ``"worst"``."""


@dataclass
class SavedTensor:
    shape: tuple[int, ...]
    nbytes: int
    block: str
    attention_scores: bool = False
    """Made between a product of two activations (query and key) and its softmax, or from that
    softmax's output (``lightmem.estimate.op_chain.attention_scores``)."""


@dataclass
class StepTrace:
    """What the fake step measured."""

    peak: PeakInfo
    blocks: dict[str, BlockUsage]
    saved_at_forward_end: list[SavedTensor]
    activations_at_forward_end: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    checkpointed: list[str] = field(default_factory=list)
    tiled: list[str] = field(default_factory=list)
    offloaded_bytes: int = 0
    offloaded_by_block: dict[str, int] = field(default_factory=dict)
    """Bytes moved to host per block that saved them (``ROOT_BLOCK``: outside every block)."""
    host_bytes: int = 0
    """The most host memory activation offload's blocks hold at once (the pool's size classes)."""
    host_largest_bytes: int = 0
    """The largest of those blocks."""
    reloaded_bytes: int = 0
    optimizers: list[str] = field(default_factory=list)
    optimizer_host_bytes: int = 0
    """With model-state offload: host copies of the parameters, gradients and optimizer state."""
    optimizer_link_bytes: int = 0
    """With model-state offload: bytes over the host link per step, each stepped parameter's
    gradient out and the parameter back, in the device's dtype (the engine's ``grad_bytes_out +
    param_bytes_in`` of a step without accumulation)."""
    seconds: float = 0.0
    block_kinds: dict[str, str] = field(default_factory=dict)
    """Class name of each block."""
    repeated_blocks: set[str] = field(default_factory=set)
    loss_logits: LossLogits | None = None
    """The cross-entropy's logits and the peak without them (``lightmem.estimate.logits``)."""
    optimizer_s: float = 0.0
    """Device seconds of the optimizer step, priced (0: not priced, or model-state offload)."""
    priced_ops: int = 0
    """Ops of the step that cost device time: the host launches each one."""
    op_seconds: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Priced device seconds and calls of each op (``aten`` name), summed over the step."""
    reserve: Reserve | None = field(default=None, repr=False)
    """What the device's allocator must be able to reserve for the step (CUDA: its requests, in the
    allocator's order, replayed through it; the CPU: the peak), worked out as far as asked."""
    priced_with: DeviceSpeeds | None = field(default=None, repr=False)
    """The speeds its ops were priced at (None: not priced)."""
    price_log: tuple[tuple[Any, ...], ...] = field(default=(), repr=False)
    """Each priced op in order (``StorageTracer.price_log``): what ``reprice`` prices again."""
    stand_ins: list[str] = field(default_factory=list)
    """Values the step read that fake tensors do not have, each with what stood in for it and where."""
    routed: bool = False
    """Sizes of a top-k routing were stood in for: the step's memory depends on ``StepRequest.routing``."""
    modules: dict[str, ModuleForward] = field(default_factory=dict)
    """In a priced step: each module called with one tensor, its forward's price, what it saved and
    whether it is position-wise (``lightmem.estimate.position_wise``: what the planner may tile)."""

    @property
    def reserved_bytes(self) -> int:
        return self.reserve.bytes if self.reserve is not None else self.peak.bytes


def reprice(trace: StepTrace, speeds: DeviceSpeeds) -> StepTrace:
    """``trace``, a priced step that re-ran no block, as if traced at ``speeds``: each priced op of
    its log priced again and summed in the tracer's order, so the seconds are those a new trace at
    ``speeds`` gives, bit for bit (its memory does not depend on prices)."""
    assert trace.priced_with is not None and not trace.checkpointed
    seconds: dict[Any, float] = {}
    op_seconds: dict[str, tuple[float, int]] = {}
    recompute: dict[str, float] = {}
    for key, cost, name, block in trace.price_log:
        spent = speeds.op_seconds(*cost)
        total, ops = op_seconds.get(name, (0.0, 0))
        op_seconds[name] = (total + spent, ops + 1)
        seconds[key] = seconds.get(key, 0.0) + spent
        if block is not None:
            recompute[block] = recompute.get(block, 0.0) + spent
    blocks = {
        name: dataclasses.replace(
            usage, saved_sizes=list(usage.saved_sizes), forward_s=0.0, backward_s=0.0,
            recompute_s=None if usage.recompute_s is None else recompute.get(name, 0.0),
        )
        for name, usage in trace.blocks.items()
    }  # fmt: skip
    for (phase, block), spent in seconds.items():  # as _forward_end_usage and _steady_step add them
        if phase == "forward":
            blocks[block or ROOT_BLOCK].forward_s += spent
        elif phase == "backward":
            blocks[block or ROOT_BLOCK].backward_s += spent
    modules = {
        name: dataclasses.replace(module, forward_s=sum(speeds.op_seconds(*cost) for cost in module.costs))
        for name, module in trace.modules.items()
    }
    return dataclasses.replace(
        trace, blocks=blocks, op_seconds=op_seconds, optimizer_s=seconds.get(("optimizer", None), 0.0),
        priced_with=speeds, checkpointed=list(trace.checkpointed), modules=modules,
    )  # fmt: skip


def as_traced_in_full(trace: StepTrace) -> StepTrace:
    """``trace``, a step that re-ran nothing traced under a per-op checkpoint policy, as the same
    step traced under "full": without the policy's per-block predictions (what a checkpointed
    block would keep and re-run). Nothing else of such a step depends on the policy: the tracer
    only counts those (``StorageTracer.op_policy``), so one baseline serves both policies of
    ``plan(checkpoint_policy="auto")``."""
    blocks = {
        name: dataclasses.replace(usage, kept_bytes=0, recompute_flops=None, recompute_s=None, recompute_ops=None)
        for name, usage in trace.blocks.items()
    }
    return dataclasses.replace(trace, blocks=blocks, checkpointed=list(trace.checkpointed))


class EstimateError(RuntimeError):
    """The step could not be run on fake tensors; the message says why and what to change."""


def run_step(model: nn.Module, batch: Any, request: StepRequest) -> StepTrace:
    """Run one steady-state step of ``model`` on fake tensors and trace its memory.

    The step runs on a stand-in of ``model`` (``lightmem.estimate.stand_in``): whatever the
    user's code does to the module, its optimizers, schedulers, loggers and random generators,
    the real ones are left as they were.

    Raises:
        EstimateError: the step reads tensor values (``.item()``, data-dependent shapes), a
            LightningModule hook needs a Trainer, or the model fails on fake tensors.
        ValueError: the loss is not a scalar, or a module pattern matches nothing.
    """
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
    tracer.price = request.speeds
    tracer.stand_ins = StandIns(mode=request.routing)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fakes, params, buffers = _fake_state(model, precision.param_dtype, fake_mode, request.trainable_dtype)
        package = lightning_package(model) if is_lightning else None
        trainer = DryRunTrainer(getattr(model, "_trainer", None), package) if package is not None else None
        twin = stand_in(
            model, fakes, fake_mode, replacements={id(trainer._real): trainer} if trainer is not None and trainer._real is not None else None,
            attributes=(lambda module, state: attach(module, trainer)) if trainer is not None else None,
        )  # fmt: skip
        step_model = twin.module
        step_model.train()
        if trainer is not None:
            trainer.lightning_module = step_model
        failure.module_names = {id(module): name for name, module in step_model.named_modules()}
        if request.speeds is not None:  # the priced baseline: which modules a plan may tile
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
        shards = sampled_shards() if request.speeds is None else contextlib.nullcontext()
        with tracer, torch.enable_grad(), on_dry_run_device, shards:
            trace = _steady_step(
                step_model, inputs, request, step_blocks, trainer, tracer, params, buffers, protected, failure, make_batch
            )
    trace.checkpointed, trace.tiled = checkpointed, tiled
    if tracer.watch is not None:
        trace.modules, tracer.watch = tracer.watch.modules, None
    trace.stand_ins, trace.routed = tracer.stand_ins.summary(), tracer.stand_ins.routed
    named = {name: fakes[id(tensor)] for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))}
    trace.loss_logits = loss_logits(  # the step's statements named the stand-in's modules
        tracer, trace.peak, named, blocks.repeated, product_dtype=precision.autocast_dtype, model=step_model
    )
    if trace.loss_logits is not None and trace.loss_logits.replaceable and pricing_chunked():
        # Priced as chunked, the step's requests lose the logits and gain what the chunked loss holds.
        trace.peak = price_as_chunked(tracer, trace.loss_logits)
    # What the allocator must reserve: the step's requests replayed (the CPU: the peak).
    allocations = tracer.step_allocations() if request.device == "cuda" else None
    trace.reserve = Reserve(trace.peak.bytes, allocations, request.expandable_segments)
    return trace


class _StepDriver:
    """The phases of one traced step, told by the step's code as it runs in whatever order
    (``lightmem.estimate.user_code``): the forward's context around each ``training_step``, the
    end of the first forward (what it saved, per block), each backward, the optimizer's update."""

    def __init__(
        self, request: StepRequest, tracer: StorageTracer, tracker: _BlockTracker, hooks: SavedTensorHooks
    ) -> None:
        self.request = request
        self.tracer = tracer
        self.tracker = tracker
        self.hooks = hooks
        self.forward_usage: tuple[dict[str, BlockUsage], list[SavedTensor], int] | None = None

    def training_step(self, call: Callable[[], Any]) -> Any:
        """``call`` (a forward: ``training_step``, ``loss_fn``, the model) in the forward's context:
        autocast, the precision's default dtype, the saved-tensor hooks, FLOP counts."""
        tracer, precision, hooks = self.tracer, self.request.precision, self.hooks
        tracer.set_phase("forward")
        tracer.count_flops = True
        try:
            with contextlib.ExitStack() as stack:
                if precision.autocast_dtype is not None:
                    stack.enter_context(torch.autocast("cpu", dtype=precision.autocast_dtype))
                if precision.param_dtype is not None:
                    stack.enter_context(_default_dtype(precision.param_dtype))
                hooks.attach()
                stack.callback(hooks.detach)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack))
                return call()
        finally:
            tracer.count_flops = False

    def forward_ended(self) -> None:
        """The first forward is over (an automatic step's ``training_step`` returned, or a backward
        starts): what it saved is counted per block, copies in flight have run, and what follows
        until the update is the backward's (``zero_grad`` included)."""
        if self.forward_usage is not None:
            return
        tracer = self.tracer
        tracer.window.forward_end = tracer.now()
        self.forward_usage = _forward_end_usage(tracer, self.tracker)
        self.hooks.forward_done()
        # As in a fit: lightmem's offload leaves at the first backward; a later forward keeps its saves.
        self.hooks.policy = None
        tracer.set_phase("backward")

    def backward(self, run: Callable[[], Any]) -> Any:
        """A backward (``StepBoundaries``), run in the backward's phase; the phase it interrupted
        (a manual step's forward) resumes after it."""
        tracer = self.tracer
        self.forward_ended()
        resume, flops = tracer.context.phase, tracer.count_flops
        tracer.set_phase("backward")
        tracer.count_flops = False
        try:
            # Checkpoint re-runs forwards in here and they must allocate as the forward did, so the
            # engine is called directly: Tensor.backward would pass through (and switch off) the modes.
            return run()
        finally:
            tracer.set_phase(resume)
            tracer.count_flops = flops

    def update(self) -> None:
        self.tracer.set_phase("optimizer")

    def forward(self) -> None:
        if self.tracer.context.phase == "optimizer":
            self.tracer.set_phase("forward")


def _steady_step(
    model: nn.Module, batch: Any, request: StepRequest, blocks: Blocks, trainer: DryRunTrainer | None,
    tracer: StorageTracer, params: list[nn.Parameter], buffers: list[torch.Tensor], protected: set[int],
    failure: FailureSite, make_batch: Callable[[], Any],
) -> StepTrace:  # fmt: skip
    optimizers = _build_optimizers(model, request.optimizer, trainer)
    if request.device == "cuda":
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                if group.get("foreach", False) is None and not group.get("fused"):
                    group["foreach"] = True  # what torch picks for CUDA tensors

    # The previous step: its gradients and the optimizer state it created.
    tracer.set_phase("previous step")
    trainable = [p for p in params if p.requires_grad]
    previous_grads: dict[int, int] = {}
    for param in trainable:
        param.grad = torch.empty_like(param)
        previous_grads[id(param)] = tracer.track(param.grad, GRADIENT)
    for optimizer in optimizers:
        _create_state(optimizer)
    state_of = _mark_state(tracer, optimizers, request.device)
    model_state = request.optimizer_offload
    model_state_offload = model_state is not None
    if model_state is not None:
        grad_hooks, graded = _gradients_leave(tracer, trainable, model_state.max_grad_inflight_bytes)
        # The previous step's gradients and the optimizer state live on the host.
        tracer.excluded.update(previous_grads.values())
        tracer.excluded.update(state_of)
    else:
        graded = set()
        grad_hooks = [
            p.register_post_accumulate_grad_hook(lambda p: tracer.mark_gradient(p.grad)) for p in trainable
        ]

    block_names = {id(module): name for name, module in blocks.modules.items()}
    tracker = _BlockTracker(tracer, block_names, failure)
    hooks = SavedTensorHooks(
        tracer, tracker.current, request.offload, model, protected, asynchronous=request.device == "cuda"
    )
    driver = _StepDriver(request, tracer, tracker, hooks)
    as_lightning = trainer is not None and request.loss_fn is None and request.zero_grad == "after_forward"
    phase_optimizers(optimizers, driver.forward, driver.update, updates=not model_state_offload)

    if request.zero_grad == "before_forward":  # a plain loop frees the old gradients first
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
    tracer.window.start = tracer.now()
    with contextlib.ExitStack() as stack:
        stack.enter_context(tracker)
        if request.device == "cuda":
            stack.enter_context(CudaBehaviour())
        stack.enter_context(StepBoundaries(driver.backward))  # last: above every other mode
        if as_lightning:
            lightning_step(
                model, trainer, batch, _batch_index(trainer), trainer.package,
                training_step=driver.training_step, forward_ended=driver.forward_ended,
                before_update=driver.update, batches=make_batch,
            )  # fmt: skip
        else:
            loss = _as_loss(
                driver.training_step(lambda: _forward(model, batch, request.loss_fn, trainer is not None)),
                request.loss_fn, trainer is not None,
            )  # fmt: skip
            driver.forward_ended()
            if request.zero_grad == "after_forward":
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
            driver.backward(lambda: _run_backward(loss))
            del loss
            for optimizer in optimizers:
                optimizer.step()
    tracer.window.end = tracer.now()
    for hook in grad_hooks:
        hook.remove()
    assert driver.forward_usage is not None
    usage, saved_list, activations = driver.forward_usage

    # Parameters without a gradient in this step would have had neither gradient nor state.
    unused = {id(p) for p in trainable if p.grad is None and id(p) not in graded}
    for owner in unused:
        tracer.excluded.add(previous_grads[owner])
    for rid, owner in state_of.items():
        if owner in unused:
            tracer.excluded.add(rid)
    _mark_state(tracer, optimizers, request.device)

    peak = tracer.peak()
    for (phase, block), seconds in tracer.seconds.items():
        if phase == "backward":
            entry = usage.setdefault(block or ROOT_BLOCK, BlockUsage())
            entry.backward_s += seconds
            entry.backward_ops += tracer.ops.get((phase, block), 0)
    return StepTrace(
        peak=peak,
        optimizer_s=tracer.seconds.get(("optimizer", None), 0.0),
        priced_ops=tracer.priced_ops,
        op_seconds=dict(tracer.op_seconds),
        priced_with=request.speeds,
        price_log=tuple(tuple(entry) for entry in tracer.price_log),
        blocks=usage,
        block_kinds={name: blocks.kind(name) for name in blocks.modules},
        repeated_blocks=set(blocks.repeated),
        saved_at_forward_end=saved_list,
        activations_at_forward_end=activations,
        parameter_bytes=sum(
            tracer.records[tracer.track(t)].nbytes for t in _unique_storages(params + buffers)
        ),
        gradient_bytes=sum(
            tracer.records[tracer.track(grad)].nbytes
            for grad in _unique_storages([p.grad for p in trainable if p.grad is not None])
        ),
        optimizer_state_bytes=sum(
            tracer.records[rid].nbytes for rid in _state_records(tracer, optimizers, request.device)
        ),
        offloaded_bytes=hooks.offloaded_bytes,
        offloaded_by_block={block or ROOT_BLOCK: nbytes for block, nbytes in hooks.offloaded_by_block.items()},
        host_bytes=hooks.peak_host_bytes,
        host_largest_bytes=hooks.largest_host_bytes,
        reloaded_bytes=hooks.reloaded_bytes,
        optimizers=[type(optimizer).__name__ for optimizer in optimizers],
        optimizer_host_bytes=_host_model_state_bytes(optimizers, params, graded, unused, model_state.device_dtype)
        if model_state is not None
        else 0,
        # Each stepped parameter's gradient (autograd gives it the parameter's dtype) out, the parameter back.
        optimizer_link_bytes=2 * sum(p.nbytes for p in params if id(p) in graded),
    )


def _batch_index(trainer: DryRunTrainer) -> int:
    """The index Lightning gives the batch being planned for (0 outside a fit)."""
    real = trainer._real
    try:
        return int(real.fit_loop.epoch_loop.batch_idx) if real is not None else 0
    except (AttributeError, TypeError, ValueError):
        return 0


def _gradients_leave(
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


def _host_model_state_bytes(
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


def _run_backward(loss: torch.Tensor) -> None:
    from torch.autograd.variable import Variable

    Variable._execution_engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)


def _unique_storages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    result = []
    for tensor in tensors:
        key = id(tensor.untyped_storage())
        if key not in seen:
            seen.add(key)
            result.append(tensor)
    return result


def _state_records(tracer: StorageTracer, optimizers: list[torch.optim.Optimizer], device: str) -> list[int]:
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


def _create_state(optimizer: torch.optim.Optimizer) -> None:
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


def _mark_state(
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


def _build_optimizers(
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


def _forward(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None, is_lightning: bool) -> Any:
    if loss_fn is not None:
        try:
            return loss_fn(model, batch)
        except RuntimeError:
            raise  # the model failing on fake tensors: run_step names the module and the op
        except Exception as error:
            raise EstimateError(_loss_fn_failed(model, error, is_lightning)) from error
    if is_lightning:
        try:
            return model.training_step(batch, 0)
        except RuntimeError as error:
            if "Trainer" in str(error) or "trainer" in str(error):
                raise EstimateError(
                    f"training_step needs a Trainer ({error}); pass loss_fn(model, batch) -> loss"
                ) from None
            raise
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def _loss_fn_failed(model: nn.Module, error: Exception, is_lightning: bool) -> str:
    """The user's ``loss_fn`` raised: what it raised, and what it was given (the object passed as
    ``model``, which for a LightningModule is not the network inside it)."""
    given = f"here {type(model).__name__}"
    if is_lightning:
        children = list(model.named_children())
        held = ", ".join(f"{name} ({type(child).__name__})" for name, child in children[:3])
        given += f", a LightningModule holding {held}" if held else ", a LightningModule"
        call = f" (model.{children[0][0]}(...))" if children else ""
        given += f"; call the module inside it as training_step does{call}, or leave loss_fn out to run training_step"
    return (
        f"estimate_memory(loss_fn=...): loss_fn(model, batch) raised {type(error).__name__}: {error}. loss_fn "
        f"receives the object passed as model: {given}."
    )


def _as_loss(output: Any, loss_fn: Any, is_lightning: bool) -> torch.Tensor:
    candidate = output
    if isinstance(candidate, Mapping) and "loss" in candidate:
        candidate = candidate["loss"]
    elif not isinstance(candidate, torch.Tensor) and isinstance(
        getattr(candidate, "loss", None), torch.Tensor
    ):
        candidate = candidate.loss
    if isinstance(candidate, torch.Tensor) and candidate.numel() == 1 and candidate.requires_grad:
        return candidate.reshape(())
    source = "loss_fn" if loss_fn is not None else ("training_step" if is_lightning else "the model")
    if isinstance(candidate, torch.Tensor):
        what = f"a tensor of shape {tuple(candidate.shape)}" + (
            "" if candidate.requires_grad else " that does not require grad"
        )
    else:
        what = type(candidate).__name__
    raise ValueError(
        f"estimate_memory(loss_fn=...): {source} returned {what}, not a scalar loss that requires "
        "grad; pass loss_fn(model, batch) -> scalar loss"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _BlockTracker:
    """Which top-level block runs (forward), which one backward is in, and forward re-runs.

    Global module hooks see every module call; the block names are looked up by module identity.
    During backward, any module forward is a re-run by activation checkpointing.
    """

    def __init__(self, tracer: StorageTracer, block_names: dict[int, str], failure: FailureSite) -> None:
        self.tracer = tracer
        self.failure = failure
        self.block_names = block_names
        self.stack: list[str] = []
        self.depth = 0
        self.input_bytes: dict[str, int] = {}
        self._handles: list[Any] = []

    def current(self) -> str | None:
        if self.tracer.context.phase == "backward":
            return self.tracer.forward_block if self.tracer.in_recompute else self.tracer.backward_block
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> _BlockTracker:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module: nn.Module, args: Any) -> None:
        tracer = self.tracer
        self.depth += 1
        if tracer.context.phase == "backward":
            tracer.in_recompute = True
            tracer.in_tile_rerun = tracer.in_tile_rerun or rerunning()
        name = self.block_names.get(id(module))
        if name is not None:
            self.stack.append(name)
            tracer.forward_block = name
            if tracer.context.phase == "forward" and name not in self.input_bytes:
                seen: set[int] = set()
                total = 0
                for arg in args:
                    if isinstance(arg, torch.Tensor) and id(arg.untyped_storage()) not in seen:
                        seen.add(id(arg.untyped_storage()))
                        total += tracer.record_of(arg).nbytes
                self.input_bytes[name] = total
        if tracer.watch is not None and tracer.context.phase == "forward":
            tracer.watch.enter(module, args, tracer.forward_block)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        tracer = self.tracer
        error = sys.exc_info()[1]
        if error is not None:  # called from Module.__call__'s except clause: the forward raised
            self.failure.module_failed(module, error)
        self.depth -= 1
        if tracer.watch is not None and tracer.context.phase == "forward":
            tracer.watch.exit(module, output)
        name = self.block_names.get(id(module))
        if name is not None and self.stack and self.stack[-1] == name:
            self.stack.pop()
            tracer.forward_block = self.stack[-1] if self.stack else None
            if tracer.context.phase == "forward":
                for leaf in torch.utils._pytree.tree_leaves(output):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        leaf.register_hook(lambda grad, name=name: self._backward_enters(name))
        if self.depth <= 0:
            self.depth = 0
            tracer.in_recompute = tracer.in_tile_rerun = False
            if tracer.context.phase != "backward":
                tracer.forward_block = None

    def _backward_enters(self, name: str) -> None:
        self.tracer.backward_block = name


def _forward_end_usage(
    tracer: StorageTracer, tracker: _BlockTracker
) -> tuple[dict[str, BlockUsage], list[SavedTensor], int]:
    """Per-block saved bytes still alive at the end of forward, and the saved tensors' shapes."""
    usage = {name: BlockUsage() for name in tracker.block_names.values()}
    saved: list[SavedTensor] = []
    total = 0
    scores = attention_scores(tracer) if tracer.softmaxes else set()
    for rid in tracer.saved:
        record = tracer.records[rid]
        if record.freed or record.saved_at < tracer.window.start or record.role in (PARAMETER, BUFFER):
            continue
        block = record.saved_block or ROOT_BLOCK
        entry = usage.setdefault(block, BlockUsage())
        entry.saved_bytes += record.nbytes
        entry.saved_sizes.append(record.nbytes)
        total += record.nbytes
        saved.append(SavedTensor(record.saved_shape or (), record.nbytes, block, rid in scores))
    for name, flops in tracer.block_flops.items():
        usage.setdefault(name or ROOT_BLOCK, BlockUsage()).forward_flops += flops
    for (phase, block), seconds in tracer.seconds.items():
        if phase == "forward":
            entry = usage.setdefault(block or ROOT_BLOCK, BlockUsage())
            entry.forward_s += seconds
            entry.forward_ops += tracer.ops.get((phase, block), 0)
    for name, nbytes in tracker.input_bytes.items():
        usage[name].input_bytes = nbytes
    if tracer.op_policy is not None:
        for name, entry in usage.items():
            entry.kept_bytes = tracer.block_kept_bytes.get(name, 0)
            entry.recompute_flops = tracer.block_recompute_flops.get(name, 0.0)
            entry.recompute_s = tracer.block_recompute_s.get(name, 0.0)
            entry.recompute_ops = tracer.block_recompute_ops.get(name, 0)
    return usage, saved, total


def dominant_part(trace: StepTrace) -> str:
    """What dominates a traced step's peak, in words, for a message about a step that does not fit:
    where the peak is, its largest part, and the loss's logits with what a chunked loss would
    leave and the change that gets it when they are a large share of it (``LossLogits.dominates``)."""
    peak = trace.peak
    part, part_bytes = max(peak.breakdown.items(), key=lambda item: item[1])
    where = f"{peak.phase}: {peak.op}" + (f" in {peak.block}" if peak.block else "")
    text = f"{format_bytes(peak.bytes)} at {where}, {part.replace('_', ' ')} {format_bytes(part_bytes)} of it"
    logits = trace.loss_logits
    if logits is not None and logits.dominates(peak.bytes):
        text += (
            f"; the loss's logits ({logits.rows:,} x {logits.classes:,}, from {logits.weight_name}), their float32 "
            f"copies and gradients take {format_bytes(logits.bytes_at_peak)}"
        )
        if logits.replaceable:
            text += (
                f": a chunked loss ({CHUNKED_LOSS}) would bring the peak to about "
                f"{format_bytes(logits.peak_bytes_chunked)}"
            )
        else:
            text += f" ({logits.change})"
    return text
