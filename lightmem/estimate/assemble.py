"""The report of one estimate: the baseline step and each requested configuration side by side
(``build_report``), each configuration's step priced from the baseline's blocks."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from lightmem.compiled import holds_compiled_modules
from lightmem.config import OffloadSettings, TileSettings
from lightmem.estimate.pricing.costs import costs_for
from lightmem.estimate.pricing.timeline import configuration_time
from lightmem.estimate.report import CUDA_NOTES, NOT_MODELLED, MemoryEstimate, StepMemory
from lightmem.estimate.settings import EstimateSettings
from lightmem.estimate.steps import STEPS, baseline_key, run_configuration
from lightmem.estimate.trace.batch import BatchInfo
from lightmem.estimate.trace.blocks import BlockMemory
from lightmem.estimate.trace.step import StepTrace, as_chunked_trace


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
        routing_bound=trace.routing_bound,
    )


def blocks_from(trace: StepTrace) -> dict[str, BlockMemory]:
    """The report's blocks: the trace's own, copied (a remembered trace is never written through)."""
    return {name: dataclasses.replace(block, saved_sizes=list(block.saved_sizes)) for name, block in trace.blocks.items()}


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


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
    key = baseline_key(model, batch, settings, info, batch_size, sequence) if settings.speeds is not None else None
    if baseline is None and key is not None:
        baseline = STEPS.baseline(model, key, settings.speeds)  # type: ignore[arg-type]
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
    # A baseline traced here, or derived (the other policy's): remembered with its chunked what-if.
    if key is not None and not STEPS.holds_baseline(model, key, traces["baseline"]):
        STEPS.remember_baseline(model, key, traces["baseline"])
        chunked = as_chunked_trace(traces["baseline"])
        if chunked is not None:  # the what-if's baseline, should the loss be priced as chunked
            chunked_key = baseline_key(model, batch, settings.priced_as_chunked(), info, batch_size, sequence)
            STEPS.remember_baseline(model, chunked_key, chunked)
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
        routing_bound=chosen.routing_bound,
    )
    return estimate, baseline
