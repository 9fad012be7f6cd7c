"""The host side of model-state offload: how long the optimizer step takes on this CPU, and what a
GPU step would be bound by when gradients and parameters cross the host link.

    python benchmarks/optimizer_offload.py [--millions 4] [--rounds 7] [--link-GBps 25]

1. Measured: ``torch.optim.AdamW`` (weight decay 0.01) stepping fp32 host tensors, per million
   parameters, for each implementation torch offers on this CPU: for-loop (``foreach=False``),
   ``foreach=True`` and ``fused=True`` (when the CPU has a fused kernel). lightmem steps the user's
   optimizer as constructed, so this is the table to pick the constructor flag from; the three give
   different bits, and lightmem never switches between them.
2. Modelled, not measured: with the step on the host, each optimizer step moves every fp32
   gradient to the host and every updated parameter back: 8 bytes per parameter over the link.
   At an assumed sustained link speed (default 25 GB/s, about PCIe 4.0 x16) that transfer is the
   lower bound on the step's exposed time when backward cannot hide it; the total adds the host
   step measured here.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware, interleaved_median_s, print_table


def _params(millions: float, tensors: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    per_tensor = int(millions * 1e6) // tensors
    params = []
    for _ in range(tensors):
        param = torch.randn(per_tensor, generator=generator).requires_grad_()
        param.grad = torch.randn(per_tensor, generator=generator) * 1e-3
        params.append(param)
    return params


def _variants() -> dict[str, dict[str, bool]]:
    variants = {"for-loop (foreach=False)": {"foreach": False}, "foreach=True": {"foreach": True}}
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if "cpu" in _get_fused_kernels_supported_devices():
        variants["fused=True"] = {"fused": True}
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, default=4.0, help="parameters stepped, in millions")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--link-GBps", type=float, default=25.0, help="assumed host link speed, GB/s")
    args = parser.parse_args()

    steps = {}
    for name, flags in _variants().items():
        params = _params(args.millions)
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)
        steps[name] = optimizer.step
    medians = interleaved_median_s(steps, rounds=args.rounds)
    rows = [
        [name, f"{seconds * 1e3:.1f}", f"{seconds * 1e3 / args.millions:.2f}"]
        for name, seconds in medians.items()
    ]
    print(f"Measured on: {hardware()}")
    print_table(
        f"Host AdamW step, {args.millions:g}M fp32 parameters (median of {args.rounds})",
        ["implementation", "ms per step", "ms per million parameters"],
        rows,
    )

    link = args.link_GBps * 1e9
    fastest = min(medians.values()) / args.millions
    model_rows = []
    for millions in (100, 206.5, 1000, 7000):
        transfer_s = 8 * millions * 1e6 / link  # fp32 gradient out, fp32 parameter back
        model_rows.append([
            f"{millions:g}M", f"{transfer_s * 1e3:.0f}", f"{fastest * millions * 1e3:.0f}",
            f"{(transfer_s + fastest * millions) * 1e3:.0f}",
        ])  # fmt: skip
    print_table(
        f"MODEL, not a measurement: per-step cost with the step on the host, link assumed "
        f"{args.link_GBps:g} GB/s, host step at this CPU's fastest rate above",
        ["parameters", "link transfer ms (8 B/param)", "host step ms", "serial total ms"],
        model_rows,
    )


if __name__ == "__main__":
    main()
