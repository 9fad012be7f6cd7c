"""What the estimator returns: figures per configuration, per block, the advice, and two renderings.

``MemoryEstimate`` is plain data. ``to_text()`` gives the tables a person reads (``render()``: the
same with ``rich``, when installed);
``to_dict()`` gives the same figures to programs (JSON-ready: ints, floats, strings, lists).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from lightmem.config import format_bytes
from lightmem.estimate.trace.blocks import BlockMemory
from lightmem.estimate.trace.position_wise import tile_candidates
from lightmem.estimate.trace.records import CATEGORIES, held_bytes, reserved_or_peak
from lightmem.estimate.words import format_seconds
from lightmem.tables import format_table

NOT_MODELLED = (
    "the CUDA context and NCCL buffers, which the caching allocator does not count (covered by the "
    "overhead allowance); cuDNN workspaces",
    "the allocator's cache beyond what a step under a cap needs (reserved memory is replayed through the "
    "caching allocator on the compute stream only; blocks held for copies on other streams are not)",
    "memory a kernel allocates and frees inside itself (e.g. convolution algorithm workspaces)",
    "GradScaler's unscale and gradient clipping temporaries; LR schedulers; logging",
)
COMPILED_NOTE = (
    "torch.compile: these figures are eager execution's. A compiled graph hands its saved tensors to "
    "offload only when it has run; LightMem compiles a model captured whole one block at a time, so the "
    "offload figures hold within one block's saved bytes (compile each block yourself in a plain loop). "
    "Compiled graphs may save fewer bytes than eager (measured on CPU: 10% fewer on a GPT, 31% on GPT-2), "
    "so activations here are an upper bound."
)
CUDA_NOTES = (
    (
        "CUDA figures come from a CPU trace corrected for CUDA (autocast policy, fused dropout and "
        "attention, foreach optimizers, the caching allocator's block sizes for new segments, one "
        "cuBLAS workspace per matmul thread); a cached block reused whole can hold up to 1 MiB "
        "more than asked; cuDNN RNN reserve space is approximated by oneDNN's workspace; no "
        "figure here was measured on a GPU"
    ),
)


@dataclass
class StepMemory:
    """The peak of one configuration (baseline, checkpoint, offload, or both)."""

    name: str
    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    peak_op: str
    peak_block: str | None
    activations_at_forward_end: int
    checkpointed: list[str] = field(default_factory=list)
    offloaded_bytes: int = 0
    host_bytes: int = 0
    model_state_link_bytes: int = 0
    """With model-state offload: bytes over the host link per step, gradients out and parameters
    back, in the device's dtype (halved by ``device_dtype="bf16"``); 0 without it."""
    seconds: float = 0.0
    step_seconds: float = 0.0
    """The predicted time of one step in this configuration on the estimate's device
    (``lightmem.estimate.pricing.timeline``): compute, re-runs and transfer not hidden by compute."""
    reserve: Any = field(default=None, repr=False, compare=False)
    """What the allocator must be able to reserve for the step (``StepTrace.reserve``, worked out
    when first asked); None: the peak."""
    tiled: list[str] = field(default_factory=list)
    """Modules run in sequence shards (``estimate_memory(tile=...)``)."""
    routing_bound: Any = field(default=None, repr=False, compare=False)
    """For a step whose sizes follow a mixture-of-experts routing: the step under the worst-case
    routing (``lightmem.estimate.trace.step.RoutingBound``), the bound a budget must hold; None otherwise."""

    @property
    def predicted_reserved(self) -> int:
        """The reserved peak under the estimate's assumptions (balanced routing); the allocated peak
        where nothing was replayed."""
        return reserved_or_peak(self.reserve, self.peak_bytes)

    @property
    def reserved(self) -> int:
        """The reserved peak a budget must hold: ``predicted_reserved``, or the worst-case routing's
        where the step routes (``routing_bound``) and it is higher."""
        return held_bytes(self.predicted_reserved, self.routing_bound)

    @property
    def routing_bound_bytes(self) -> int | None:
        """The allocated peak under the worst-case routing (None: the step routes nothing)."""
        return None if self.routing_bound is None else self.routing_bound.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        bound = self.routing_bound
        return {
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.predicted_reserved,
            "routing_bound_bytes": self.routing_bound_bytes,
            "routing_bound_reserved_bytes": None if bound is None else bound.reserved_bytes,
            "step_seconds": self.step_seconds,
            "breakdown": dict(self.breakdown),
            "peak": {"phase": self.peak_phase, "op": self.peak_op, "block": self.peak_block},
            "activations_at_forward_end_bytes": self.activations_at_forward_end,
            "checkpointed": list(self.checkpointed),
            "tiled": list(self.tiled),
            "offloaded_bytes": self.offloaded_bytes,
            "host_bytes": self.host_bytes,
            "model_state_link_bytes": self.model_state_link_bytes,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Advice:
    """One finding: ``rule`` is a stable identifier, ``message`` what to do about it."""

    rule: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message}


