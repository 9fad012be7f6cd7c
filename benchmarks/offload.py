"""Activation offload: step time and traffic for no hooks, torch's save_on_cpu, and lightmem.

    python benchmarks/offload.py                 # CPU: lightmem with devices=("cpu",)
    python benchmarks/offload.py --device cuda   # GPU: pinned host memory, side streams

On CPU nothing is saved (host and "device" are the same memory); the figure that matters there is
the per-saved-tensor overhead of the hooks compared with save_on_cpu, which does the same copies.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext

import torch
from torch.autograd.graph import save_on_cpu

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, gpt_loss, hardware, interleaved_median_s, print_table

from lightmem import offload_activations
from lightmem.config import format_bytes


class _Counter:
    """Counts saved tensors (pass-through hooks) so every row reports the same denominator."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self):
        self.count = 0

        def pack(t):
            self.count += 1
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--small-steps", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(dim=args.dim, depth=args.depth, seq=args.seq).to(device)
    tokens = torch.randint(0, 8192, (args.batch, args.seq + 1), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pin = device.type == "cuda"

    counter = _Counter()
    with counter():
        gpt_loss(model, tokens).backward()
    saved = counter.count

    offloader = offload_activations(model, min_bytes=0, devices=(device.type,))
    offloader_1mib = offload_activations(model, min_bytes="1MiB", devices=(device.type,))
    variants = {
        "no hooks": lambda: nullcontext(),
        "pass-through hooks": counter,
        "save_on_cpu": lambda: save_on_cpu(pin_memory=pin),
        "lightmem min_bytes=0": lambda: offloader,
        "lightmem min_bytes=1MiB": lambda: offloader_1mib,
    }
    def make_step(make_context):
        def step():
            with make_context():
                loss = gpt_loss(model, tokens)
            loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    seconds = interleaved_median_s({name: make_step(f) for name, f in variants.items()}, args.steps, sync=sync)
    baseline = seconds["no hooks"]
    rows = []
    for name in variants:
        stats = {"lightmem min_bytes=0": offloader, "lightmem min_bytes=1MiB": offloader_1mib}.get(name)
        stats = stats.stats if stats is not None else None
        overhead_us = (seconds[name] - baseline) / saved * 1e6
        rows.append([
            name, f"{seconds[name] * 1e3:.1f}", f"{overhead_us:+.1f}",
            format_bytes(stats.offloaded_bytes) if stats else "-",
            str(stats.offloaded_tensors) if stats else "-",
            format_bytes(stats.deduplicated_bytes) if stats else "-",
            format_bytes(stats.peak_host_bytes) if stats else "-",
            f"{stats.prefetch_hits}/{stats.prefetch_hits + stats.prefetch_misses}" if stats else "-",
            f"{stats.wait_s * 1e3:.1f}" if stats else "-",
        ])  # fmt: skip
    print_table(
        f"Offload, transformer dim={args.dim} depth={args.depth} batch={args.batch} seq={args.seq}, "
        f"{saved} saved tensors per step, device={device.type}; {hardware()}",
        ["variant", "step ms", "us/saved tensor vs no hooks", "offloaded", "storages", "deduplicated",
         "peak host", "prefetch hits", "waited ms"],
        rows,
    )  # fmt: skip

    # Hook overhead alone: many small saved tensors, where the copy itself costs little.
    x = torch.randn(64, 64, device=device, requires_grad=True)

    def small_chain():
        y = x
        for _ in range(100):
            y = y.sin()
        return y.sum()

    small_variants = {
        "no hooks": lambda: nullcontext(),
        "save_on_cpu": lambda: save_on_cpu(pin_memory=pin),
        "lightmem min_bytes=0": lambda: offloader,
        "lightmem kept (min_bytes=1MiB)": lambda: offloader_1mib,
    }

    def make_small_step(make_context):
        def step():
            with make_context():
                loss = small_chain()
            loss.backward()
            x.grad = None

        return step

    seconds = interleaved_median_s(
        {name: make_small_step(f) for name, f in small_variants.items()}, args.small_steps, warmup=5, sync=sync
    )
    rows = [
        [name, f"{seconds[name] * 1e3:.2f}", f"{(seconds[name] - seconds['no hooks']) / 100 * 1e6:+.1f}"]
        for name in small_variants
    ]
    print_table(
        "Per-saved-tensor overhead: 100 chained sin() on a 64x64 float32 tensor (16 KiB saved each)",
        ["variant", "step ms", "us/saved tensor vs no hooks"],
        rows,
    )


if __name__ == "__main__":
    main()
