"""The host step of model-state offload, timed beside torch's CPU kernels and DeepSpeed's.

    python benchmarks/optimizer_offload.py [--quick] [--rounds 25] [--link-GBps 25] [--others]

For GPT-shaped parameter sets (the parameter shapes of ``_common.GPT``: about 4M and 64M fp32
elements; ``--quick``: 4M only, fewer rounds), in one process, every variant timed once per round
in turn (so drift hits all alike), on one thread and then on all of torch's threads:

- the kernel alone: ``torch.optim.AdamW(params, lr=1e-3)`` (weight decay 0.01) stepping host
  tensors as the for-loop (``foreach=False``), ``foreach=True`` and ``fused=True``; and
  ``DeepSpeedCPUAdam`` (AdamW mode, the same hyperparameters) when ``deepspeed`` imports (its op
  builds on first use with ``DS_ACCELERATOR=cpu``; not a dependency), else one line says why not;
- one copy of the parameters (what lightmem's CPU path does after the step: ``copy_`` of each
  host copy into its parameter), and the fused kernel followed by that copy;
- lightmem's whole host step: ``optimizer.step()`` under ``offload_optimizer(..., devices=("cpu",))``
  (its bookkeeping before the step, the kernel, the copy back) for a default ``AdamW(params,
  lr=1e-3)``, on which lightmem runs the fused kernel, and for an explicit ``AdamW(fused=True)``.

``--others`` adds, on one thread and the 4M set, the for-loop against ``foreach=True`` for the
optimizers that have no fused CPU kernel (lightmem runs the one that was faster here:
``lightmem.model_state.host_kernel``).

Figures are ms per million parameters, minimum and median over the rounds. On one thread the
clock is the thread's CPU time (a shared machine's waits for a core are not counted); on all
threads it is wall time. lightmem's copies and bookkeeping are its whole step minus the fused
kernel of the same rounds. A last table is a MODEL, not a measurement: the link time of moving
8 bytes per parameter at an assumed speed, beside the host step at the measured rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, hardware, interleaved_times_s, print_table

from lightmem import offload_optimizer

# (name, GPT(...) arguments): the 4M and 64M parameter sets.
SIZES = [
    ("GPT 4M", dict(vocab=4096, dim=256, depth=2, heads=4)),
    ("GPT 64M", dict(vocab=8192, dim=768, depth=7, heads=12)),
]
LR = 1e-3
DEEPSPEED = "DeepSpeedCPUAdam"
LIGHTMEM_DEFAULT = "lightmem, default AdamW(params, lr)"
LIGHTMEM_FUSED = "lightmem, AdamW(fused=True)"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    except OSError:
        return "CPU model unknown"
    return f"{len(names)} x {names[0]}" if names else "CPU model unknown"


def gpt_shapes(**gpt_args: int) -> list[torch.Size]:
    with torch.device("meta"):
        return [param.shape for param in GPT(**gpt_args).parameters()]


class ParamSet(nn.Module):
    """Parameters of the given shapes, random values, each with a random gradient if ``grads``."""

    def __init__(self, shapes: list[torch.Size], grads: bool = True) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        values = (torch.randn(shape, generator=generator) for shape in shapes)
        self.params = nn.ParameterList(nn.Parameter(value) for value in values)
        for param in self.params if grads else ():
            param.grad = torch.randn(param.shape, generator=generator) * 1e-3


def _deepspeed_adam() -> tuple[type | None, str]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # not installed, or its op does not build here
        return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return DeepSpeedCPUAdam, ""


def _lightmem_step(shapes: list[torch.Size], **kernel: bool) -> tuple[Callable[[], None], str]:
    """``optimizer.step()`` of an AdamW offloaded on the CPU path, its host gradients in place."""
    model = ParamSet(shapes, grads=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **kernel)
    offloader = offload_optimizer(model, optimizer, devices=("cpu",))
    generator = torch.Generator().manual_seed(1)
    for group in optimizer.param_groups:
        for master in group["params"]:
            master.grad = torch.randn(master.shape, generator=generator) * 1e-3
    return optimizer.step, offloader.host_kernel.name


Steps = dict[str, Callable[[], None]]
KERNELS = [("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})]


def build_steps(shapes: list[torch.Size], deepspeed_adam: type | None) -> tuple[Steps, str]:
    shared = ParamSet(shapes)  # the kernels step the same tensors, each with its own state
    params = list(shared.parameters())
    steps: Steps = {}
    for name, kernel in KERNELS:
        steps[f"torch AdamW {name}"] = torch.optim.AdamW(params, lr=LR, **kernel).step
    if deepspeed_adam is not None:
        steps[DEEPSPEED] = deepspeed_adam(params, lr=LR, weight_decay=0.01, adamw_mode=True).step
    targets = [torch.empty_like(param) for param in params]

    def copy_back() -> None:
        with torch.no_grad():
            for target, param in zip(targets, params):
                target.copy_(param)

    fused = steps["torch AdamW fused"]

    def fused_then_copy() -> None:
        fused()
        copy_back()

    steps["one copy of the parameters"] = copy_back
    steps["fused + one copy"] = fused_then_copy
    default_step, default_kernel = _lightmem_step(shapes)
    steps[LIGHTMEM_DEFAULT] = default_step
    steps[LIGHTMEM_FUSED], _ = _lightmem_step(shapes, fused=True)
    return steps, default_kernel


NO_FUSED_KERNEL = ["RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop", "Adafactor"]


def others_table(shapes: list[torch.Size], rounds: int) -> None:
    """For-loop against foreach, one thread, for the optimizers without a fused CPU kernel."""
    params = list(ParamSet(shapes).parameters())
    millions = sum(shape.numel() for shape in shapes) / 1e6
    steps: Steps = {}
    for name in NO_FUSED_KERNEL:
        if hasattr(torch.optim, name):
            for kernel_name, kernel in KERNELS[:2]:
                steps[f"{name} {kernel_name}"] = getattr(torch.optim, name)(params, lr=LR, **kernel).step
    times = time_steps(steps, rounds, threads=1, warmup=6)  # RAdam rectifies from its 6th step on
    rows = []
    for name in NO_FUSED_KERNEL:
        loop, foreach = times.get(f"{name} for-loop"), times.get(f"{name} foreach")
        if loop is None or foreach is None:
            continue
        row = [name]
        for values in (loop, foreach):
            for stat in (min, statistics.median):
                row.append(f"{stat(values) * 1e3 / millions:.3f}")
        row.append(f"{statistics.median(foreach) / statistics.median(loop):.2f}x")
        rows.append(row)
    print_table(
        f"Optimizers without a fused CPU kernel, {millions:.2f}M parameters, 1 thread, ms per million "
        f"parameters, {rounds} interleaved rounds",
        ["optimizer", "for-loop: min", "median", "foreach: min", "median", "foreach / for-loop (median)"],
        rows,
    )  # fmt: skip


def time_steps(steps: Steps, rounds: int, threads: int, warmup: int = 1) -> dict[str, list[float]]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        clock = time.thread_time if threads == 1 else time.perf_counter
        return interleaved_times_s(steps, rounds, warmup=warmup, clock=clock)
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 4M set only, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per set (default 25; 11 for 64M)")
    parser.add_argument("--link-GBps", type=float, default=25.0, help="assumed host link speed, GB/s (model)")
    parser.add_argument("--others", action="store_true", help="for-loop vs foreach, no fused kernel")
    args = parser.parse_args()

    all_threads = torch.get_num_threads()
    deepspeed_adam, why_not = _deepspeed_adam()
    print(f"Measured on: {cpu_model()}; {hardware()}")
    if deepspeed_adam is None:
        print(f"DeepSpeedCPUAdam skipped: deepspeed does not import here ({why_not})")
    sizes = SIZES[:1] if args.quick else SIZES
    fused_rate = None
    for label, gpt_args in sizes:
        shapes = gpt_shapes(**gpt_args)
        millions = sum(shape.numel() for shape in shapes) / 1e6
        rounds = args.rounds or (5 if args.quick else (25 if millions < 16 else 11))
        steps, default_kernel = build_steps(shapes, deepspeed_adam)
        per_threads = {threads: time_steps(steps, rounds, threads) for threads in sorted({1, all_threads})}
        columns = ["step"]
        for threads in per_threads:
            columns += [f"{threads} thread{'s' if threads > 1 else ''}: min", "median"]
        rows = []
        for name in steps:
            row = [name]
            for times in per_threads.values():
                for stat in (min, statistics.median):
                    row.append(f"{stat(times[name]) * 1e3 / millions:.3f}")
            rows.append(row)
        summary = []
        for threads, times in per_threads.items():
            for stat_name, stat in (("min", min), ("median", statistics.median)):
                fused, baseline = stat(times["torch AdamW fused"]), stat(times["fused + one copy"])
                default, explicit = stat(times[LIGHTMEM_DEFAULT]), stat(times[LIGHTMEM_FUSED])
                deepspeed = f"{fused / stat(times[DEEPSPEED]):.2f}x" if DEEPSPEED in times else "skipped"
                summary.append([
                    f"{threads}", stat_name, deepspeed, f"{default / baseline:.2f}x",
                    f"{explicit / baseline:.2f}x", f"{(default - fused) * 1e3 / millions:.3f}",
                ])  # fmt: skip
        print_table(
            f"{label}: {millions:.2f}M fp32 parameters in {len(shapes)} tensors, ms per million parameters, "
            f"{rounds} interleaved rounds (lightmem's default AdamW ran: {default_kernel})",
            columns, rows,
        )  # fmt: skip
        print_table(
            f"{label}: the targets (each at most 1.2x): the fused kernel against DeepSpeedCPUAdam, and "
            "lightmem's whole host step against the fused kernel + one copy of the parameters",
            ["threads", "of rounds", "fused / DeepSpeed", "lightmem default / (fused + copy)",
             "lightmem fused=True / (fused + copy)", "lightmem copies + bookkeeping, ms/M"],
            summary,
        )  # fmt: skip
        fused_rate = statistics.median(per_threads[1]["torch AdamW fused"]) / millions
        del steps

    if args.others:
        others_table(gpt_shapes(**SIZES[0][1]), args.rounds or 11)

    link = args.link_GBps * 1e9
    model_rows = []
    for millions in (206.5, 1000, 7000):
        transfer_s = 8 * millions * 1e6 / link  # fp32 gradient out, fp32 parameter back
        model_rows.append([
            f"{millions:g}M", f"{transfer_s * 1e3:.0f}", f"{fused_rate * millions * 1e3:.0f}",
        ])  # fmt: skip
    print_table(
        f"MODEL, not a measurement: link time for 8 B per parameter at an assumed {args.link_GBps:g} GB/s, "
        "and the fused host step at the median one-thread rate of the last set above",
        ["parameters", "link transfer ms", "host step ms (1 thread)"],
        model_rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
