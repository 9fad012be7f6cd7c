"""lightmem under ``torch.compile``: saved-tensor residency, host time and packs per step.

    python benchmarks/compile.py                          # inductor, a GPT of 8 blocks
    python benchmarks/compile.py --backend aot_eager --steps 5

Side by side in one run: the model run eagerly, compiled whole, compiled whole and split at its
blocks (what ``offload_activations`` and ``LightMem`` do when given a model compiled whole; the
"compiled whole" rows pass them the uncompiled model, so they show what torch alone does), and
compiled one block at a time (torchtitan's way), each without lightmem and with offload,
checkpointing of every block, and both.

- saved peak: the most bytes of saved tensors on the device at once during the forward, as
  lightmem's hooks see them (``OffloadStats.peak_resident_bytes``, no prefetch): kept saves, and
  offloaded ones until their copy to host has run. Without offload a keep-everything context
  (``min_bytes`` above every tensor) measures the same figure: every save stays until backward.
- host ms/step: median CPU time of the calling thread for a training step (forward, backward, SGD
  step), torch on one intra-op thread (``time.thread_time``: a shared machine's other processes do
  not count), with the offload copies synchronous: without a GPU they are host memcpys, so the
  times say what the hooks and copies cost the host, not what a GPU overlaps.
- packs/step: saved tensors handed to the hooks per step.

Each variant compiles afresh (``torch._dynamo.reset()``), then runs ``--warmup`` steps before the
measured ones; compile time is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, gpt_loss, hardware, one_thread, print_table

from lightmem import apply_checkpointing, offload_activations
from lightmem.compile_blocks import repeated_blocks, split_at_blocks

MODES = ("eager", "compiled whole", "whole, split at blocks", "compiled per block")
CONFIGS = ("without lightmem", "offload", "checkpoint", "offload + checkpoint")
_KEEP_ALL = 2**62  # a min_bytes no tensor reaches: the context only counts


def _model(args: argparse.Namespace, mode: str, config: str):
    """The model, what the step calls, and (for a whole compile split at blocks) the boundaries."""
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq)
    if "checkpoint" in config:
        apply_checkpointing(model, "Block")
    if mode == "eager":
        return model, model
    if mode == "compiled per block":
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block, backend=args.backend)
        return model, model
    compiled = torch.compile(model, backend=args.backend)
    if mode == "whole, split at blocks":
        split_at_blocks(repeated_blocks(model))
    return model, compiled


def _measure(args: argparse.Namespace, mode: str, config: str, tokens: torch.Tensor) -> list[str]:
    torch._dynamo.reset()
    model, forward = _model(args, mode, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    offloading = "offload" in config
    meter = offload_activations(
        model, min_bytes=0 if offloading else _KEEP_ALL, devices=("cpu",), prefetch=0, host_budget=1.0
    )

    def step(context: contextlib.AbstractContextManager) -> None:
        with context:
            loss = gpt_loss(forward, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timed = meter if offloading else contextlib.nullcontext()
    for _ in range(args.warmup):
        step(timed)
    times = []
    for _ in range(args.steps):
        start = time.thread_time()
        step(timed)
        times.append(time.thread_time() - start)
    step(meter)  # the measured step: offload's own, or the keep-everything meter's
    stats = meter.stats
    return [
        mode, config, f"{stats.peak_resident_bytes / 2**20:.2f} MiB", f"{statistics.median(times) * 1e3:.1f}",
        str(stats.packed_tensors if offloading else 0),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    with one_thread():
        rows = [_measure(args, mode, config, tokens) for mode in MODES for config in CONFIGS]
        machine = hardware()
    print_table(
        f"GPT of {args.depth} blocks (dim {args.dim}, {args.seq} tokens, batch {args.batch}), backend "
        f"{args.backend}; {machine}",
        ["mode", "lightmem", "saved peak", "host ms/step", "packs/step"],
        rows,
    )


if __name__ == "__main__":
    main()
