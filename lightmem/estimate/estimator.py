"""``estimate_memory``: the peak of a training step and where it goes, before the first real step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightmem.config import parse_size
from lightmem.estimate.batch import BatchInfo, inspect_batch
from lightmem.estimate.report import CUDA_NOTES, NOT_MODELLED, BlockMemory, MemoryEstimate, StepMemory
from lightmem.estimate.settings import (
    OffloadConfig,
    OptimizerChoice,
    Precision,
    parse_checkpoint,
    parse_device,
    parse_offload,
    parse_optimizer,
    parse_overhead,
    parse_precision,
    parse_zero_grad,
)
from lightmem.estimate.step import StepRequest, StepTrace, _is_lightning, run_step

LossFn = Callable[[nn.Module, Any], Any]


@dataclass(frozen=True)
class EstimateSettings:
    """Validated arguments shared by estimate_memory, max_batch_size and plan."""

    device: str
    precision: Precision
    optimizer: OptimizerChoice
    loss_fn: LossFn | None
    overhead_bytes: int
    budget_bytes: int | None
    zero_grad: str = "after_forward"


def parse_settings(
    fn_name: str,
    model: nn.Module,
    loss_fn: LossFn | None,
    *,
    optimizer: str | Callable[..., Any] | None,
    precision: str | int,
    device: str,
    overhead_bytes: int | str | None,
    budget: int | str | None,
    zero_grad: str = "after_forward",
) -> EstimateSettings:
    """Check every argument once; each ``ValueError`` names ``fn_name(argument=...)``."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"{fn_name}(model=...): expected an nn.Module or LightningModule; got {type(model).__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(
            f"{fn_name}(loss_fn=...): expected a callable loss_fn(model, batch) -> loss; got {loss_fn!r}"
        )
    if optimizer is None and not _is_lightning(model):
        optimizer = "adamw"
    kind = parse_device(device, flag=f"{fn_name}(device=...)")
    return EstimateSettings(
        device=kind,
        precision=parse_precision(precision, flag=f"{fn_name}(precision=...)"),
        optimizer=parse_optimizer(optimizer, flag=f"{fn_name}(optimizer=...)"),
        loss_fn=loss_fn,
        overhead_bytes=parse_overhead(overhead_bytes, kind, flag=f"{fn_name}(overhead_bytes=...)"),
        budget_bytes=None if budget is None else parse_size(budget, flag=f"{fn_name}(budget=...)"),
        zero_grad=parse_zero_grad(zero_grad, flag=f"{fn_name}(zero_grad=...)"),
    )


def run_configuration(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    *,
    offload: OffloadConfig | None = None,
    checkpoint: tuple[Any, ...] | None = None,
    batch_size: int | None = None,
    info: BatchInfo | None = None,
) -> StepTrace:
    """One fake step of ``model`` with one lightmem configuration (the building block of the API)."""
    info = info or inspect_batch(batch)
    request = StepRequest(
        device=settings.device,
        precision=settings.precision,
        optimizer=settings.optimizer,
        loss_fn=settings.loss_fn,
        offload=offload,
        checkpoint=checkpoint,
        batch_size=batch_size,
        original_batch_size=info.batch_size,
        zero_grad=settings.zero_grad,
    )
    return run_step(model, batch, request)


def scenario_from(name: str, trace: StepTrace) -> StepMemory:
    peak = trace.peak
    return StepMemory(
        name=name,
        peak_bytes=peak.bytes,
        breakdown=dict(peak.breakdown),
        peak_phase=peak.phase,
        peak_op=peak.op,
        peak_block=peak.block,
        activations_at_forward_end=trace.activations_at_forward_end,
        checkpointed=list(trace.checkpointed),
        offloaded_bytes=trace.offloaded_bytes,
        host_bytes=trace.host_bytes,
        seconds=trace.seconds,
    )


def blocks_from(trace: StepTrace) -> dict[str, BlockMemory]:
    return {
        name: BlockMemory(
            name, usage.saved_bytes, usage.forward_flops, usage.input_bytes, list(usage.saved_sizes),
            kind=trace.block_kinds.get(name, ""), repeated=name in trace.repeated_blocks,
        )  # fmt: skip
        for name, usage in trace.blocks.items()
    }


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def estimate_memory(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    offload: bool | Mapping[str, Any] | None = None,
    checkpoint: Iterable[str | type] | str | None = None,
    budget: int | str | None = None,
    overhead_bytes: int | str | None = None,
    zero_grad: str = "after_forward",
) -> MemoryEstimate:
    """Predict the peak memory of one steady-state training step, without allocating it.

    One training step (forward, backward, optimizer step) runs on fake tensors on the CPU: no
    tensor memory is allocated, so a step needing tens of GB on a GPU is estimated on a laptop
    in seconds. The peak is that of a step after the first: the previous step's gradients and
    the optimizer state are alive during forward, gradients are set to None before backward
    (as Lightning does). The model is left untouched: fake parameters are swapped in and out.

    Args:
        model: an ``nn.Module`` (with ``loss_fn``, or returning a scalar loss / an output with
            ``.loss``) or a ``LightningModule`` (its ``training_step`` and, unless ``optimizer``
            is given, its ``configure_optimizers``). It may live on the meta device.
        batch: one batch as the model takes it (a tensor, or a dict/tuple/list of them). Values
            are read once, for advice; the step itself only uses shapes and dtypes. A plain
            module is called as ``model(batch)``, ``model(**batch)`` or ``model(*batch)``.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        optimizer: a ``torch.optim`` name ("adamw", "adam", "sgd", ...) or a callable
            ``params -> Optimizer``. Default: ``configure_optimizers`` for a LightningModule,
            "adamw" otherwise.
        precision: Lightning's precision flag: "32-true", "16-mixed", "bf16-mixed", "16-true",
            "bf16-true", "64-true" (or 32, 16, "bf16", 64).
        device: "cuda" (CUDA's allocator rounding, foreach optimizers, autocast policy, fused
            dropout) or "cpu" (matches a real CPU run).
        offload: lightmem's activation offload to simulate: True for its defaults, or a dict with
            any of ``min_bytes``, ``include``, ``exclude``, ``prefetch``, ``host_budget``.
        checkpoint: targets for ``lightmem.checkpoint.apply_checkpointing`` (class names,
            qualified-name globs, classes), applied for the estimate and removed afterwards.
        budget: device memory to compare against ("24GiB", bytes); enables budget advice.
        overhead_bytes: allowance for what is not modelled (CUDA context, library workspaces,
            fragmentation): default "1GiB" on CUDA, 0 on CPU. Reported apart from the breakdown.
        zero_grad: "after_forward" (Lightning's order, the default: the previous step's
            gradients are alive during forward) or "before_forward" (a plain PyTorch loop that
            calls ``optimizer.zero_grad()`` before the forward).

    Returns:
        A :class:`MemoryEstimate` for the requested configuration, with "baseline" (no lightmem)
        and each requested flag alone in ``scenarios``.

    Raises:
        ValueError: an argument is invalid (the message names it and lists what is accepted),
            or the loss is not a scalar.
        EstimateError: the step cannot run on fake tensors (it reads tensor values, or a
            LightningModule hook needs a Trainer); the message says what to change.

    Example::

        >>> import torch
        >>> from lightmem import estimate_memory
        >>> model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1))
        >>> est = estimate_memory(model, torch.randn(64, 1024), lambda m, x: m(x).mean(), device="cpu")
        >>> sorted(est.breakdown) == sorted(["parameters", "gradients", "optimizer_state", "activations", "temporaries"])
        True
    """
    started = time.perf_counter()
    settings = parse_settings(
        "estimate_memory", model, loss_fn, optimizer=optimizer, precision=precision, device=device,
        overhead_bytes=overhead_bytes, budget=budget, zero_grad=zero_grad,
    )  # fmt: skip
    offload_config = parse_offload(offload, flag="estimate_memory(offload=...)")
    if offload_config is not None:
        # Patterns are checked against the model now, so a typo fails before any tracing.
        from lightmem.offload.scope import ModuleScope

        ModuleScope(
            model, offload_config.include, offload_config.exclude,
            include_flag="estimate_memory(offload=...)['include']",
            exclude_flag="estimate_memory(offload=...)['exclude']",
        )  # fmt: skip
    targets = parse_checkpoint(checkpoint, flag="estimate_memory(checkpoint=...)")
    info = inspect_batch(batch)
    return build_estimate(model, batch, settings, info, offload_config, targets, started=started)


def build_estimate(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    info: BatchInfo,
    offload: OffloadConfig | None,
    checkpoint: tuple[Any, ...] | None,
    *,
    started: float | None = None,
    batch_size: int | None = None,
) -> MemoryEstimate:
    """Run the baseline and every requested configuration and put the report together."""
    from lightmem.estimate.advice import advise

    started = time.perf_counter() if started is None else started
    configurations: list[tuple[str, OffloadConfig | None, tuple[Any, ...] | None]] = [
        ("baseline", None, None)
    ]
    if checkpoint:
        configurations.append(("checkpoint", None, checkpoint))
    if offload is not None:
        configurations.append(("offload", offload, None))
    if checkpoint and offload is not None:
        configurations.append(("checkpoint+offload", offload, checkpoint))
    traces: dict[str, StepTrace] = {}
    for name, offload_config, targets in configurations:
        traces[name] = run_configuration(
            model,
            batch,
            settings,
            offload=offload_config,
            checkpoint=targets,
            batch_size=batch_size,
            info=info,
        )
    scenarios = {name: scenario_from(name, trace) for name, trace in traces.items()}
    chosen = scenarios[configurations[-1][0]]
    baseline = traces["baseline"]
    estimate = MemoryEstimate(
        peak_bytes=chosen.peak_bytes,
        breakdown=dict(chosen.breakdown),
        peak_phase=chosen.peak_phase,
        peak_op=chosen.peak_op,
        peak_block=chosen.peak_block,
        overhead_bytes=settings.overhead_bytes,
        budget_bytes=settings.budget_bytes,
        device=settings.device,
        precision=settings.precision.name,
        optimizer=settings.optimizer.name
        if settings.optimizer.factory is not None
        else "+".join(baseline.optimizers),
        batch_size=batch_size if batch_size is not None else info.batch_size,
        parameter_count=parameter_count(model),
        blocks=blocks_from(baseline),
        scenarios=scenarios,
        not_modelled=list(NOT_MODELLED) + (list(CUDA_NOTES) if settings.device == "cuda" else []),
        inputs_bytes=baseline.peak.inputs_bytes,
    )
    estimate.advice = advise(estimate, info, baseline)
    estimate.seconds = time.perf_counter() - started
    return estimate
