"""``plan``: the cheapest lightmem configuration that fits a memory budget.

Each top-level block is kept, offloaded, checkpointed, or both (checkpointed, with the inputs it
keeps offloaded: the two compose). Checkpointing a block saves its saved activations less its
input (which checkpoint keeps) and less the op outputs the checkpoint policy keeps
(``"save_matmuls"``: matmul and attention outputs; none under ``"full"``), and costs one re-run
of the ops the policy recomputes, priced by their forward FLOPs over ``flops_per_s`` (all of the
block's FLOPs under ``"full"``; under ``"save_matmuls"`` only FLOPs outside matmuls and attention,
which this model counts as nearly free: the memory-bound ops it re-runs are not priced). One
policy holds for the whole plan (``LightMem`` takes one ``checkpoint_policy``). Offloading saves
its saved storages of at least ``min_bytes`` and costs only the part of the transfer (bytes over ``link_bytes_per_s``, out during
forward, back during backward) that the block's compute does not hide: free while it hides.
Blocks are chosen greedily by cost per byte saved until the predicted excess is covered; the
choice is then verified by the estimator, and the excess still found is added for another round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import DEFAULT_MIN_BYTES, OffloadSettings, OptimizerOffloadSettings, format_bytes, parse_size
from lightmem.estimate.advice import advise
from lightmem.estimate.batch import BatchInfo, inspect_batch
from lightmem.estimate.configuration import EstimateSettings, build_report, parse_settings, run_configuration
from lightmem.estimate.report import BlockMemory, MemoryEstimate, Plan, natural_order, policy_name
from lightmem.estimate.settings import parse_offload
from lightmem.estimate.step import ROOT_BLOCK

DEFAULT_LINK_BYTES_PER_S = "25GB"
"""Host link bandwidth per second (PCIe 4.0 x16 sustains about this)."""
DEFAULT_FLOPS_PER_S = {"cuda": 100e12, "cpu": 0.2e12}
"""Sustained forward throughput used to price re-computation; pass your device's own."""
KEEP, OFFLOAD, CHECKPOINT, BOTH = "keep", "offload", "checkpoint", "checkpoint+offload"
_RANK = {KEEP: 0, OFFLOAD: 1, CHECKPOINT: 2, BOTH: 3}  # a block only moves up this list


@dataclass
class Costs:
    flops_per_s: float
    link_bytes_per_s: float
    min_bytes: int
    allow_offload: bool


def _offload_s(nbytes: int, forward_s: float, costs: Costs) -> float:
    """Transfer time compute does not hide: out while forward runs on, back during backward (~2x)."""
    transfer_s = nbytes / costs.link_bytes_per_s
    return max(0.0, transfer_s - forward_s) + max(0.0, transfer_s - 2 * forward_s)


def _kept_input(block: BlockMemory, costs: Costs) -> int:
    return block.input_bytes if block.input_bytes >= costs.min_bytes else 0


def saves_bytes(block: BlockMemory, action: str, costs: Costs) -> int:
    """Predicted activation bytes ``action`` takes off the device for ``block``."""
    if action == OFFLOAD:
        return block.offloadable_bytes(costs.min_bytes)
    if action == CHECKPOINT:
        return max(0, block.saved_bytes - block.input_bytes - block.kept_bytes)
    if action == BOTH:  # offload moves the input to host; the outputs a policy keeps stay on the device
        return max(0, block.saved_bytes - block.input_bytes - block.kept_bytes) + _kept_input(block, costs)
    return 0


def recompute_s(block: BlockMemory, costs: Costs) -> float:
    """Seconds a checkpointed block's re-run costs: the FLOPs its policy recomputes."""
    flops = block.forward_flops if block.recompute_flops is None else block.recompute_flops
    return flops / costs.flops_per_s


def _cost_s(block: BlockMemory, action: str, costs: Costs) -> float:
    forward_s = block.forward_flops / costs.flops_per_s
    if action == CHECKPOINT:
        return recompute_s(block, costs)
    if action == OFFLOAD:
        return _offload_s(saves_bytes(block, OFFLOAD, costs), forward_s, costs)
    if action == BOTH:
        return recompute_s(block, costs) + _offload_s(_kept_input(block, costs), forward_s, costs)
    return 0.0


