"""One fake step per lightmem configuration, and the report built from them (no advice).

Shared by ``estimate_memory``, ``max_batch_size`` and ``plan``: the arguments are validated once
(``parse_settings``), each configuration runs as one fake step (``run_configuration``), and
``build_report`` puts the baseline and the requested configurations side by side.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import (
    OffloadSettings,
    OptimizerOffloadSettings,
    Spelling,
    TileSettings,
    parse_checkpoint_policy,
    PlanPrices,
    parse_optimizer_offload,
    parse_size,
)
from lightmem.estimate.batch import BatchInfo, inspect_batch
from lightmem.devices import DeviceSpeeds, gpu_key, parse_gpu, resolve_gpu, speeds_for
from lightmem.compiled import holds_compiled_modules
from lightmem.device_memory import expandable_segments_on
from lightmem.estimate.report import CUDA_NOTES, NOT_MODELLED, BlockMemory, MemoryEstimate, StepMemory
from lightmem.estimate.settings import (
    OptimizerChoice,
    Precision,
    parse_device,
    parse_offload,
    parse_optimizer,
    parse_overhead,
    parse_precision,
    parse_zero_grad,
)
from lightmem.estimate.logits import pricing_chunked
from lightmem.estimate.step import MASTER_DTYPE, StepRequest, StepTrace, reprice, run_step
from lightmem.estimate.step_time import Costs, configuration_time
from lightmem.lightning_packages import is_lightning_module

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
    checkpoint_policy: CheckpointPolicyArg = "full"
    """What checkpointed blocks keep: applied to ``checkpoint=...`` and priced by the planner."""
    gpu: str = "default"
    """The GPU of a CUDA estimate, resolved (``"auto"`` is this machine's): its cuBLAS workspace
    size and, unless measured ones are given, its speeds."""
    optimizer_offload: OptimizerOffloadSettings | None = None
    """Model-state offload asked for (gradients, optimizer state and step on the host); None: not."""
    speeds: DeviceSpeeds | None = None
    """What every op, re-run and transfer is priced at (``lightmem.devices``)."""
    expandable_segments: bool = False
    """The CUDA allocator's expandable segments are on: the steps' requests are replayed through
    them (``StepTrace.reserved_bytes``)."""

    @property
    def offload_optimizer(self) -> bool:
        return self.optimizer_offload is not None


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
    checkpoint_policy: CheckpointPolicyArg = "full",
    gpu: str | DeviceSpeeds = "auto",
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str | None = None,
) -> EstimateSettings:
    """Check every argument once; each ``ValueError`` names ``fn_name(argument=...)``.

    ``gpu``: a name of ``devices.GPU_NAMES`` or speeds measured on the training device
    (``devices.measure_device_speeds``); ``flops_per_s`` and ``link_bytes_per_s`` override its
    matrix rates and its host link."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"{fn_name}(model=...): expected an nn.Module or LightningModule; got {type(model).__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(
            f"{fn_name}(loss_fn=...): expected a callable loss_fn(model, batch) -> loss; got {loss_fn!r}"
        )
    if optimizer is None and not is_lightning_module(model):
        optimizer = "adamw"
    kind = parse_device(device, flag=f"{fn_name}(device=...)")
    parsed_precision = parse_precision(precision, flag=f"{fn_name}(precision=...)")
    model_state = parse_optimizer_offload(
        offload_optimizer, spelling=Spelling(fn_name, (("enabled", "offload_optimizer"),))
    )
    if model_state is not None:
        model_state.refuse_precision(parsed_precision.name)  # with device_dtype: bf16-mixed only
    prices = PlanPrices.parse(flops_per_s=flops_per_s, link_bytes_per_s=link_bytes_per_s, spelling=Spelling(fn_name))
    if isinstance(gpu, DeviceSpeeds):
        key = "hopper" if gpu.hopper else gpu_key(gpu.name)
        # On the CPU the table's figures, with what a fit measured of its blocks (``block_scale``).
        speeds = gpu if kind == "cuda" else replace(speeds_for(kind, key), block_scale=dict(gpu.block_scale))
    else:
        key = resolve_gpu(parse_gpu(gpu, flag=f"{fn_name}(gpu=...)"))
        speeds = speeds_for(kind, key)
    speeds = speeds.with_overrides(flops_per_s=prices.flops_per_s, link_bytes_per_s=prices.link_bytes_per_s)
    return EstimateSettings(
        device=kind,
        precision=parsed_precision,
        optimizer=parse_optimizer(optimizer, flag=f"{fn_name}(optimizer=...)"),
        loss_fn=loss_fn,
        overhead_bytes=parse_overhead(overhead_bytes, kind, flag=f"{fn_name}(overhead_bytes=...)"),
        budget_bytes=None if budget is None else parse_size(budget, flag=f"{fn_name}(budget=...)"),
        zero_grad=parse_zero_grad(zero_grad, flag=f"{fn_name}(zero_grad=...)"),
        checkpoint_policy=parse_checkpoint_policy(checkpoint_policy, flag=f"{fn_name}(checkpoint_policy=...)"),
        gpu=key,
        optimizer_offload=model_state,
        speeds=speeds,
        expandable_segments=expandable_segments_on(),
    )


def run_configuration(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    *,
    offload: OffloadSettings | None = None,
    checkpoint: tuple[Any, ...] | None = None,
    batch_size: int | None = None,
    info: BatchInfo | None = None,
    offload_optimizer: bool | None = None,
    priced: bool = False,
    tile: TileSettings | None = None,
    sequence: tuple[int, int, int] | None = None,
) -> StepTrace:
    """One fake step of ``model`` with one lightmem configuration (the building block of the API).
    ``offload_optimizer`` defaults to the settings' choice; ``priced``: every op priced at the
    settings' speeds (the baseline's, which every configuration's time is built from); ``tile``:
    position-wise modules run in sequence shards; ``sequence``: the batch's sequence at another
    length (``StepRequest.sequence``)."""
    info = info or inspect_batch(batch)
    if offload_optimizer is None:
        offload_optimizer = settings.offload_optimizer
    # The planner may turn model-state offload on by itself: then under the engine's defaults.
    model_state = settings.optimizer_offload or OptimizerOffloadSettings.parse()
    # With device_dtype asked for, the trainable parameters are fp32 (the engine refuses others;
    # under plan="auto" the engine has already cast them) and bf16 on the device only in the steps
    # that offload model state: the baseline keeps them fp32, as it runs without lightmem.
    device_dtype = settings.optimizer_offload.device_dtype if settings.optimizer_offload is not None else None
    trainable_dtype = None if device_dtype is None else device_dtype if offload_optimizer else MASTER_DTYPE
    request = StepRequest(
        device=settings.device,
        precision=settings.precision,
        optimizer=settings.optimizer,
        loss_fn=settings.loss_fn,
        offload=offload,
        checkpoint=checkpoint,
        checkpoint_policy=settings.checkpoint_policy,
        tile=tile,
        batch_size=batch_size,
        original_batch_size=info.batch_size,
        sequence=sequence,
        zero_grad=settings.zero_grad,
        gpu=settings.gpu,
        optimizer_offload=model_state if offload_optimizer else None,
        trainable_dtype=trainable_dtype,
        speeds=settings.speeds if priced else None,
        expandable_segments=settings.expandable_segments,
    )
    return run_step(model, batch, request)


def scenario_from(name: str, trace: StepTrace) -> StepMemory:
    peak = trace.peak
    return StepMemory(
        name=name,
        peak_bytes=peak.bytes,
        reserve=trace.reserve,
        breakdown=dict(peak.breakdown),
        peak_phase=peak.phase,
        peak_op=peak.op,
        peak_block=peak.block,
        activations_at_forward_end=trace.activations_at_forward_end,
        checkpointed=list(trace.checkpointed),
        tiled=list(trace.tiled),
        offloaded_bytes=trace.offloaded_bytes,
        host_bytes=trace.host_bytes + trace.optimizer_host_bytes,
        model_state_link_bytes=trace.optimizer_link_bytes,
        seconds=trace.seconds,
    )


def blocks_from(trace: StepTrace) -> dict[str, BlockMemory]:
    return {
        name: BlockMemory(
            name, usage.saved_bytes, usage.forward_flops, usage.input_bytes, list(usage.saved_sizes),
            kind=trace.block_kinds.get(name, ""), repeated=name in trace.repeated_blocks,
            kept_bytes=usage.kept_bytes, recompute_flops=usage.recompute_flops, forward_s=usage.forward_s,
            backward_s=usage.backward_s, recompute_s=usage.recompute_s, forward_ops=usage.forward_ops,
            backward_ops=usage.backward_ops, recompute_ops=usage.recompute_ops,
        )  # fmt: skip
        for name, usage in trace.blocks.items()
    }


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _model_signature(model: nn.Module) -> tuple[Any, ...]:
    """What a step's memory depends on in the model: its modules' classes and train/eval modes, the
    callables set on them (a ``forward`` wrapped by checkpointing, a ``loss_function`` replaced by the
    chunked loss: ``plan="auto"`` plans with its own checkpoint wrappers taken off, so its plans
    agree), and its parameters' and buffers' names, shapes, dtypes and whether they train (a model
    changed otherwise misses). Not hooks: lightmem's offload scopes and block clocks come and go."""
    return (
        tuple(
            (
                type(module).__name__, module.training,
                tuple(
                    (name, id(value)) for name, value in vars(module).items()
                    if callable(value) and not isinstance(value, (nn.Module, torch.Tensor))
                ),
            )
            for module in model.modules()
        ),  # fmt: skip
        tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()),
        tuple((name, tuple(b.shape), b.dtype) for name, b in model.named_buffers()),
    )


def _batch_signature(batch: Any) -> tuple[Any, ...]:
    return tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in tree_leaves(batch))


