"""The one settings object of an estimator call, parsed once at its entry point and passed down.

``estimate_memory``, ``plan``, ``max_batch_size`` and ``frontier`` each turn their arguments into
one ``EstimateSettings`` (``parse_settings``, each flag by its own parser in
``lightmem.config.estimator``) before anything is traced, so a bad argument fails at once with its
name (``plan(precision=...)``), and nothing below an entry point parses a flag again. What decides a
fake step, what a plan searches under, what prices it and the chunked-loss what-if all travel in
it; an entry point that asks a variant (the other checkpoint policy, the loss priced as chunked)
derives it with ``replace``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.compiled import user_module_name
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, Spelling, parse_size
from lightmem.config.checkpointing import parse_checkpoint_policy
from lightmem.config.estimator import (
    OptimizerChoice,
    PlanPrices,
    Precision,
    parse_device,
    parse_optimizer,
    parse_overhead,
    parse_planned_offload,
    parse_precision,
    parse_zero_grad,
)  # fmt: skip
from lightmem.config.optimizer_offload import parse_optimizer_offload
from lightmem.device_memory import expandable_segments_on
from lightmem.devices import DeviceSpeeds, gpu_key, parse_gpu, resolve_gpu, speeds_for
from lightmem.estimate.host import HostLimit, host_limit
from lightmem.lightning_packages import is_lightning_module

LossFn = Callable[[nn.Module, Any], Any]
AUTO_POLICY = "auto"
"""``plan(checkpoint_policy="auto")``: the planner chooses what checkpointed blocks keep."""


@dataclass(frozen=True)
class EstimateSettings:
    """Every argument of one estimator call, validated (``parse_settings``)."""

    device: str
    precision: Precision
    optimizer: OptimizerChoice
    loss_fn: LossFn | None
    overhead_bytes: int
    budget_bytes: int | None
    zero_grad: str = "after_forward"
    checkpoint_policy: CheckpointPolicyArg = "full"
    """What checkpointed blocks keep: applied to ``checkpoint=...`` and priced by the planner;
    ``AUTO_POLICY`` (a plan only): the faster of "full" and "save_matmuls"."""
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
    offload: OffloadSettings | None = None
    """The offload settings a plan searches under (its modules are the plan's choice): lightmem's
    defaults (``parse_settings``) unless the call gives its own; None: offload is not planned
    (``plan(offload=False)``)."""
    loss_as_chunked: bool = False
    """Every step priced as if its loss were chunked (``lightmem.linear_cross_entropy``): the
    what-if a refusal and a frontier ask where the loss's logits dominate (``trace.logits``)."""
    tile: bool = False
    """A plan may run position-wise modules in sequence shards (read from the baseline's trace:
    ``MemoryEstimate.tile_candidates``): ``plan(tile=True)``, ``LightMem(plan="auto", tile=True)``,
    ``max_sequence_length``'s default. Tiling is exact within 1e-6, not bitwise: only when asked."""
    host: HostLimit = HostLimit(None)
    """The host memory a plan's configuration may hold (``lightmem.estimate.host``)."""

    @property
    def offload_optimizer(self) -> bool:
        return self.optimizer_offload is not None

    @property
    def offload_considered(self) -> bool:
        """Whether a plan may offload activations: settings to search under, on a device whose
        memory is not the host's."""
        return self.offload is not None and self.device != "cpu"

    def searching(self, offload: OffloadSettings | None) -> EstimateSettings:
        """These settings with a plan searching under ``offload`` (None: no offload)."""
        return replace(self, offload=offload)

    def with_policy(self, policy: CheckpointPolicyArg) -> EstimateSettings:
        """These settings with checkpointed blocks keeping what ``policy`` keeps."""
        return replace(self, checkpoint_policy=policy)

    def priced_as_chunked(self) -> EstimateSettings:
        """These settings with every step priced as if its loss were chunked."""
        return replace(self, loss_as_chunked=True)


def sharded_by_fsdp2(model: nn.Module) -> str | None:
    """Why the estimator does not trace ``model``, where FSDP2's ``fully_shard`` sharded it (its
    modules are ``FSDPModule`` subclasses); None for any other model. A dry run traces one process's
    step on an unsharded copy, so what a rank holds (its shards, the blocks all-gathered around their
    forward and backward, the gradients reduce-scattered) is not modelled yet."""
    # Only once torch.distributed.fsdp is imported can a module be an FSDPModule: no import here.
    sharded_class = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if sharded_class is None:
        return None
    names = [user_module_name(name) or "the model" for name, module in model.named_modules() if isinstance(module, sharded_class)]
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"the model is sharded by FSDP2 (fully_shard on {shown}), and the estimator traces one process's unsharded "
        "step: what a rank holds (its shards, the blocks all-gathered around their forward and backward, the "
        "gradients reduce-scattered) is not modelled yet"
    )


