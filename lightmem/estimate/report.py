"""What the estimator returns: figures per configuration, per block, the advice, and two renderings.

``MemoryEstimate`` is plain data. ``to_text()`` gives the tables a person reads (``render()``: the
same with ``rich``, when installed);
``to_dict()`` gives the same figures to programs (JSON-ready: ints, floats, strings, lists).
"""

from __future__ import annotations

import re
import textwrap
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import OffloadSettings, format_bytes
from lightmem.devices import format_rate
from lightmem.estimate.position_wise import tile_candidates
from lightmem.estimate.step import ROOT_BLOCK
from lightmem.estimate.tracer import CATEGORIES
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
class BlockMemory:
    """One block (a repeated layer, or a module around them): what autograd keeps of it at the
    end of forward, and its cost."""

    name: str
    saved_bytes: int
    forward_flops: float
    input_bytes: int
    saved_sizes: list[int] = field(default_factory=list, repr=False)
    kind: str = ""
    """The block's class name ("GPT2Block"); empty for what runs outside every block."""
    repeated: bool = False
    """One of the model's repeated layers: what the planner checkpoints."""
    kept_bytes: int = 0
    """Bytes of op outputs a checkpointed block keeps besides its input (op-level policies)."""
    recompute_flops: float | None = None
    """Forward FLOPs a checkpointed re-run repeats; None: all of ``forward_flops`` ("full")."""
    forward_s: float = 0.0
    """Predicted device seconds of its forward, priced op by op (0: not priced)."""
    backward_s: float = 0.0
    """Predicted device seconds of its backward."""
    recompute_s: float | None = None
    """Seconds a checkpointed re-run repeats; None: all of ``forward_s`` ("full")."""
    forward_ops: int = 0
    """Priced ops of its forward: what the host launches (0: not priced)."""
    backward_ops: int = 0
    """Priced ops of its backward."""
    recompute_ops: int | None = None
    """Priced ops a checkpointed re-run repeats; None: all of ``forward_ops`` ("full")."""

    @property
    def label(self) -> str:
        """``transformer.h.3 (GPT2Block)``."""
        return f"{self.name} ({self.kind})" if self.kind else self.name

    def offloadable_bytes(self, min_bytes: int) -> int:
        """Saved bytes in storages of at least ``min_bytes`` (what offload would move)."""
        return sum(size for size in self.saved_sizes if size >= min_bytes)


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
    (``lightmem.estimate.step_time``): compute, re-runs and transfer not hidden by compute."""
    reserve: Any = field(default=None, repr=False, compare=False)
    """What the allocator must be able to reserve for the step (``StepTrace.reserve``, worked out
    when first asked); None: the peak."""
    tiled: list[str] = field(default_factory=list)
    """Modules run in sequence shards (``estimate_memory(tile=...)``)."""

    @property
    def reserved(self) -> int:
        """The reserved peak a budget must hold (the allocated peak where nothing was replayed)."""
        return self.reserve.bytes if self.reserve is not None else self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved,
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
    requests replayed through it: ``lightmem.estimate.caching_allocator``; the peak itself on the
    CPU), and
    ``total_bytes`` = reserved + overhead: what must fit the budget.
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
    (``lightmem.estimate.values``): a figure that depends on one holds as far as the stand-in does."""
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
    (``lightmem.estimate.logits.LossLogits``); None: no cross-entropy over a linear layer's output."""
    chunked_loss: Any = None
    """With a budget, where the logits dominate the peak: the largest batch without lightmem, as
    written and with the loss chunked (``lightmem.estimate.chunked_loss.ChunkedLossReach``)."""
    sequence_length: int | None = None
    """The batch's sequence length the step ran at, when it was grown to one (``plan(sequence_length=...)``)."""
    modules: dict[str, Any] = field(default_factory=dict, repr=False)
    """Each module the baseline called with one tensor (``lightmem.estimate.position_wise.ModuleForward``):
    its forward's price, what it saved, and whether it is position-wise (``why_not`` says why not)."""

    @property
    def tile_candidates(self) -> list[str]:
        """The modules a plan may tile, read from the trace (``position_wise.tile_candidates``): the
        outermost position-wise modules that keep more than their input, not the repeated blocks."""
        return list(tile_candidates(self.modules, self.blocks))

    @property
    def reserved_bytes(self) -> int:
        return self.reserve.bytes if self.reserve is not None else self.peak_bytes

    @property
    def total_bytes(self) -> int:
        return self.reserved_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the reserved peak + overhead fit the budget (None without a budget)."""
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

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
        reserved = [s.reserved for s in scenarios]
        totals = [r + self.overhead_bytes for r in reserved]
        rows.append(["peak", *(format_bytes(s.peak_bytes) for s in scenarios)])
        if any(r != s.peak_bytes for r, s in zip(reserved, scenarios)):
            rows.append(["reserved (allocator)", *(format_bytes(r) for r in reserved)])
        rows.append(["overhead", *(format_bytes(self.overhead_bytes) for _ in scenarios)])
        rows.append(["total", *(format_bytes(t) for t in totals)])
        if self.budget_bytes is not None:
            fits = ("yes" if total <= self.budget_bytes else "no" for total in totals)
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
    ``predicted_reserved_bytes`` what the caching allocator reserves for it. ``step_seconds`` is
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
        """What must fit the budget: the reserved peak and the overhead allowance."""
        return max(self.predicted_reserved_bytes, self.predicted_peak_bytes) + self.overhead_bytes

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
        kinds = self.estimate_kinds
        parts = []
        if self.offload_optimizer:
            dtype = self.offload_optimizer_device_dtype
            on_device = f", {dtype} parameters on the device" if dtype is not None else ""
            parts.append(f"offload_optimizer (gradients and optimizer state on the host{on_device})")
        if self.tile:
            parts.append(f"tile {compact_modules(sorted(self.tile, key=natural_order), self.tile_kinds)}")
        if self.checkpoint:
            names = compact_names(sorted(self.checkpoint, key=natural_order), kinds)
            policy = "" if self.checkpoint_policy == "full" else f" (policy {policy_name(self.checkpoint_policy)})"
            parts.append(f"checkpoint {names}{policy}")
        if self.offload is not None and self.offload.include is None:
            parts.append(f"offload every saved tensor of at least {format_bytes(self.offload.min_bytes)}")
        elif self.offload is not None:
            own = dict(zip(self.offload.include or (), self.offload.include_min_bytes or ()))
            whole = [name for name in self.offload.include or () if not own.get(name)]
            if whole:
                names = compact_names(sorted(whole, key=natural_order), kinds)
                parts.append(f"offload {names} (min_bytes {format_bytes(self.offload.min_bytes)})")
            for threshold in sorted({size for size in own.values() if size}):
                names = compact_names(sorted((n for n, size in own.items() if size == threshold), key=natural_order), kinds)
                parts.append(f"offload the saved tensors of at least {format_bytes(threshold)} of {names}")
        return parts

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
        lines = [
            f"Fits {format_bytes(self.budget_bytes)} at {format_bytes(self.predicted_total_bytes)}: "
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


def format_seconds(seconds: float) -> str:
    """A predicted cost as people read it: '3.20 s', '41.0 ms', '12.5 us', '0 s'."""
    if seconds <= 0:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"


def policy_name(policy: CheckpointPolicyArg) -> str:
    """A policy as JSON and people read it: its name, or the callable's name."""
    return policy if isinstance(policy, str) else getattr(policy, "__qualname__", repr(policy))


