"""Cost of each memory probe per call, and of the whole collection relative to a training step.

    python benchmarks/metrics.py

Probes that need CUDA (PyTorch allocator, NVML) are timed only where a GPU exists.
"""

from __future__ import annotations

import os
import sys
import timeit

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, gpt_loss, hardware, median_time_s, print_table

from lightmem.metrics.probes import HostProbe, LightmemProbe, NvmlProbe, ProbeUnavailable, TorchAllocatorProbe
from lightmem.offload.stats import OffloadStats


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    traffic = LightmemProbe(lambda: 6)
    traffic.add(OffloadStats(offloaded_bytes=1 << 30))
    probes = {"host (psutil)": HostProbe(lambda: 1 << 30), "lightmem (offload stats)": traffic}
    for name, make in (("gpu (torch.cuda.memory_stats)", TorchAllocatorProbe), ("device (NVML)", NvmlProbe)):
        try:
            probes[name] = make(device)
        except ProbeUnavailable as error:
            print(f"{name}: not timed ({error})")

    torch.manual_seed(0)
    model = GPT(vocab=2048, dim=256, depth=4, seq=128).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 2048, (8, 129), device=device)

    def step() -> None:
        gpt_loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_s = median_time_s(step, 5, sync=sync)
    rows = []
    total_s = 0.0
    for name, probe in probes.items():
        calls = 2000
        seconds = timeit.timeit(lambda probe=probe: (probe.collect(), probe.end_step()), number=calls) / calls
        if probe is traffic:
            traffic.add(OffloadStats(offloaded_bytes=1 << 30))
        total_s += seconds
        rows.append([name, f"{seconds * 1e6:.1f}", f"{seconds / step_s * 100:.4f}%"])
    rows.append(["all of the above", f"{total_s * 1e6:.1f}", f"{total_s / step_s * 100:.4f}%"])
    print_table(
        f"Probe cost per call vs a {step_s * 1e3:.0f} ms training step (GPT dim=256 depth=4 batch=8 seq=128, "
        f"AdamW, {device.type}); {hardware()}",
        ["probe", "us per call", "share of one step"],
        rows,
    )


if __name__ == "__main__":
    main()