def model_state_transfer_s(base: MemoryEstimate, costs: Costs) -> float:
    """Model-state offload's link time per step: each gradient out and each parameter back (the
    parameters' bytes twice), priced as not hidden by compute: an upper bound on what it exposes."""
    return 2 * base.scenarios["baseline"].breakdown["parameters"] / costs.link_bytes_per_s


def planned_blocks(blocks: Mapping[str, BlockMemory]) -> dict[str, BlockMemory]:
    """The blocks a plan acts on: the repeated layers, or every block of a model without any."""
    repeated = {name: block for name, block in blocks.items() if block.repeated}
    if repeated:
        return repeated
    return {name: block for name, block in blocks.items() if name != ROOT_BLOCK}


def choose_actions(
    blocks: Mapping[str, BlockMemory], need_bytes: int, costs: Costs, start: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Per-block actions, cheapest per byte first, until ``need_bytes`` of activations are saved.

    Free offloads (transfer hidden by compute) go first; a block may later move from offload to
    checkpoint. Returns the actions (blocks left out are kept), possibly short of the need.
    """
    actions = dict(start or {})
    saved = sum(saves_bytes(blocks[name], action, costs) for name, action in actions.items())
    order = [CHECKPOINT] if not costs.allow_offload else [OFFLOAD, CHECKPOINT, BOTH]
    candidates = planned_blocks(blocks)
    while saved < need_bytes:
        best: tuple[float, int, str, str] | None = None
        for name, block in candidates.items():
            current = actions.get(name, KEEP)
            for action in order:
                if _RANK[action] <= _RANK[current]:
                    continue
                gain = saves_bytes(block, action, costs) - saves_bytes(block, current, costs)
                if gain <= 0:
                    continue
                extra = _cost_s(block, action, costs) - _cost_s(block, current, costs)
                key = (max(extra, 0.0) / gain, -gain, natural_order(name), action)
                if best is None or key < best:
                    best = key
        if best is None:
            break
        _, negative_gain, name_key, action = best
        name = "".join(str(part) for part in name_key)
        actions[name] = action
        saved += -negative_gain
    return actions


def config_for(actions: Mapping[str, str], min_bytes: int) -> tuple[list[str], dict[str, Any] | None]:
    """Map per-block actions onto lightmem flags: checkpoint names and the offload dict."""
    checkpoint = [name for name, action in actions.items() if action in (CHECKPOINT, BOTH)]
    offloaded = [name for name, action in actions.items() if action in (OFFLOAD, BOTH)]
    offload = {"min_bytes": min_bytes, "include": offloaded} if offloaded else None
    return checkpoint, offload


def plan(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    overhead_bytes: int | str | None = None,
    zero_grad: str = "after_forward",
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str = DEFAULT_LINK_BYTES_PER_S,
    offload: bool | Mapping[str, Any] | OffloadSettings | None = None,
    max_rounds: int = 4,
    checkpoint_policy: CheckpointPolicyArg = "full",
    offload_optimizer: bool | OptimizerOffloadSettings = False,
) -> Plan:
    """Pick, per top-level block, keep / offload / checkpoint / both so the step fits ``budget``.

    Args:
        budget: device memory for the whole step, overhead allowance included ("24GiB", bytes).
        flops_per_s: sustained forward throughput used to price re-computation (default 100e12
            on CUDA, 0.2e12 on CPU).
        link_bytes_per_s: host link bandwidth per second for offload ("25GB" by default).
        offload: the offload settings the plan searches under, as for :func:`estimate_memory`
            (a dict such as ``{"min_bytes": "4MiB", "exclude": ["lm_head"]}``, or
            ``OffloadSettings``); None: lightmem's defaults; False: plan checkpointing only. The
            modules to offload are the plan's choice: ``include`` is refused. ``Plan.offload``
            is these settings with the chosen threshold and modules, and ``Plan.settings`` says
            what the search ran under.
        max_rounds: verification rounds before giving up.
        checkpoint_policy: what the blocks the plan checkpoints keep: ``"full"`` (their inputs),
            ``"save_matmuls"`` or a per-op callable, as in ``apply_checkpointing``; priced and
            verified with it, and returned in ``lightmem_kwargs()``.
        offload_optimizer: plan with gradients and optimizer state on the host. Without it the
            plan turns it on by itself when parameters + gradients + optimizer state exceed the
            budget and the parameters alone do not (``lightmem_kwargs()`` then has it).
        Other arguments: as for :func:`estimate_memory`.

    On "cpu" only checkpointing is planned (offloading CPU memory to CPU memory saves nothing).

    Returns:
        A :class:`Plan`; ``plan.fits`` is False with a ``reason`` when the parameters (and, unless
        they can go to the host, gradients and optimizer state) alone exceed the budget or no
        combination of actions gets under it.

    Raises:
        ValueError: a bad argument (named in the message).
    """
    started = time.perf_counter()
    settings = parse_settings(
        "plan", model, loss_fn, optimizer=optimizer, precision=precision, device=device,
        overhead_bytes=overhead_bytes, budget=budget, zero_grad=zero_grad, checkpoint_policy=checkpoint_policy,
        offload_optimizer=offload_optimizer,
    )  # fmt: skip
    offload_settings = parse_offload(True if offload is None else offload, flag="plan(offload=...)")
    if offload_settings is not None and offload_settings.include is not None:
        raise ValueError(
            f"{offload_settings.flag('include')}: the plan chooses the modules to offload itself; leave it unset"
        )
    link = parse_size(link_bytes_per_s, flag="plan(link_bytes_per_s=...)")
    if link <= 0:
        raise ValueError(f"plan(link_bytes_per_s=...): must be positive; got {link_bytes_per_s!r}")
    if flops_per_s is not None and float(flops_per_s) <= 0:
        raise ValueError(f"plan(flops_per_s=...): must be positive; got {flops_per_s!r}")
    costs = default_costs(
        settings.device, flops_per_s=flops_per_s, link_bytes_per_s=link,
        min_bytes=offload_settings.min_bytes if offload_settings is not None else DEFAULT_MIN_BYTES,
    )  # fmt: skip
    if offload_settings is None:
        costs.allow_offload = False
    info = inspect_batch(batch)
    base, baseline = build_report(model, batch, settings, info, None, None)
    result = search_plan(model, batch, settings, info, base, costs, offload=offload_settings, max_rounds=max_rounds)
    base.advice = advise(base, info, baseline, result)
    result.seconds = time.perf_counter() - started
    return result


def default_costs(
    device: str,
    *,
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str = DEFAULT_LINK_BYTES_PER_S,
    min_bytes: int | str = DEFAULT_MIN_BYTES,
) -> Costs:
    """The prices ``plan`` uses unless told otherwise (also those behind the estimate's advice)."""
    throughput = DEFAULT_FLOPS_PER_S[device] if flops_per_s is None else float(flops_per_s)
    return Costs(
        throughput, float(parse_size(link_bytes_per_s, flag="link_bytes_per_s")),
        parse_size(min_bytes, flag="offload_min_bytes"), allow_offload=device != "cpu",
    )  # fmt: skip


def search_plan(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    info: BatchInfo,
    base: MemoryEstimate,
    costs: Costs,
    *,
    offload: OffloadSettings | None = None,
    max_rounds: int = 4,
) -> Plan:
    """Choose actions for the repeated layers of ``base`` and verify each choice with a fake step.

    ``offload``: the settings a chosen offload is built from (None: lightmem's defaults)."""
    base_offload = offload if offload is not None else parse_offload(True, flag="plan(offload=...)")
    assert base_offload is not None
    budget_bytes = settings.budget_bytes
    assert budget_bytes is not None
    min_bytes = costs.min_bytes
    available = budget_bytes - settings.overhead_bytes
    baseline_peak = base.scenarios["baseline"].peak_bytes
    result = Plan(
        [], None, baseline_peak, settings.overhead_bytes, budget_bytes, False, "", estimate=base,
        checkpoint_policy=settings.checkpoint_policy, settings=_searched_under(settings, costs, offload),
    )  # fmt: skip
    result.estimate_kinds = {name: block.kind for name, block in base.blocks.items()}
    model_state = settings.offload_optimizer
    if base.static_exceeds_budget and (model_state or not base.parameters_fit):
        what = "the parameters" if model_state else "parameters + gradients + optimizer state"
        result.reason = (
            f"{what} alone take {format_bytes(base.static_bytes)} "
            f"of the {format_bytes(available)} left after the {format_bytes(settings.overhead_bytes)} "
            "overhead allowance; no activation technique helps (see the advice)"
        )
        return result
    if base.static_exceeds_budget or model_state:
        # Gradients and optimizer state go to the host; activations are planned on top of that.
        model_state = True
        result.offload_optimizer = True
        named = base.scenarios.get("offload_optimizer")
        baseline_peak = (
            named.peak_bytes
            if named is not None
            else run_configuration(model, batch, settings, info=info, offload_optimizer=True).peak.bytes
        )
        result.predicted_peak_bytes = baseline_peak
        result.exposed_transfer_s = model_state_transfer_s(base, costs)
    if baseline_peak <= available:
        result.fits = True
        result.reason = (
            f"with offload_optimizer the peak is {format_bytes(baseline_peak)} + overhead "
            f"{format_bytes(settings.overhead_bytes)}"
            if model_state
            else "the baseline step already fits"
        )
        return result

    need = baseline_peak - available
    actions: dict[str, str] = {}
    exhausted = False
    for _ in range(max_rounds):
        chosen = choose_actions(base.blocks, need, costs, actions)
        if chosen == actions:
            exhausted = True
            break
        actions = chosen
        checkpoint, chosen_offload = config_for(actions, min_bytes)
        offload_config = (
            base_offload.with_choice(min_bytes=chosen_offload["min_bytes"], include=tuple(chosen_offload["include"]))
            if chosen_offload
            else None
        )
        trace = run_configuration(
            model, batch, settings, info=info, checkpoint=tuple(checkpoint) or None, offload=offload_config,
            offload_optimizer=model_state,
        )  # fmt: skip
        result.checkpoint, result.offload, result.actions = checkpoint, offload_config, dict(actions)
        result.predicted_peak_bytes = trace.peak.bytes
        result.recompute_s = sum(
            recompute_s(base.blocks[n], costs) for n, a in actions.items() if a in (CHECKPOINT, BOTH)
        )
        result.exposed_transfer_s = (
            sum(_cost_s(base.blocks[n], a, costs) for n, a in actions.items()) - result.recompute_s
        ) + (model_state_transfer_s(base, costs) if model_state else 0.0)
        if trace.peak.bytes <= available:
            result.fits = True
            result.reason = f"verified peak {format_bytes(trace.peak.bytes)} + overhead {format_bytes(settings.overhead_bytes)}"
            break
        # The peak fell by less than predicted (reloads, re-runs, what stays outside blocks):
        # ask for the shortfall on top of what was already asked.
        need += trace.peak.bytes - available
    if not result.fits:
        what = (
            "with every repeated layer checkpointed or offloaded"
            if exhausted
            else f"after {max_rounds} rounds"
        )
        result.reason = (
            f"{what} the verified peak is {format_bytes(result.predicted_peak_bytes)}, over the "
            f"{format_bytes(available)} available after the overhead allowance; what remains is parameters, "
            "gradients, optimizer state, temporaries and tensors outside the blocks"
        )
    return result


def _searched_under(settings: EstimateSettings, costs: Costs, offload: OffloadSettings | None) -> dict[str, Any]:
    """What a plan was searched under, JSON-ready: the flags that shaped it, as parsed."""
    return {
        "device": settings.device,
        "precision": settings.precision.name,
        "optimizer": settings.optimizer.name,
        "overhead_bytes": settings.overhead_bytes,
        "budget_bytes": settings.budget_bytes,
        "checkpoint_policy": policy_name(settings.checkpoint_policy),
        "offload": offload.to_dict() if offload is not None else None,
        "offload_considered": costs.allow_offload,
        "offload_optimizer": settings.offload_optimizer,
        "flops_per_s": costs.flops_per_s,
        "link_bytes_per_s": costs.link_bytes_per_s,
    }
