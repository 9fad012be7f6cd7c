"""Cost of each memory probe per call, and of the whole collection relative to a training step.

    python benchmarks/metrics.py

Probes that need CUDA (PyTorch allocator, NVML) are timed only where a GPU exists.
The host memory guard's check runs every training batch (not only on logged steps), so it is also
timed against a 50 ms step, the budget being 0.5% of it: with a cgroup (two small file reads) and
without one (RSS of this process and its DataLoader workers).
"""

from __future__ import annotations

import os
import sys
import time
import timeit

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, gpt_loss, hardware, median_time_s, print_table

from lightmem.host_guard import HostGuard, HostLimit, own_cgroups
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


def _own_cgroup_files() -> HostLimit | None:
    """This process's cgroup usage files, limit or not, so the cgroup read path is timed here."""
    for version, (directory, *_) in own_cgroups():
        names = ("memory.current", "inactive_file") if version == 2 else ("memory.usage_in_bytes", "total_inactive_file")
        usage = os.path.join(directory, names[0])
        if os.path.exists(usage):
            return HostLimit(1 << 40, f"cgroup v{version} {directory}", usage, os.path.join(directory, "memory.stat"), names[1])
    return None


def guard_cost() -> None:
    step_s = 0.050
    workers = [torch.multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        variants = {"no cgroup: RSS of this process + 2 workers": HostGuard(1 << 40, 0.85, 0.95)}
        cgroup = _own_cgroup_files()
        if cgroup is not None:
            variants[f"cgroup: usage + memory.stat ({cgroup.source.split()[1]})"] = HostGuard(cgroup, 0.85, 0.95)
        else:
            print("cgroup read: not timed (this process has no memory cgroup files)")
        rows = []
        for name, guard in variants.items():
            calls = 5000
            seconds = min(timeit.repeat(guard.check, number=calls, repeat=5)) / calls
            rows.append([name, f"{seconds * 1e6:.1f}", f"{seconds / step_s * 100:.4f}%"])
    finally:
        for worker in workers:
            worker.terminate()
            worker.join()
    print_table(
        f"Host memory guard check, every training batch, vs a 50 ms step (budget: 0.5% = 250 us); {hardware()}",
        ["check", "us per batch", "share of a 50 ms step"],
        rows,
    )


if __name__ == "__main__":
    main()
    guard_cost()
