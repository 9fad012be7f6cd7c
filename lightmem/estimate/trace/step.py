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

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightmem.blocks import Blocks
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, TileSettings
from lightmem.config.estimator import OptimizerChoice, Precision
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.trace import optimizers as optimizer_state
from lightmem.estimate.trace.blocks import (
    ROOT_BLOCK,
    BlockMemory,
    BlockTracker,
    SavedTensor,
    forward_end_usage,
    priced_blocks,
)
from lightmem.estimate.trace.errors import EstimateError
from lightmem.estimate.trace.logits import LossLogits
from lightmem.estimate.trace.offload_sim import SavedTensorHooks
from lightmem.estimate.trace.position_wise import ModuleForward
from lightmem.estimate.trace.optimizers import (
    build_optimizers,
    gradients_leave,
    host_model_state_bytes,
    mark_state,
    state_records,
    unique_storages,
)
from lightmem.estimate.trace.records import GRADIENT, PeakInfo, held_bytes, reserved_or_peak
from lightmem.estimate.trace.tracer import StorageTracer
from lightmem.estimate.trace.user_code import DryRunTrainer, StepBoundaries, lightning_step, phase_optimizers
from lightmem.estimate.trace.values import BALANCED


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
    (dim, length, new length) (``lightmem.estimate.trace.batch.SequenceAxis.grown``); None: as given."""
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
    priced: bool = False
    """Log what every op of the step costs (``StepTrace.price_log``), to be priced at a device's
    speeds (``lightmem.estimate.pricing.fold``)."""
    expandable_segments: bool = False
    """The CUDA allocator maps pages into growing segments (what ``StepTrace.reserved_bytes`` replays)."""
    routing: str = BALANCED
    """What sizes a top-k routing gives (``lightmem.estimate.trace.values``): ``"balanced"`` or ``"worst"``.
    A balanced step that was routed is traced again under ``"worst"`` (``StepTrace.routing_bound``)."""
    loss_as_chunked: bool = False
    """Price the step as if its loss were chunked (``lightmem.estimate.trace.logits.price_as_chunked``)."""
    chunked_too: bool = False
    """Also work out the step priced as if its loss were chunked, from the same trace (``StepTrace.as_chunked``)."""


@dataclass
class StepTrace:
    """What the fake step measured."""

    peak: PeakInfo
    blocks: dict[str, BlockMemory]
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
    """The cross-entropy's logits and the peak without them (``lightmem.estimate.trace.logits``)."""
    optimizer_s: float = 0.0
    """Device seconds of the optimizer step, priced (0: not priced, or model-state offload):
    ``optimizer_s``, ``op_seconds``, ``priced_with`` and the blocks' seconds are the fold's."""
    priced_ops: int = 0
    """Ops of the step that cost device time: the host launches each one."""
    op_seconds: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Priced device seconds and calls of each op (``aten`` name), summed over the step."""
    reserve: Any = field(default=None, repr=False)
    """What the device's allocator must be able to reserve for the step (CUDA: its requests, in the
    allocator's order, replayed through it; the CPU: the peak), worked out as far as asked."""
    priced_with: DeviceSpeeds | None = field(default=None, repr=False)
    """The speeds its ops were priced at (None: not priced)."""
    price_log: tuple[tuple[Any, ...], ...] = field(default=(), repr=False)
    """Each priced op in order (``StorageTracer.price_log``): what the fold prices
    (``lightmem.estimate.pricing.fold``), at any speeds."""
    forward_priced_ops: int = 0
    """The first ops of ``price_log`` that ran before the first forward ended: the blocks' forward."""
    stand_ins: list[str] = field(default_factory=list)
    """Values the step read that fake tensors do not have, each with what stood in for it and where."""
    routed: bool = False
    """Sizes of a top-k routing were stood in for: the step's memory depends on ``StepRequest.routing``."""
    modules: dict[str, ModuleForward] = field(default_factory=dict)
    """In a priced step: each module called with one tensor, its forward's price, what it saved and
    whether it is position-wise (``lightmem.estimate.trace.position_wise``: what the planner may tile)."""
    routing_bound: Any = None
    """For a routed step (balanced routing): the same step under the worst-case routing; None otherwise."""
    as_chunked: ChunkedStep | None = field(default=None, repr=False, compare=False)
    """With ``StepRequest.chunked_too``: the step's peak and reserve priced as if its loss were
    chunked (``as_chunked_trace``)."""

    @property
    def reserved_bytes(self) -> int:
        return reserved_or_peak(self.reserve, self.peak.bytes)

    @property
    def bound_bytes(self) -> int:
        """What a budget must hold for the step: the reserved peak, or for a routed step its worst-case
        routing's (``routing_bound``), whichever is higher."""
        return held_bytes(self.reserved_bytes, self.routing_bound)


@dataclass
class ChunkedStep:
    """What a traced step gives priced as if its loss were chunked: its peak, what the allocator must
    reserve for it and (a mixture of experts) its worst-case routing's."""

    peak: PeakInfo
    reserve: Any
    routing_bound: Any = None


def as_chunked_trace(trace: StepTrace) -> StepTrace | None:
    """``trace`` priced as if its loss were chunked (None: not worked out): every figure but the memory
    is the step's own."""
    chunked = trace.as_chunked
    if chunked is None:
        return None
    return dataclasses.replace(
        trace, peak=chunked.peak, reserve=chunked.reserve, routing_bound=chunked.routing_bound, as_chunked=None
    )


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


