"""Sequence tiling on the CPU: a Llama MLP (SwiGLU) plain and tiled, time per token and peak memory.

    python benchmarks/tiling.py                 # d=256, 4x wide, 8192 positions; about a minute on 2 cores
    python benchmarks/tiling.py --seq 2048 --rounds 3   # quicker

Time: one training step of the MLP alone (forward, backward; no optimizer step), on one intra-op
thread, timed by the thread's CPU time (a shared machine's waits do not count), variants timed
round-robin so drift hits all alike; per token: the step over its positions; min and median over
``--rounds`` rounds. A tiled step runs the MLP's forward twice (forward, and again in backward).

Peak: a full steady step (forward, backward, AdamW) measured by MemTracker
(``lightmem.testing.measure``), beside what ``estimate_memory(tile=...)`` predicts for it. Predicted time:
the forward and backward the estimate prices (at the CPU table's prices, a generic server CPU, not this
machine's), with what tiling adds as the planner prices it (the module's second forward).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware, interleaved_times_s, one_thread, print_table

from lightmem import apply_tiling, estimate_memory
from lightmem.config import format_bytes
from lightmem.testing.measure import measure_cpu_step


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): Llama's MLP, without biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    plain = LlamaMLP(args.dim, args.hidden)
    x = torch.randn(args.batch, args.seq, args.dim)
    tokens = args.batch * args.seq

    variants: dict[str, tuple[nn.Module, int | None]] = {"plain": (plain, None)}
    for tile_tokens in dict.fromkeys((args.dim, 4 * args.dim, args.seq // 2)):
        tiled = copy.deepcopy(plain)
        apply_tiling(tiled, "LlamaMLP", tile_tokens=tile_tokens)
        variants[f"tiled, shards of {tile_tokens}"] = (tiled, tile_tokens)

    def step_of(model: nn.Module):
        leaf = x.clone().requires_grad_(True)

        def step() -> None:
            loss(model, leaf).backward()
            model.zero_grad(set_to_none=True)
            leaf.grad = None

        return step

    with one_thread():
        times = interleaved_times_s({name: step_of(model) for name, (model, _) in variants.items()}, args.rounds)
        rows = []
        plain_median = statistics.median(times["plain"])
        for name, (model, tile_tokens) in variants.items():
            tile = {} if tile_tokens is None else {"tile": ["LlamaMLP"], "tile_tokens": tile_tokens}
            predicted = estimate_memory(plain, x, loss, device="cpu", optimizer="adamw", **tile)
            real = copy.deepcopy(model)  # MemTracker steps it twice
            measured = measure_cpu_step(real, x, loss, optimizer="adamw")
            scenario = predicted.scenarios["tile" if tile_tokens is not None else "baseline"]
            median = statistics.median(times[name])
            # The prediction of what is timed (forward and backward): the blocks' compute, and what
            # tiling adds to the step (its second forward, priced as the planner prices it).
            compute = sum(block.forward_s + block.backward_s for block in predicted.blocks.values())
            added = scenario.step_seconds - predicted.scenarios["baseline"].step_seconds
            rows.append([
                name, str(-(-args.seq // tile_tokens) if tile_tokens else 1),
                f"{1e6 * min(times[name]) / tokens:.2f}", f"{1e6 * median / tokens:.2f}", f"{median / plain_median:.2f}x",
                f"{1e6 * (compute + added) / tokens:.2f}", f"{(compute + added) / compute:.2f}x",
                format_bytes(measured.peak_bytes), format_bytes(scenario.peak_bytes),
            ])  # fmt: skip
        print_table(
            f"Llama MLP d={args.dim}, hidden {args.hidden}, {args.batch} x {args.seq} positions, fp32; "
            f"{args.rounds} rounds; {hardware()}; predicted at the CPU table's prices (a generic server CPU)",
            ["variant", "shards", "us/token min", "us/token median", "vs plain", "us/token predicted",
             "vs plain predicted", "peak measured", "peak predicted"],
            rows,
        )  # fmt: skip


if __name__ == "__main__":
    main()