_BASELINES: weakref.WeakKeyDictionary[nn.Module, collections.OrderedDict[tuple[Any, ...], StepTrace]] = (
    weakref.WeakKeyDictionary()
)
"""Priced baseline steps by model, the most recent ``BASELINES_KEPT`` of each: a plan made again for
the same batches (``plan="auto"`` once blocks or steps are measured, ``max_batch_size(plan=True)``'s
plan at the size it found, the frontier's rows) traces no baseline again; at new prices it is priced
again from its log (``reprice``)."""
BASELINES_KEPT = 8


def step_memory_key(
    model: nn.Module, batch: Any, settings: EstimateSettings, batch_size: int | None,
    sequence: tuple[int, int, int] | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    """What decides a fake step's memory but the lightmem configuration and the prices: the model, the
    batch (at ``batch_size`` and ``sequence``) and every setting a step reads (a step priced as chunked
    is another step)."""
    return (
        _model_signature(model), _batch_signature(batch), batch_size, sequence, settings.device, settings.precision.name,
        settings.optimizer.name, settings.optimizer.factory, settings.loss_fn, settings.zero_grad, settings.gpu,
        settings.expandable_segments, repr(settings.optimizer_offload), pricing_chunked(),
    )  # fmt: skip


def _baseline_key(
    model: nn.Module, batch: Any, settings: EstimateSettings, info: BatchInfo, batch_size: int | None,
    sequence: tuple[int, int, int] | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    """What decides a baseline step but its prices: ``step_memory_key``, the batch size it is scaled
    from and the checkpoint policy (its per-op counts)."""
    return (*step_memory_key(model, batch, settings, batch_size, sequence), info.batch_size, settings.checkpoint_policy)


def _remembered_baseline(model: nn.Module, key: tuple[Any, ...], speeds: DeviceSpeeds) -> StepTrace | None:
    kept = _BASELINES.get(model)
    found = kept.get(key) if kept is not None else None
    if found is None:
        return None
    kept.move_to_end(key)  # type: ignore[union-attr]
    return found if found.priced_with == speeds else reprice(found, speeds)


def _remember_baseline(model: nn.Module, key: tuple[Any, ...], trace: StepTrace) -> None:
    kept = _BASELINES.setdefault(model, collections.OrderedDict())
    kept[key] = trace
    while len(kept) > BASELINES_KEPT:
        kept.popitem(last=False)


def build_report(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    info: BatchInfo,
    offload: OffloadSettings | None,
    checkpoint: tuple[Any, ...] | None,
    *,
    batch_size: int | None = None,
    baseline: StepTrace | None = None,
    tile: TileSettings | None = None,
    sequence: tuple[int, int, int] | None = None,
) -> tuple[MemoryEstimate, StepTrace]:
    """Run the baseline and every requested configuration; the report (without advice) and the
    baseline's trace. ``baseline``: the baseline, already traced under these settings (not run again)."""
    # With offload_optimizer every configuration but the baseline has it too (named "+offload_optimizer");
    # with tile, every one but the baseline and "offload_optimizer" tiles ("+tile").
    model_state = settings.offload_optimizer
    suffix = "+offload_optimizer" if model_state else ""
    tiled = "+tile" if tile is not None else ""
    Configuration = tuple[str, OffloadSettings | None, tuple[Any, ...] | None, bool, TileSettings | None]
    configurations: list[Configuration] = [("baseline", None, None, False, None)]
    if model_state:
        configurations.append(("offload_optimizer", None, None, True, None))
    if tile is not None:
        configurations.append(("tile" + suffix, None, None, model_state, tile))
    if checkpoint:
        configurations.append(("checkpoint" + tiled + suffix, None, checkpoint, model_state, tile))
    if offload is not None:
        configurations.append(("offload" + tiled + suffix, offload, None, model_state, tile))
    if checkpoint and offload is not None:
        configurations.append(("checkpoint+offload" + tiled + suffix, offload, checkpoint, model_state, tile))
    key = _baseline_key(model, batch, settings, info, batch_size, sequence) if settings.speeds is not None else None
    if baseline is None and key is not None:
        baseline = _remembered_baseline(model, key, settings.speeds)  # type: ignore[arg-type]
    traces: dict[str, StepTrace] = {} if baseline is None else {"baseline": baseline}
    for name, offload_config, targets, offload_model_state, tiles in configurations:
        if name in traces:
            continue
        traces[name] = run_configuration(
            model,
            batch,
            settings,
            offload=offload_config,
            checkpoint=targets,
            batch_size=batch_size,
            info=info,
            offload_optimizer=offload_model_state,
            priced=name == "baseline",
            tile=tiles,
            sequence=sequence,
        )
    if key is not None and traces["baseline"] is not baseline:
        _remember_baseline(model, key, traces["baseline"])
    scenarios = {name: scenario_from(name, traces[name]) for name, *_ in configurations}
    chosen = scenarios[configurations[-1][0]]
    baseline = traces["baseline"]
    blocks = blocks_from(baseline)
    for (name, offload_config, *_), scenario in zip(configurations, scenarios.values()):
        trace = traces[name]
        costs = costs_for(settings, baseline, offload_config)
        scenario.step_seconds = configuration_time(
            blocks, costs, trace.checkpointed, trace.offloaded_by_block, trace.optimizer_link_bytes, trace.tiled
        ).step_s
    estimate = MemoryEstimate(
        peak_bytes=chosen.peak_bytes,
        reserve=chosen.reserve,
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
        sequence_length=sequence[2] if sequence is not None else None,
        parameter_count=parameter_count(model),
        blocks=blocks,
        scenarios=scenarios,
        step_seconds=chosen.step_seconds,
        speeds=settings.speeds,
        expandable_segments=settings.expandable_segments and settings.device == "cuda",
        not_modelled=list(NOT_MODELLED) + (list(CUDA_NOTES) if settings.device == "cuda" else []),
        stand_ins=list(baseline.stand_ins),
        inputs_bytes=baseline.peak.inputs_bytes,
        offload_optimizer=model_state,
        offload_optimizer_device_dtype=settings.optimizer_offload.device_dtype_name if model_state else None,
        compiled=holds_compiled_modules(model),
        op_seconds=dict(baseline.op_seconds),
        loss_logits=baseline.loss_logits,
        modules=dict(baseline.modules),
    )
    return estimate, baseline


def costs_for(settings: EstimateSettings, baseline: StepTrace, offload: OffloadSettings | None) -> Costs:
    """The prices a plan for ``settings`` uses: its device speeds, the baseline step's optimizer
    and host launch time, and the offload windows and threshold (offload is not considered on
    "cpu" or when ``offload`` is None)."""
    speeds = settings.speeds
    assert speeds is not None
    flops = speeds.matmul_rate(_dtype_name(settings))
    searched = offload if offload is not None else parse_offload(True, flag="plan(offload=...)")
    assert searched is not None
    return Costs(
        flops, speeds.link_bytes_per_s, searched.min_bytes,
        allow_offload=offload is not None and settings.device != "cpu", optimizer_s=baseline.optimizer_s,
        host_s=speeds.host_seconds(baseline.priced_ops), host_op_s=speeds.host_op_s, inflight_bytes=searched.max_inflight_bytes,
        prefetch_bytes=searched.prefetch_bytes, block_scale=dict(speeds.block_scale), modules=dict(baseline.modules),
    )  # fmt: skip


def _dtype_name(settings: EstimateSettings) -> str:
    """The dtype the step's products run in, as ``DeviceSpeeds`` names it."""
    dtype = settings.precision.autocast_dtype or settings.precision.param_dtype
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}.get(str(dtype), "fp32")