class _StepDriver:
    """The phases of one traced step, told by the step's code as it runs in whatever order
    (``lightmem.estimate.trace.user_code``): the forward's context around each ``training_step``, the
    end of the first forward (what it saved, per block), each backward, the optimizer's update."""

    def __init__(
        self, request: StepRequest, tracer: StorageTracer, tracker: BlockTracker, hooks: SavedTensorHooks
    ) -> None:
        self.request = request
        self.tracer = tracer
        self.tracker = tracker
        self.hooks = hooks
        self.forward_usage: tuple[dict[str, BlockMemory], list[SavedTensor], int] | None = None
        self.forward_priced_ops = 0

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
        self.forward_usage = forward_end_usage(tracer, self.tracker)
        self.forward_priced_ops = len(tracer.price_log)
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


def steady_step(
    model: nn.Module, batch: Any, request: StepRequest, blocks: Blocks, trainer: DryRunTrainer | None,
    tracer: StorageTracer, params: list[nn.Parameter], buffers: list[torch.Tensor], protected: set[int],
    module_failed: Callable[[nn.Module, BaseException], None], make_batch: Callable[[], Any],
    device_modes: Sequence[Any] = (),
) -> StepTrace:  # fmt: skip
    optimizers = build_optimizers(model, request.optimizer, trainer)
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
        optimizer_state.create_state(optimizer)
    state_of = mark_state(tracer, optimizers, request.device)
    model_state = request.optimizer_offload
    model_state_offload = model_state is not None
    if model_state is not None:
        grad_hooks, graded = gradients_leave(tracer, trainable, model_state.max_grad_inflight_bytes)
        # The previous step's gradients and the optimizer state live on the host.
        tracer.excluded.update(previous_grads.values())
        tracer.excluded.update(state_of)
    else:
        graded = set()
        grad_hooks = [
            p.register_post_accumulate_grad_hook(lambda p: tracer.mark_gradient(p.grad)) for p in trainable
        ]

    block_names = {id(module): name for name, module in blocks.modules.items()}
    tracker = BlockTracker(tracer, block_names, module_failed)
    hooks = SavedTensorHooks(
        tracer, tracker.current, request.offload, model, protected, asynchronous=request.device == "cuda"
    )
    driver = _StepDriver(request, tracer, tracker, hooks)
    if trainer is not None:
        trainer.around_backward = driver.backward
    as_lightning = trainer is not None and request.loss_fn is None and request.zero_grad == "after_forward"
    phase_optimizers(optimizers, driver.forward, driver.update, updates=not model_state_offload)

    if request.zero_grad == "before_forward":  # a plain loop frees the old gradients first
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
    tracer.window.start = tracer.now()
    with contextlib.ExitStack() as stack:
        stack.enter_context(tracker)
        for mode in device_modes:  # the device's own rules (CUDA's autocast policy, fused kernels)
            stack.enter_context(mode)
        if as_lightning:
            # Last, above every other mode: a Lightning step may run a backward itself, anywhere in
            # its code (manual optimization, a backward hook of its own, torch.autograd.grad). A
            # plain step's one backward is run below, and pays no mode layer for every op.
            stack.enter_context(StepBoundaries(driver.backward))
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
    mark_state(tracer, optimizers, request.device)

    peak = tracer.peak()
    priced_blocks(usage, tracer.price_log, "backward")
    for name, entry in usage.items():
        entry.kind = blocks.kind(name) if name in blocks.modules else ""
        entry.repeated = name in blocks.repeated
    return StepTrace(
        peak=peak,
        priced_ops=len(tracer.price_log),
        price_log=tuple(tuple(entry) for entry in tracer.price_log),
        forward_priced_ops=driver.forward_priced_ops,
        blocks=usage,
        block_kinds={name: blocks.kind(name) for name in blocks.modules},
        repeated_blocks=set(blocks.repeated),
        saved_at_forward_end=saved_list,
        activations_at_forward_end=activations,
        parameter_bytes=sum(
            tracer.records[tracer.track(t)].nbytes for t in unique_storages(params + buffers)
        ),
        gradient_bytes=sum(
            tracer.records[tracer.track(grad)].nbytes
            for grad in unique_storages([p.grad for p in trainable if p.grad is not None])
        ),
        optimizer_state_bytes=sum(
            tracer.records[rid].nbytes for rid in state_records(tracer, optimizers, request.device)
        ),
        offloaded_bytes=hooks.offloaded_bytes,
        offloaded_by_block={block or ROOT_BLOCK: nbytes for block, nbytes in hooks.offloaded_by_block.items()},
        host_bytes=hooks.peak_host_bytes,
        host_largest_bytes=hooks.largest_host_bytes,
        reloaded_bytes=hooks.reloaded_bytes,
        optimizers=[type(optimizer).__name__ for optimizer in optimizers],
        optimizer_host_bytes=host_model_state_bytes(optimizers, params, graded, unused, model_state.device_dtype)
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


def _run_backward(loss: torch.Tensor) -> None:
    from torch.autograd.variable import Variable

    Variable._execution_engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)


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


