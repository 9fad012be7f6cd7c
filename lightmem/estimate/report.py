"""What the estimator returns: figures per configuration, per block, the advice, and two renderings.

``MemoryEstimate`` is plain data. ``render()`` gives the table a person reads (``rich``);
``to_dict()`` gives the same figures to programs (JSON-ready: ints, floats, strings, lists).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from lightmem.config import format_bytes
from lightmem.estimate.tracer import CATEGORIES

NOT_MODELLED = (
    "the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers (covered by the overhead allowance)",
    "allocator fragmentation and cached-but-free blocks (reserved minus allocated memory)",
    "memory a kernel allocates and frees inside itself (e.g. convolution algorithm workspaces)",
    "GradScaler's unscale and gradient clipping temporaries; LR schedulers; logging",
)
CUDA_NOTES = (
    (
        "CUDA figures come from a CPU trace corrected for CUDA (autocast policy, fused dropout and "
        "attention, foreach optimizers, 512-byte allocation rounding); cuDNN RNN reserve space is "
        "approximated by oneDNN's workspace; no figure here was measured on a GPU"
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
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "peak": {"phase": self.peak_phase, "op": self.peak_op, "block": self.peak_block},
            "activations_at_forward_end_bytes": self.activations_at_forward_end,
            "checkpointed": list(self.checkpointed),
            "offloaded_bytes": self.offloaded_bytes,
            "host_bytes": self.host_bytes,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Advice:
    """One finding: ``rule`` is a stable identifier, ``message`` what to do about it."""

    rule: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message}


@dataclass
class MemoryEstimate:
    """Predicted memory of one steady-state training step.

    The top-level figures are those of the configuration asked for (baseline when neither
    ``offload`` nor ``checkpoint`` was given); ``scenarios`` holds every configuration that was
    run, always including "baseline", so the effect of each lightmem flag can be read off.
    ``breakdown`` has exactly the keys parameters, gradients, optimizer_state, activations and
    temporaries, summing to ``peak_bytes``. ``overhead_bytes`` is the allowance for what is not
    modelled and is never part of the breakdown; ``total_bytes`` = peak + overhead.
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
    inputs_bytes: int = 0
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool | None:
        """Whether peak + overhead fit the budget (None without a budget)."""
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

    @property
    def available_bytes(self) -> int | None:
        """What the budget leaves for the step after the overhead allowance (None without one)."""
        return None if self.budget_bytes is None else self.budget_bytes - self.overhead_bytes

    @property
    def baseline_fits(self) -> bool | None:
        """Whether the step without lightmem fits the budget (None without a budget)."""
        available = self.available_bytes
        return None if available is None else self.scenarios["baseline"].peak_bytes <= available

    @property
    def static_exceeds_budget(self) -> bool:
        """Parameters, gradients and optimizer state leave no room for activations: no activation
        technique can make the step fit. The one test the advice and the planner both use."""
        available = self.available_bytes
        return available is not None and self.static_bytes >= available

    @property
    def static_bytes(self) -> int:
        """Parameters + gradients + optimizer state: what no activation technique reduces."""
        baseline = self.scenarios["baseline"].breakdown
        return baseline["parameters"] + baseline["gradients"] + baseline["optimizer_state"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "peak": {"phase": self.peak_phase, "op": self.peak_op, "block": self.peak_block},
            "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "device": self.device,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "parameter_count": self.parameter_count,
            "inputs_bytes": self.inputs_bytes,
            "blocks": {
                name: {
                    "saved_bytes": block.saved_bytes,
                    "forward_flops": block.forward_flops,
                    "input_bytes": block.input_bytes,
                    "class": block.kind,
                    "repeated": block.repeated,
                }
                for name, block in self.blocks.items()
            },
            "scenarios": {name: scenario.to_dict() for name, scenario in self.scenarios.items()},
            "advice": [item.to_dict() for item in self.advice],
            "not_modelled": list(self.not_modelled),
            "seconds": round(self.seconds, 3),
        }

    def render(self, *, max_blocks: int = 12) -> Group:
        """The report as ``rich`` renderables: breakdown per configuration, blocks, advice."""
        title = (
            f"Estimated step memory on {self.device} ({self.precision}, {self.optimizer}, "
            f"batch {self.batch_size}, {self.parameter_count / 1e6:,.1f}M parameters)"
        )
        table = Table(title=title, title_justify="left")
        table.add_column("")
        for name in self.scenarios:
            table.add_column(name, justify="right")
        for category in CATEGORIES:
            table.add_row(
                category.replace("_", " "),
                *(format_bytes(s.breakdown[category]) for s in self.scenarios.values()),
            )
        table.add_section()
        table.add_row(
            Text("peak", style="bold"),
            *(Text(format_bytes(s.peak_bytes), style="bold") for s in self.scenarios.values()),
        )
        table.add_row("overhead", *(format_bytes(self.overhead_bytes) for _ in self.scenarios))
        totals = [s.peak_bytes + self.overhead_bytes for s in self.scenarios.values()]
        table.add_row(Text("total", style="bold"), *(Text(format_bytes(t), style="bold") for t in totals))
        if self.budget_bytes is not None:
            table.add_row(
                f"fits {format_bytes(self.budget_bytes)}?",
                *(
                    Text("yes", style="green") if t <= self.budget_bytes else Text("no", style="red")
                    for t in totals
                ),
            )
        table.add_row(
            "peak in",
            *(
                f"{s.peak_phase}: {s.peak_op}" + (f" ({s.peak_block})" if s.peak_block else "")
                for s in self.scenarios.values()
            ),
        )
        if any(s.offloaded_bytes for s in self.scenarios.values()):
            table.add_row(
                "host memory (offload)", *(format_bytes(s.host_bytes) for s in self.scenarios.values())
            )

        blocks = Table(title="Saved activations per block (end of forward, baseline)", title_justify="left")
        blocks.add_column("block")
        blocks.add_column("saved", justify="right")
        blocks.add_column("share", justify="right")
        blocks.add_column("forward GFLOP", justify="right")
        total_saved = sum(block.saved_bytes for block in self.blocks.values()) or 1
        ranked = sorted(self.blocks.values(), key=lambda block: block.saved_bytes, reverse=True)
        for block in ranked[:max_blocks]:
            blocks.add_row(
                block.label, format_bytes(block.saved_bytes), f"{100 * block.saved_bytes / total_saved:.1f}%",
                f"{block.forward_flops / 1e9:,.2f}",
            )  # fmt: skip
        if len(ranked) > max_blocks:
            rest = ranked[max_blocks:]
            blocks.add_row(f"... {len(rest)} more", format_bytes(sum(b.saved_bytes for b in rest)), "", "")

        lines: list[Any] = [table, blocks]
        if self.advice:
            lines.append(Text("Advice", style="bold"))
            for item in self.advice:
                lines.append(Text(f"- [{item.rule}] {item.message}"))
        lines.append(Text("Not modelled: " + "; ".join(self.not_modelled) + ".", style="dim"))
        return Group(*lines)

    def to_text(self, *, width: int = 100) -> str:
        """The rendered report as plain text."""
        buffer = io.StringIO()
        console = Console(file=buffer, width=width, record=False, color_system=None, force_terminal=False)
        console.print(self.render())
        return buffer.getvalue()

    def print(self, console: Console | None = None) -> None:
        (console or Console()).print(self.render())

    def __str__(self) -> str:
        return self.to_text()