def parse_settings(
    fn_name: str,
    model: nn.Module,
    loss_fn: LossFn | None,
    *,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    overhead_bytes: int | str | None = None,
    budget: int | str | None = None,
    zero_grad: str = "after_forward",
    checkpoint_policy: CheckpointPolicyArg = "full",
    gpu: str | DeviceSpeeds = "auto",
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str | None = None,
    auto_policy: bool = False,
    tile: bool = False,
    host_budget: int | float | str | None = None,
) -> EstimateSettings:
    """Check every argument once; each ``ValueError`` names ``fn_name(argument=...)``.

    ``gpu``: a name of ``devices.GPU_NAMES`` or speeds measured on the training device
    (``devices.measure_device_speeds``); ``flops_per_s`` and ``link_bytes_per_s`` override its
    matrix rates and its host link. ``auto_policy``: ``checkpoint_policy="auto"`` is accepted (a
    plan's). The offload a plan searches under is lightmem's defaults: an entry point that takes
    an ``offload`` argument parses it in its own order and sets it (``EstimateSettings.searching``).
    ``tile``: whether plans may tile (a bool); ``host_budget``: the host memory a plan may hold
    (``lightmem.estimate.host.host_limit``)."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"{fn_name}(model=...): expected an nn.Module or LightningModule; got {type(model).__name__}"
        )
    sharded = sharded_by_fsdp2(model)
    if sharded is not None:
        raise ValueError(f"{fn_name}(model=...): {sharded}. Estimate the model before fully_shard to see one process's unsharded step.")
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
    if not isinstance(tile, bool):
        raise ValueError(f"{fn_name}(tile=...): expected True (plans may tile position-wise modules) or False; got {tile!r}")
    auto = auto_policy and isinstance(checkpoint_policy, str) and checkpoint_policy == AUTO_POLICY
    return EstimateSettings(
        device=kind,
        precision=parsed_precision,
        optimizer=parse_optimizer(optimizer, flag=f"{fn_name}(optimizer=...)"),
        loss_fn=loss_fn,
        overhead_bytes=parse_overhead(overhead_bytes, kind, flag=f"{fn_name}(overhead_bytes=...)"),
        budget_bytes=None if budget is None else parse_size(budget, flag=f"{fn_name}(budget=...)"),
        zero_grad=parse_zero_grad(zero_grad, flag=f"{fn_name}(zero_grad=...)"),
        checkpoint_policy=AUTO_POLICY if auto else parse_checkpoint_policy(
            checkpoint_policy, flag=f"{fn_name}(checkpoint_policy=...)"
        ),
        gpu=key,
        optimizer_offload=model_state,
        speeds=speeds,
        expandable_segments=expandable_segments_on(),
        offload=parse_planned_offload(True, flag=f"{fn_name}(offload=...)"),
        tile=tile,
        host=host_limit(host_budget, kind, flag=f"{fn_name}(host_budget=...)"),
    )