def natural_order(name: str) -> list[object]:
    """Sort key for block names: "blocks.2" before "blocks.10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def compact_names(names: list[str], kinds: Mapping[str, str] | None = None) -> str:
    """'blocks.0', 'blocks.1', 'blocks.2', 'head' -> 'blocks.0-2, head'.

    With ``kinds`` (class name per block), each run is followed by its class:
    'transformer.h.0-7 (GPT2Block), lm_head (Linear)'.
    """
    kinds = kinds or {}
    groups: dict[str, list[int]] = defaultdict(list)
    order: list[str] = []
    for name in names:
        match = re.fullmatch(r"(.*\.)(\d+)", name)
        if match is None:
            order.append(name)
            continue
        prefix = match.group(1)
        if prefix not in groups:
            order.append(prefix)
        groups[prefix].append(int(match.group(2)))

    def labelled(text: str, members: list[str]) -> str:
        classes = {kinds[member] for member in members if kinds.get(member)}
        return f"{text} ({classes.pop()})" if len(classes) == 1 else text

    parts = []
    for key in order:
        if key not in groups:
            if key == ROOT_BLOCK:
                continue
            parts.append(labelled(key, [key]))
            continue
        numbers = sorted(groups[key])
        start = previous = numbers[0]
        runs = []
        for number in numbers[1:] + [None]:  # type: ignore[list-item]
            if number is not None and number == previous + 1:
                previous = number
                continue
            runs.append((start, previous))
            if number is not None:
                start = previous = number
        for first, last in runs:
            members = [f"{key}{n}" for n in range(first, last + 1)]
            text = f"{key}{first}" if first == last else f"{key}{first}-{last}"
            parts.append(labelled(text, members))
    return ", ".join(parts)


def compact_modules(names: list[str], kinds: Mapping[str, str] | None = None) -> str:
    """Modules inside repeated layers, by their first index: 'model.layers.0.mlp' ... 'model.layers.15.mlp',
    'model.norm' -> 'model.layers.0-15.mlp (LlamaMLP), model.norm (LlamaRMSNorm)' (with ``kinds``,
    the class name per module)."""
    kinds = kinds or {}
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    order: list[tuple[str, str]] = []
    for name in names:
        match = re.fullmatch(r"(.*?\.)(\d+)((?:\..*)?)", name)
        key = (match.group(1), match.group(3)) if match else (name, "")
        if key not in groups and key not in order:
            order.append(key)
        if match:
            groups[key].append(int(match.group(2)))
    parts = []
    for prefix, suffix in order:
        numbers = sorted(groups.get((prefix, suffix), []))
        if not numbers:
            parts.append(f"{prefix} ({kinds[prefix]})" if kinds.get(prefix) else prefix)
            continue
        runs, start = [], numbers[0]
        for previous, number in zip(numbers, [*numbers[1:], None]):
            if number is None or number != previous + 1:  # a run ends at previous
                runs.append((start, previous))
                start = number
        members = [f"{prefix}{n}{suffix}" for n in numbers]
        classes = {kinds[member] for member in members if kinds.get(member)}
        text = ", ".join(f"{prefix}{a}{suffix}" if a == b else f"{prefix}{a}-{b}{suffix}" for a, b in runs)
        parts.append(f"{text} ({classes.pop()})" if len(classes) == 1 else text)
    return ", ".join(parts)
