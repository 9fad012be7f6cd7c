"""Host memory in a plan: what a configuration holds on the host, and what it may hold.

A plan that offloads holds host memory as surely as it saves device memory: the host pool that
takes offloaded activations (``lightmem.transfer.pool``: ``HEADROOM`` times the bytes its blocks
hold at once, plus one block, within the offload's ``host_budget``), and with model-state offload
the host copies of the parameters, gradients and optimizer state. At long context the first is the
larger: Llama-3.1-8B's checkpointed layer inputs at 500K tokens are 131 GB. The planner counts both
for every verified configuration and takes one only when they fit the host limit: ``host_budget``
when given, else the available RAM of the machine the plan is for when that is this machine (a CPU
plan, or a CUDA plan made where CUDA is), else none (a plan for a GPU this machine lacks, made on a
laptop: pass ``host_budget``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightmem.config import available_ram_bytes, format_bytes, parse_size
from lightmem.transfer.pool import bound_bytes

THIS_MACHINE = "this machine's available RAM"


@dataclass(frozen=True)
class HostBytes:
    """What one configuration's step holds on the host."""

    activations: int = 0
    """Offloaded activations' blocks held at once (``StepTrace.host_bytes``)."""
    pool: int = 0
    """What the host pool holds for them: its bound (``bound_bytes``) and one block, within the
    offload's ``host_budget``."""
    model_state: int = 0
    """Model-state offload's host copies: parameters, gradients, optimizer state."""

    @property
    def total(self) -> int:
        return self.pool + self.model_state

    def describe(self) -> str:
        parts = [f"the activations' pool {format_bytes(self.pool)}"] if self.pool else []
        if self.model_state:
            parts.append(f"model state {format_bytes(self.model_state)}")
        return f"{format_bytes(self.total)}" + (f" ({', '.join(parts)})" if parts else "")


def host_bytes(activations: int, largest: int, model_state: int, budget_bytes: int | None) -> HostBytes:
    """The host memory of a step whose offload holds ``activations`` at most (its largest block
    ``largest``) under an offload ``host_budget`` of ``budget_bytes`` (None: none), with
    ``model_state`` bytes of model state on the host."""
    pool = bound_bytes(activations) + largest if activations else 0
    if budget_bytes is not None:
        pool = min(pool, budget_bytes)
    return HostBytes(activations, pool, model_state)


@dataclass(frozen=True)
class HostLimit:
    """The host memory a plan may hold, and where the figure comes from."""

    bytes: int | None
    """None: no limit known (a plan for a machine that is not this one, without ``host_budget``)."""
    source: str = ""

    def admits(self, needed: HostBytes) -> bool:
        return self.bytes is None or needed.total <= self.bytes

    def refusal(self, needed: HostBytes) -> str:
        """Why a configuration needing ``needed`` is refused, with the figures."""
        return f"it holds {needed.describe()} of host memory, over the {format_bytes(self.bytes or 0)} of {self.source}"


def host_limit(host_budget: int | float | str | None, device: str, *, flag: str) -> HostLimit:
    """``host_budget`` (bytes, a size string, or a fraction of this machine's available RAM), or
    without it this machine's available RAM when the plan is for this machine (``device`` "cpu",
    or "cuda" where CUDA is), else no limit (module docstring)."""
    if host_budget is not None:
        return HostLimit(parse_size(host_budget, flag=flag, fraction_of=available_ram_bytes), "the host budget")
    if device == "cpu" or torch.cuda.is_available():
        return HostLimit(available_ram_bytes(), THIS_MACHINE)
    return HostLimit(None)