ROUTING_NOTE = (
    "Mixture-of-experts routing: the figures assume balanced routing (each expert gets tokens x top-k / "
    "experts); the worst-case row assumes the first top-k experts get every token and each other expert one "
    "(a bound on the transient peak, which a plan keeps within the budget). The activations saved across "
    "all experts are the same under both."
)
"""What ``MemoryEstimate.routing_bound_bytes`` and the balanced figures each assume, in one place."""
STAND_IN_NOTE = (
    "The step reads values fake tensors do not have; the dry run stood in for them (a branch it took on a "
    "stood-in value, or a size read from one, may differ in a real step):"
)


@dataclass
class MemoryEstimate:
    """Predicted memory of one steady-state training step.

    The top-level figures are those of the configuration asked for (baseline when neither
    ``offload`` nor ``checkpoint`` was given); ``scenarios`` holds every configuration that was
    run, always including "baseline", so the effect of each lightmem flag can be read off.
    ``breakdown`` has exactly the keys parameters, gradients, optimizer_state, activations,
    temporaries and workspaces (cuBLAS, CUDA only), summing to ``peak_bytes``: on CUDA the
    prediction of ``torch.cuda.max_memory_allocated``. ``overhead_bytes`` is the allowance for what
    the caching allocator does not count (CUDA context, NCCL) and is never part of the breakdown.
    ``reserved_bytes`` is what the caching allocator must be able to reserve for the step (its
    requests replayed through it: ``lightmem.estimate.device.caching_allocator``; the peak itself on the
    CPU), and
    ``total_bytes`` = reserved + overhead: what must fit the budget. A step whose sizes follow a
    mixture-of-experts routing is predicted under balanced routing and bounded under the worst case
    (``routing_bound_bytes``, ``routing_assumptions``): then the bound + overhead must fit (``fits``).
    """

    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    peak_op: str
    peak_block: str | None
    overhead_bytes: int
    budget_bytes: int | None
    device: str
    precision: str
    optimizer: str
    batch_size: int | None
    parameter_count: int
    blocks: dict[str, BlockMemory]
    scenarios: dict[str, StepMemory]
    advice: list[Advice] = field(default_factory=list)
    not_modelled: list[str] = field(default_factory=list)
    stand_ins: list[str] = field(default_factory=list)
    """Values the step read that fake tensors do not have, each with what stood in for it and where
    (``lightmem.estimate.trace.values``): a figure that depends on one holds as far as the stand-in does."""
    inputs_bytes: int = 0
    seconds: float = 0.0
    offload_optimizer: bool = False
    """Model-state offload was asked for: gradients and optimizer state are not the device's."""
    offload_optimizer_device_dtype: str | None = None
    """With model-state offload's ``device_dtype``: the trainable parameters' dtype on the device
    ("bf16"), in which the scenarios with it count parameters, gradients and link bytes."""
    compiled: bool = False
    """The model holds compiled modules: the report says how far its eager figures hold."""
    step_seconds: float = 0.0
    """The predicted time of one step of the configuration asked for (``scenarios[name].step_seconds``
    for each one), at ``speeds``."""
    speeds: Any = None
    """The ``DeviceSpeeds`` every op and transfer was priced at (``lightmem.devices``)."""
    expandable_segments: bool = False
    """The CUDA allocator's steps were replayed with expandable segments."""
    reserve: Any = field(default=None, repr=False, compare=False)
    """What the allocator must be able to reserve for the configuration asked for (``StepTrace.reserve``;
    None: the peak)."""
    op_seconds: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Where the baseline step's priced device time goes: seconds and calls per ``aten`` op (a
    profiler's per-op table sits beside it: ``benchmarks/op_prices.py``)."""
    loss_logits: Any = None
    """The baseline step's loss logits and what a chunked loss would leave
    (``lightmem.estimate.trace.logits.LossLogits``); None: no cross-entropy over a linear layer's output."""
    chunked_loss: Any = None
    """With a budget, where the logits dominate the peak: the largest batch without lightmem, as
    written and with the loss chunked (``lightmem.estimate.chunked_loss.ChunkedLossReach``)."""
    routing_bound: Any = field(default=None, repr=False, compare=False)
    """The configuration asked for under the worst-case routing (``StepMemory.routing_bound``); None:
    the step routes nothing."""
    sequence_length: int | None = None
    """The batch's sequence length the step ran at, when it was grown to one (``plan(sequence_length=...)``)."""
    modules: dict[str, Any] = field(default_factory=dict, repr=False)
    """Each module the baseline called with one tensor (``lightmem.estimate.trace.position_wise.ModuleForward``):
    its forward's price, what it saved, and whether it is position-wise (``why_not`` says why not)."""

    @property
    def tile_candidates(self) -> list[str]:
        """The modules a plan may tile, read from the trace (``position_wise.tile_candidates``): the
        outermost position-wise modules that keep more than their input, not the repeated blocks."""
        return list(tile_candidates(self.modules, self.blocks))

    @property
    def reserved_bytes(self) -> int:
        return reserved_or_peak(self.reserve, self.peak_bytes)

    @property
    def total_bytes(self) -> int:
        return self.reserved_bytes + self.overhead_bytes

    @property
    def routing_bound_bytes(self) -> int | None:
        """For a mixture-of-experts step: the allocated peak under the worst-case routing (the first
        top-k experts get every token, each other expert one), where ``peak_bytes`` assumes balanced
        routing; None when the step routes nothing."""
        bound = self.routing_bound
        return None if bound is None else bound.peak_bytes

    @property
    def routing_bound_reserved_bytes(self) -> int | None:
        """What the allocator must reserve under the worst-case routing (the CPU: its peak), or None."""
        bound = self.routing_bound
        return None if bound is None else bound.reserved_bytes

    @property
    def routing_assumptions(self) -> str | None:
        """What the balanced figures and the worst-case bound each assume (None: the step routes nothing)."""
        routed = any(scenario.routing_bound is not None for scenario in self.scenarios.values())
        return ROUTING_NOTE if routed else None

    @property
    def fits(self) -> bool | None:
        """Whether the reserved peak + overhead fit the budget, the worst-case routing's too for a
        mixture-of-experts step (None without a budget)."""
        if self.budget_bytes is None:
            return None
        return held_bytes(self.reserved_bytes, self.routing_bound) + self.overhead_bytes <= self.budget_bytes

    @property
    def available_bytes(self) -> int | None:
        """What the budget leaves for the step after the overhead allowance (None without one)."""
        return None if self.budget_bytes is None else self.budget_bytes - self.overhead_bytes

    @property
    def baseline_fits(self) -> bool | None:
        """Whether the step without lightmem fits the budget (None without a budget)."""
        available = self.available_bytes
        baseline = self.scenarios["baseline"]
        return None if available is None else baseline.reserved <= available

    @property
    def static_exceeds_budget(self) -> bool:
        """Parameters, gradients and optimizer state leave no room for activations: no activation
        technique can make the step fit. The one test the advice and the planner both use."""
        available = self.available_bytes
        return available is not None and self.static_bytes >= available

    @property
    def static_bytes(self) -> int:
        """Parameters + gradients + optimizer state + cuBLAS workspaces: what no activation
        technique reduces (with ``offload_optimizer``: the parameters and workspaces alone, the
        parameters as that step holds them: in bf16 with its ``device_dtype``)."""
        return sum(size for _, size in self._static_items())

    def static_parts(self) -> str:
        """What ``static_bytes`` holds, each part as the breakdown gives it: "parameters (677.00 KiB),
        gradients (0 B), optimizer state (1.32 MiB) and cuBLAS workspaces (64.00 MiB)"."""
        parts = [(name, size) for name, size in self._static_items() if size or name != "cuBLAS workspaces"]
        named = [f"{name} ({format_bytes(size)})" for name, size in parts]
        return " and ".join(filter(None, [", ".join(named[:-1]), named[-1]]))

    def _static_items(self) -> list[tuple[str, int]]:
        """``static_bytes``'s parts, named."""
        baseline = self.scenarios["baseline"].breakdown
        if self.offload_optimizer:
            model_state = self.scenarios.get("offload_optimizer", self.scenarios["baseline"]).breakdown
            dtype = self.offload_optimizer_device_dtype
            parts = [(f"the {dtype} parameters" if dtype else "the parameters", model_state["parameters"])]
        else:
            parts = [(name.replace("_", " "), baseline[name]) for name in ("parameters", "gradients", "optimizer_state")]
        return [*parts, ("cuBLAS workspaces", baseline["workspaces"])]

    @property
    def budget_below_overhead(self) -> bool:
        """The budget is no larger than the overhead allowance it must hold: nothing is left for the step."""
        return self.budget_bytes is not None and self.budget_bytes <= self.overhead_bytes

    def overhead_shortfall(self) -> str:
        """What ``budget_below_overhead`` means, in words."""
        assert self.budget_bytes is not None
        overhead = format_bytes(self.overhead_bytes)
        return (
            f"the {format_bytes(self.budget_bytes)} budget is no larger than the {overhead} overhead allowance it "
            f"must also hold (the CUDA context and what the caching allocator does not count), so nothing is left "
            f"for the step: give a budget above {overhead}, or a smaller allowance (overhead_bytes=..., --overhead)"
        )

    @property
    def parameters_fit(self) -> bool:
        """The parameters alone (with the cuBLAS workspaces, which stay on the device too) leave
        room in the budget of a device that is not the host: there model-state offload
        (``offload_optimizer``) can make the step fit."""
        available = self.available_bytes
        baseline = self.scenarios["baseline"].breakdown
        on_device = baseline["parameters"] + baseline["workspaces"]
        return self.device != "cpu" and available is not None and on_device < available

    @property
    def block_kinds(self) -> dict[str, str]:
        """Each repeated block's class name, by block name (how plans and advice name runs of blocks)."""
        return {name: block.kind for name, block in self.blocks.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "step_seconds": self.step_seconds,
            "speeds": self.speeds.to_dict() if self.speeds is not None else None,
            "breakdown": dict(self.breakdown),
            "peak": {"phase": self.peak_phase, "op": self.peak_op, "block": self.peak_block},
            "overhead_bytes": self.overhead_bytes,
            "reserved_bytes": self.reserved_bytes,
            "total_bytes": self.total_bytes,
            "routing_bound_bytes": self.routing_bound_bytes,
            "routing_bound_reserved_bytes": self.routing_bound_reserved_bytes,
            "routing_assumptions": self.routing_assumptions,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "device": self.device,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "parameter_count": self.parameter_count,
            "inputs_bytes": self.inputs_bytes,
            "offload_optimizer": self.offload_optimizer,
            "offload_optimizer_device_dtype": self.offload_optimizer_device_dtype,
            "blocks": {
                name: {
                    "saved_bytes": block.saved_bytes,
                    "forward_flops": block.forward_flops,
                    "input_bytes": block.input_bytes,
                    "forward_seconds": block.forward_s,
                    "backward_seconds": block.backward_s,
                    "class": block.kind,
                    "repeated": block.repeated,
                }
                for name, block in self.blocks.items()
            },
            "scenarios": {name: scenario.to_dict() for name, scenario in self.scenarios.items()},
            "advice": [item.to_dict() for item in self.advice],
            "not_modelled": list(self.not_modelled),
            "stand_ins": list(self.stand_ins),
            "compiled": self.compiled,
            "seconds": round(self.seconds, 3),
            "chunked_loss": self.chunked_loss.to_dict() if self.chunked_loss is not None else None,
        }

    def _tables(self, max_blocks: int) -> list[tuple[str, list[str], list[list[str]]]]:
        """(title, headers, rows) of the two tables: breakdown per configuration, blocks."""
        title = (
            f"Estimated step memory on {self.device} ({self.precision}, {self.optimizer}, "
            f"batch {self.batch_size}, {self.parameter_count / 1e6:,.1f}M parameters)"
        )
        if self.offload_optimizer_device_dtype is not None:
            title += (
                f"; with offload_optimizer: {self.offload_optimizer_device_dtype} parameters and gradients "
                "on the device, fp32 masters on the host"
            )
        scenarios = list(self.scenarios.values())
        rows = [
            [category.replace("_", " "), *(format_bytes(s.breakdown[category]) for s in scenarios)]
            for category in CATEGORIES
            if category != "workspaces" or any(s.breakdown[category] for s in scenarios)
        ]
        reserved = [s.predicted_reserved for s in scenarios]
        totals = [r + self.overhead_bytes for r in reserved]
        rows.append(["peak", *(format_bytes(s.peak_bytes) for s in scenarios)])
        if any(r != s.peak_bytes for r, s in zip(reserved, scenarios)):
            rows.append(["reserved (allocator)", *(format_bytes(r) for r in reserved)])
        rows.append(["overhead", *(format_bytes(self.overhead_bytes) for _ in scenarios)])
        rows.append(["total", *(format_bytes(t) for t in totals)])
        if any(s.routing_bound is not None for s in scenarios):
            rows.append([
                "total, worst-case routing",
                *(format_bytes(s.reserved + self.overhead_bytes) if s.routing_bound is not None else "-" for s in scenarios),
            ])  # fmt: skip
        if self.budget_bytes is not None:
            fits = ("yes" if s.reserved + self.overhead_bytes <= self.budget_bytes else "no" for s in scenarios)
            rows.append([f"fits {format_bytes(self.budget_bytes)}?", *fits])
        where = (
            f"{s.peak_phase}: {s.peak_op}" + (f" ({s.peak_block})" if s.peak_block else "") for s in scenarios
        )
        rows.append(["peak in", *where])
        if any(s.offloaded_bytes or s.host_bytes for s in scenarios):
            rows.append(["host memory (offload)", *(format_bytes(s.host_bytes) for s in scenarios)])
        if any(s.model_state_link_bytes for s in scenarios):
            rows.append(["model state over the link per step", *(format_bytes(s.model_state_link_bytes) for s in scenarios)])
        if any(s.step_seconds for s in scenarios):
            rows.append(["step (predicted)", *(format_seconds(s.step_seconds) for s in scenarios)])

        total_saved = sum(block.saved_bytes for block in self.blocks.values()) or 1
        ranked = sorted(self.blocks.values(), key=lambda block: block.saved_bytes, reverse=True)
        block_rows = [
            [block.label, format_bytes(block.saved_bytes), f"{100 * block.saved_bytes / total_saved:.1f}%",
             f"{block.forward_flops / 1e9:,.2f}"]
            for block in ranked[:max_blocks]
        ]  # fmt: skip
        if len(ranked) > max_blocks:
            rest = ranked[max_blocks:]
            rest_bytes = format_bytes(sum(block.saved_bytes for block in rest))
            block_rows.append([f"... {len(rest)} more", rest_bytes, "", ""])
        return [
            (title, ["", *self.scenarios], rows),
            (
                "Saved activations per block (end of forward, baseline)",
                ["block", "saved", "share", "forward GFLOP"],
                block_rows,
            ),
        ]

    @property
    def priced_ops(self) -> int:
        """Ops of the step without lightmem priced one by one (``op_seconds``' calls): what the host launches."""
        return sum(calls for _, calls in self.op_seconds.values())

    def host_wait(self) -> str | None:
        """A sentence when the step without lightmem waits on the host (its ops take the host
        longer to launch, ``DeviceSpeeds.host_seconds``, than the device to run); else None."""
        if self.speeds is None or self.device == "cpu" or not self.op_seconds:
            return None
        ops = self.priced_ops
        device = sum(seconds for seconds, _ in self.op_seconds.values())
        host = self.speeds.host_seconds(ops)
        if host <= device:
            return None
        return (
            f"The step waits on the host: it launches {ops:,} ops at {format_seconds(self.speeds.host_op_s)} each, "
            f"{format_seconds(host)}, where the device's work takes {format_seconds(device)}. A larger batch "
            "costs little more per step, and a checkpointed block's re-run costs the host its launches."
        )

    def _notes(self, verbose: bool) -> list[str]:
        lines = [COMPILED_NOTE] if self.compiled else []
        if self.routing_assumptions is not None:
            lines.append(self.routing_assumptions)
        if self.stand_ins:
            lines.append(f"{STAND_IN_NOTE} " + "; ".join(self.stand_ins) + ".")
        if self.speeds is not None and self.step_seconds:
            lines.append(f"Step times priced at {self.speeds.describe()}.")
            waits = self.host_wait()
            if waits is not None:
                lines.append(waits)
        if self.advice:
            lines.append("Advice")
            lines.extend(f"- [{item.rule}] {item.message}" for item in self.advice)
        if verbose:
            lines.append("Not modelled: " + "; ".join(self.not_modelled) + ".")
        elif self.not_modelled:
            lines.append(
                f"Not modelled: {len(self.not_modelled)} sources (CUDA context, fragmentation, ...); "
                "--verbose lists them."
            )
        return lines

    def to_text(self, *, width: int = 100, verbose: bool = False, max_blocks: int = 12) -> str:
        """The report as plain text (no ``rich`` needed); ``verbose`` spells out what is not modelled,
        wrapped at ``width`` columns."""
        parts = [
            format_table(rows, headers, title=title, align="l" + "r" * len(headers))
            for title, headers, rows in self._tables(max_blocks)
        ]
        notes = self._notes(verbose)
        wrapped = (
            textwrap.fill(line, width, subsequent_indent="  ") if len(line) > width else line for line in notes
        )
        parts.append("\n".join(wrapped))
        return "\n\n".join(parts) + "\n"

    def render(self, *, max_blocks: int = 12, verbose: bool = False) -> Any:
        """The report as ``rich`` renderables (``pip install "lightmem[rich]"``)."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        renderables: list[Any] = []
        for title, headers, rows in self._tables(max_blocks):
            table = Table(title=title, title_justify="left")
            for i, header in enumerate(headers):
                table.add_column(header, justify="left" if i == 0 else "right")
            for row in rows:
                if row[0] == "peak":
                    table.add_section()
                colours = {"yes": "green", "no": "red"}
                styled = [Text(cell, style=colours.get(cell, "")) for cell in row]
                if row[0] in ("peak", "total"):
                    styled = [Text(cell, style="bold") for cell in row]
                table.add_row(*styled)
            renderables.append(table)
        notes = self._notes(verbose)
        for line in notes:
            renderables.append(Text(line, style="dim" if line.startswith("Not modelled") else ""))
        return Group(*renderables)

    def print(self, *, verbose: bool = False) -> None:
        """Print the report: with ``rich`` when it is installed, as plain text otherwise."""
        try:
            from rich.console import Console
        except ImportError:
            print(self.to_text(verbose=verbose), end="")
            return
        Console().print(self.render(verbose=verbose))

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        batch = f", batch {self.batch_size}" if self.batch_size is not None else ""
        return (
            f"MemoryEstimate(peak {format_bytes(self.peak_bytes)}, reserved {format_bytes(self.reserved_bytes)} "
            f"on {self.device}, {self.precision}{batch}; print() for the table)"
        )


