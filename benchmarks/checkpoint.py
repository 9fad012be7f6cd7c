"""Selective checkpointing: step time and peak memory, baseline vs checkpoint vs checkpoint + offload.

    python benchmarks/checkpoint.py

Peak memory is the peak of live tensor storages in a steady training step (forward, backward,
AdamW step), tracked per storage by a dispatch mode. With offload on the CPU, lightmem's host
buffers are excluded from the peak, since on a GPU they would be host memory, not device memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, StoragePeak, gpt_loss, hardware, interleaved_median_s, print_table

from lightmem import apply_checkpointing, offload_activations
from lightmem.config import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))

    def build(checkpoint_every: int | None, offload: bool):
        torch.manual_seed(0)
        model = GPT(vocab=args.vocab, dim=args.dim, depth=args.depth, seq=args.seq)
        if checkpoint_every:
            apply_checkpointing(model, "Block", every_n=checkpoint_every)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        offloader = offload_activations(model, min_bytes="1MiB", devices=("cpu",)) if offload else None

        def step():
            with offloader if offloader is not None else nullcontext():
                loss = gpt_loss(model, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, offloader

    variants = {
        "baseline": build(None, False),
        "checkpoint every block": build(1, False),
        "checkpoint every 2nd block": build(2, False),
        "offload (min_bytes=1MiB)": build(None, True),
        "checkpoint every block + offload": build(1, True),
    }
    seconds = interleaved_median_s({name: step for name, (step, _) in variants.items()}, args.steps)
    peaks = {}
    for name, (step, offloader) in variants.items():
        pool_blocks = set()
        if offloader is not None:
            slabs = offloader._pool._slabs
            pool_blocks = {b.storage.data_ptr() for slab in slabs for b in slab.blocks.values()}
        with StoragePeak(ignore=lambda storage, blocks=pool_blocks: storage.data_ptr() in blocks) as peak:
            step()
        peaks[name] = peak.peak
    rows = []
    for name, (_, offloader) in variants.items():
        rows.append([
            name, f"{seconds[name] * 1e3:.0f}", f"{seconds[name] / seconds['baseline']:.2f}x",
            format_bytes(peaks[name]), f"{peaks[name] / peaks['baseline']:.2f}x",
            format_bytes(offloader.stats.offloaded_bytes) if offloader else "-",
        ])  # fmt: skip
    print_table(
        f"Checkpointing, GPT dim={args.dim} depth={args.depth} vocab={args.vocab} batch={args.batch} "
        f"seq={args.seq}, AdamW; {hardware()}",
        ["variant", "step ms", "time vs baseline", "peak memory", "peak vs baseline", "offloaded / step"],
        rows,
    )


if __name__ == "__main__":
    main()
