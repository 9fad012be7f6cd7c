"""What ``plan`` returns: ``Plan`` (the configuration, its verified peak, its predicted step and
the flags that apply it) and ``PlanOption`` (another configuration the search verified)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import OffloadSettings, format_bytes
from lightmem.devices import format_rate
from lightmem.estimate.report import MemoryEstimate
from lightmem.estimate.words import configuration_parts, format_seconds, policy_name


def shortened(text: str, width: int = 100) -> str:
    """``text`` cut to ``width`` characters, with "..." where it was cut (a repr's one line)."""
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


@dataclass
class PlanOption:
    """A configuration the planner verified: ``fits`` or not, its predicted total (reserved peak +
    overhead), its predicted cost per step and its whole predicted step."""

    description: str
    fits: bool
    predicted_total_bytes: int
    recompute_s: float
    exposed_transfer_s: float
    step_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "fits": self.fits,
            "predicted_total_bytes": self.predicted_total_bytes,
            "recompute_s": self.recompute_s,
            "exposed_transfer_s": self.exposed_transfer_s,
            "step_seconds": self.step_seconds,
        }


@dataclass
class Plan:
    """A lightmem configuration for a budget, verified by the estimator.

    ``checkpoint`` lists the blocks to checkpoint; ``offload`` the offload settings (threshold, and
    the blocks in ``include``, or ``include=None`` when every saved tensor is offloaded) or None;
    ``fits`` says whether what the allocator reserves for the verified peak, plus the overhead
    allowance, is within the budget; ``reason`` says why not when it is not.
    ``predicted_peak_bytes`` is the verified allocated peak (``max_memory_allocated``),
    ``predicted_reserved_bytes`` what the caching allocator reserves for it; for a mixture of
    experts both assume balanced routing, and ``routing_bound_bytes`` (what the worst-case routing
    reserves) is what ``fits`` holds to the budget. ``step_seconds`` is
    the predicted step with the plan, ``baseline_step_seconds`` without lightmem (the same batch,
    whether it fits or not), both priced at ``speeds``; ``recompute_s`` and
    ``exposed_transfer_s`` are what the plan adds; ``alternatives`` the other configurations the
    search verified (those that fitted, slower, and those that did not).
    """

    checkpoint: list[str]
    offload: OffloadSettings | None
    predicted_peak_bytes: int
    overhead_bytes: int
    budget_bytes: int
    fits: bool
    reason: str
    actions: dict[str, str] = field(default_factory=dict)
    recompute_s: float = 0.0
    exposed_transfer_s: float = 0.0
    estimate: MemoryEstimate | None = None
    seconds: float = 0.0
    estimate_kinds: dict[str, str] = field(default_factory=dict, repr=False)
    """Class name per block, for the description."""
    checkpoint_policy: CheckpointPolicyArg = "full"
    """What the checkpointed blocks keep (``LightMem(checkpoint_policy=...)``)."""
    offload_optimizer: bool = False
    """Gradients, optimizer state and step on the host (``LightMem(offload_optimizer=True)``)."""
    offload_optimizer_device_dtype: str | None = None
    """With ``offload_optimizer``: the parameters' dtype on the device the plan was verified with
    ("bf16": ``LightMem(offload_optimizer_device_dtype="bf16")``), None: the parameters' own."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What the search ran under, as parsed: device, precision, optimizer, overhead, budget,
    checkpoint policy, offload settings, whether offload was considered (not on "cpu"), whether
    model-state offload was asked for, and the prices (``flops_per_s``, ``link_bytes_per_s``)."""
    flops_per_s: float = 0.0
    link_bytes_per_s: float = 0.0
    offload_everywhere: bool = False
    """The plan offloads every saved tensor of at least ``offload.min_bytes``, in any module."""
    family: str = ""
    """Which of the planner's walks found it: "checkpoint", "per block" or "offload everywhere"."""
    alternatives: list[PlanOption] = field(default_factory=list)
    evaluations: int = 0
    """Fake steps the search ran (besides the baseline)."""
    host_bytes: int = 0
    """Peak host memory the plan's offload holds (pinned), as the estimator's step predicts."""
    predicted_reserved_bytes: int = 0
    """What the caching allocator must be able to reserve for the plan's step (its requests replayed)."""
    routing_bound_bytes: int = 0
    """For a mixture-of-experts step: what the allocator must reserve for it under the worst-case routing
    (the first top-k experts get every token, each other expert one), which the plan keeps within the
    budget where ``predicted_reserved_bytes`` assumes balanced routing; 0: the step routes nothing."""
    step_seconds: float = 0.0
    baseline_step_seconds: float = 0.0
    speeds: Any = None
    """The ``DeviceSpeeds`` the plan was priced at."""
    costs: Any = field(default=None, repr=False)
    """The ``step_time.Costs`` the search priced every configuration with (None: not searched)."""
    dominant: str = ""
    """When nothing fits: what dominates the peak of the configuration that came closest."""
    chunked_loss: Plan | None = None
    """When nothing fits and the loss's logits dominate the step: the plan for the same batch with
    the loss priced as chunked (``lightmem.linear_cross_entropy``), fitting or not."""
    tile: list[str] = field(default_factory=list)
    """The position-wise modules the plan runs in sequence shards (``LightMem(tile=...)``)."""
    host: Any = None
    """What the plan's step holds on the host (``lightmem.estimate.host.HostBytes``: the offloaded
    activations' pool and model state); None: not searched."""
    limited_by: str = ""
    """When it does not fit: "device" (no configuration's peak fits the budget) or "host" (those
    whose peak fits hold more host memory than the host limit)."""
    tile_kinds: dict[str, str] = field(default_factory=dict, repr=False)
    """Class name per tiled module, for the description."""

    @property
    def predicted_total_bytes(self) -> int:
        """What must fit the budget: the reserved peak (for a mixture of experts, under the worst-case
        routing: ``routing_bound_bytes``) and the overhead allowance."""
        return max(self.predicted_reserved_bytes, self.predicted_peak_bytes, self.routing_bound_bytes) + self.overhead_bytes

    @property
    def host_total_bytes(self) -> int:
        """What the plan holds on the host in all: the offloaded activations' pool and model state."""
        return self.host.total if self.host is not None else 0

    @property
    def slowdown(self) -> float:
        """Predicted step time with the plan over the step without lightmem (1.0: free)."""
        return self.step_seconds / self.baseline_step_seconds if self.baseline_step_seconds else 1.0

    def lightmem_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``LightMem(...)``: offload; when offloading, offload_min_bytes,
        offload_include (omitted when the plan offloads everywhere) and offload_exclude (when the
        search ran under one); checkpoint when it checkpoints, with checkpoint_policy when it is
        not the default; offload_optimizer when the plan moves model state to the host. No list
        is ever empty (``LightMem`` refuses empty lists).

        Raises:
            ValueError: the plan does not fit its budget (``fits`` is False): no flags would make
                the step fit, and the message says why (``reason``).
        """
        if not self.fits:
            raise ValueError(
                f"Plan.lightmem_kwargs(): this plan does not fit its {format_bytes(self.budget_bytes)} budget, so "
                f"no LightMem flags would make the step fit: {self.reason}"
            )
        kwargs: dict[str, Any] = {"offload": self.offload is not None}
        if self.offload is not None:
            kwargs["offload_min_bytes"] = self.offload.min_bytes
            if self.offload.include:
                kwargs["offload_include"] = self.offload.include_arg()
            if self.offload.exclude:
                kwargs["offload_exclude"] = list(self.offload.exclude)
            # The windows the plan sized (what the link moves while a block computes).
            kwargs["prefetch_bytes"] = self.offload.prefetch_bytes
            kwargs["offload_max_inflight_bytes"] = self.offload.max_inflight_bytes
        if self.checkpoint:
            kwargs["checkpoint"] = list(self.checkpoint)
            if self.checkpoint_policy != "full":
                kwargs["checkpoint_policy"] = self.checkpoint_policy
        if self.tile:
            kwargs["tile"] = list(self.tile)
        if self.offload_optimizer:
            kwargs["offload_optimizer"] = True
            if self.offload_optimizer_device_dtype is not None:
                kwargs["offload_optimizer_device_dtype"] = self.offload_optimizer_device_dtype
        return kwargs

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": list(self.checkpoint),
            "checkpoint_policy": policy_name(self.checkpoint_policy),
            "offload": self.offload.to_dict() if self.offload is not None else None,
            "offload_everywhere": self.offload_everywhere,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_total_bytes": self.predicted_total_bytes,
            "overhead_bytes": self.overhead_bytes,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "reason": self.reason,
            "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "routing_bound_bytes": self.routing_bound_bytes or None,
            "step_seconds": self.step_seconds,
            "baseline_step_seconds": self.baseline_step_seconds,
            "slowdown": self.slowdown,
            "speeds": self.speeds.to_dict() if self.speeds is not None else None,
            "offload_optimizer": self.offload_optimizer,
            "offload_optimizer_device_dtype": self.offload_optimizer_device_dtype,
            "family": self.family,
            "recompute_s": self.recompute_s,
            "exposed_transfer_s": self.exposed_transfer_s,
            "settings": self.settings,
            "flops_per_s": self.flops_per_s,
            "link_bytes_per_s": self.link_bytes_per_s,
            "alternatives": [option.to_dict() for option in self.alternatives],
            "evaluations": self.evaluations,
            "host_bytes": self.host_bytes,
            "host_total_bytes": self.host_total_bytes,
            "host_pool_bytes": self.host.pool if self.host is not None else 0,
            "host_model_state_bytes": self.host.model_state if self.host is not None else 0,
            "limited_by": self.limited_by,
            "tile": list(self.tile),
            "chunked_loss": self.chunked_loss.to_dict() if self.chunked_loss is not None else None,
            "lightmem_kwargs": {
                name: policy_name(value) if name == "checkpoint_policy" else value
                for name, value in self.lightmem_kwargs().items()
            } if self.fits else None,
        }

    def parts(self) -> list[str]:
        """What the plan does, one phrase per technique: "checkpoint transformer.h.0-3
        (GPT2Block)", "offload conv1 (Conv2d) (min_bytes 1.00 MiB)", and first, when the plan moves
        model state to the host, "offload_optimizer (gradients and optimizer state on the host)"."""
        dtype = self.offload_optimizer_device_dtype
        offload = self.offload
        own = dict(zip(offload.include or (), offload.include_min_bytes or ())) if offload is not None else {}
        return configuration_parts(
            self.checkpoint, {**self.estimate_kinds, **self.tile_kinds}, offload.min_bytes if offload is not None else 0,
            everywhere=offload is not None and offload.include is None,
            offloaded=[name for name in (offload.include or ()) if not own.get(name)] if offload is not None else (),
            partial=own.items(), policy=self.checkpoint_policy,
            model_state=(f", {dtype} parameters on the device" if dtype is not None else "") if self.offload_optimizer else None,
            in_full=True, tile=self.tile,
        )  # fmt: skip

    def describe(self) -> str:
        """What the plan chose, at what predicted cost, what else fitted, and why this one."""
        if not self.fits:
            text = f"No lightmem configuration fits {format_bytes(self.budget_bytes)}: {self.reason}"
            chunked = self.chunked_loss
            if chunked is not None:
                text += "\n  with a chunked loss (lightmem.linear_cross_entropy): " + (
                    f"fits at {format_bytes(chunked.predicted_total_bytes)}: {'; '.join(chunked.parts()) or 'nothing'}; "
                    f"predicted step {format_seconds(chunked.step_seconds)}" if chunked.fits
                    else f"does not fit either: {chunked.reason}"
                )  # fmt: skip
            return text
        if not self.checkpoint and self.offload is None and not self.offload_optimizer and not self.tile:
            return f"Fits {format_bytes(self.budget_bytes)} without lightmem ({self.reason})."
        prices = self.speeds.describe() if self.speeds is not None else (
            f"host link {format_rate(self.link_bytes_per_s, 'B/s')}, {format_rate(self.flops_per_s, 'FLOP/s')}"
        )
        fitted = [option for option in self.alternatives if option.fits]
        refused = [option for option in self.alternatives if not option.fits]
        why = (
            f"the least predicted step time of the {len(fitted) + 1} configurations verified to fit"
            if fitted
            else "the only configuration verified to fit"
        )
        at = format_bytes(self.predicted_total_bytes)
        if self.routing_bound_bytes:
            balanced = max(self.predicted_reserved_bytes, self.predicted_peak_bytes) + self.overhead_bytes
            at += (
                f" under the worst-case routing of its experts ({format_bytes(balanced)} under balanced routing, "
                "which the step time assumes)"
            )
        lines = [
            f"Fits {format_bytes(self.budget_bytes)} at {at}: "
            + "; ".join(self.parts())
            + (f", holding {self.host.describe()} of host memory" if self.host_total_bytes else "")
            + f"; predicted step {format_seconds(self.step_seconds)}, {self.slowdown:.2f}x the "
            f"{format_seconds(self.baseline_step_seconds)} without lightmem (about {format_seconds(self.recompute_s)} "
            f"re-computation and {format_seconds(self.exposed_transfer_s)} exposed transfer; {prices}): {why}."
        ]
        lines.extend(
            f"  also fits: {option.description}, {format_bytes(option.predicted_total_bytes)}, step "
            f"{format_seconds(option.step_seconds)}"
            for option in fitted
        )
        lines.extend(
            f"  does not fit: {option.description}, {format_bytes(option.predicted_total_bytes)}"
            for option in refused
        )
        return "\n".join(lines)


    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        if not self.fits:
            return f"Plan(does not fit {format_bytes(self.budget_bytes)}: {shortened(self.reason)})"
        return (
            f"Plan(fits {format_bytes(self.budget_bytes)} at {format_bytes(self.predicted_total_bytes)}: "
            f"{shortened('; '.join(self.parts()) or 'nothing')}; step {format_seconds(self.step_seconds)}, "
            f"{self.slowdown:.2f}x)"
        )
