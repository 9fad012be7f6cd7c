"""Activation offload: step time and traffic for no hooks, torch's save_on_cpu, and lightmem.

    python benchmarks/offload.py                 # CPU: lightmem with devices=("cpu",)
    python benchmarks/offload.py --device cuda   # GPU: pinned host memory, side streams
    python benchmarks/offload.py --per-tensor-only   # only the per-saved-tensor table (issue 13)
    python benchmarks/offload.py --first-steps       # only the first steps (host pool growth)

On CPU nothing is saved (host and "device" are the same memory); the figure that matters there is
the per-saved-tensor overhead of the hooks, against yardsticks: pass-through hooks, the least a
correct keeping hook does (version-checked hooks), hooks that copy each saved tensor out and back,
and save_on_cpu (which copies nothing on a CPU: ``.cpu()`` of a CPU tensor returns it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

import torch
from torch.autograd.graph import save_on_cpu

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, gpt_loss, hardware, interleaved_median_s, print_table

from lightmem import offload_activations
from lightmem.config import format_bytes
from lightmem.offload.policy import OffloadPolicy


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
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds of the per-tensor table")
    parser.add_argument("--repeats", type=int, default=5, help="steps per variant and round")
    parser.add_argument("--per-tensor-only", action="store_true", help="only the per-saved-tensor table")
    parser.add_argument("--first-steps", action="store_true", help="only the first-steps table (host pool growth)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.first_steps:
        first_steps_table(device)
        return
    per_saved_tensor_table(device, args.rounds, args.repeats)
    if args.per_tensor_only:
        return
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



def first_steps_table(device: torch.device, saves: int = 2000, steps: int = 3) -> None:
    """The first steps of a fresh offloader: 2,000 chained sin() on 32x32 float32 (4 KiB saved each).

    The first step grows the host pool slab by slab within its bound; the step boundary then
    replaces the slabs by one, which later steps reuse.
    """
    torch.manual_seed(0)
    x = torch.randn(32, 32, device=device, requires_grad=True)
    offloader = offload_activations(min_bytes=0, devices=(device.type,))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for index in range(steps):
        sync()
        start = time.perf_counter()
        with offloader:
            y = x
            for _ in range(saves):
                y = y.sin()
            loss = y.sum()
        slabs = len(offloader._pool._slabs)  # before the next step boundary merges them
        loss.backward()
        sync()
        seconds = time.perf_counter() - start
        x.grad = None
        rows.append([str(index + 1), f"{seconds * 1e3:.0f}", str(slabs), format_bytes(offloader.stats.peak_host_bytes)])
    print_table(
        f"First steps of a fresh offloader, {saves} chained sin() on 32x32 float32 (4 KiB saved each), "
        f"device={device.type}; {hardware()}",
        ["step", "ms", "host slabs after forward", "peak host"],
        rows,
    )


COPYING = "copying hooks (clone in pack and in unpack)"


def _copying_hooks():
    """The copies save_on_cpu makes on a GPU (an allocation and a copy each way), made on CPU.

    On CPU ``save_on_cpu`` copies nothing (``.cpu()`` and ``.to("cpu")`` return the tensor
    itself), so it is no yardstick there for hooks that do copy; these hooks are the like-for-like
    one: the least a pair of hooks can do to move each saved tensor out and back.
    """
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t.clone())


CHECKED = "version-checked hooks (detach + version in pack, check in unpack)"
DECIDING = "version-checked hooks + lightmem's policy decision"


def _checked_hooks(decide=None):
    """The least a correct keeping hook does: hold a ``detach()`` (never the tensor itself, whose
    grad_fn may be the node that holds the handle: a reference cycle through C++) with the saved
    version, and check the version in unpack (hooks switch off autograd's own check).

    With ``decide``, pack also runs lightmem's offload policy on the tensor (its verdict is unused):
    the policy's cost in place, on fresh tensors, apart from the rest of lightmem's bookkeeping.
    """

    def pack(tensor):
        if decide is not None:
            decide(tensor)
        return tensor.detach(), tensor._version

    def unpack(packed):
        tensor, version = packed
        if tensor._version != version:
            raise RuntimeError("modified in place")
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def sin_chain_best_s(variants, x, chain: int, rounds: int, repeats: int, sync=lambda: None) -> dict[str, float]:
    """Each variant's best step (``chain`` chained sin() from ``x``, forward + backward) under its
    context, over ``rounds`` interleaved rounds of ``repeats`` steps: every round times each
    variant in turn, so drift hits all alike."""

    def step(make_context) -> None:
        with make_context():
            y = x
            for _ in range(chain):
                y = y.sin()
            loss = y.sum()
        loss.backward()
        x.grad = None

    best = {name: float("inf") for name in variants}
    for make_context in variants.values():  # warm-up
        step(make_context)
    for _ in range(rounds):
        for name, make_context in variants.items():
            for _ in range(repeats):
                sync()
                start = time.perf_counter()
                step(make_context)
                sync()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def per_saved_tensor_table(device: torch.device, rounds: int, repeats: int) -> None:
    """Hook overhead alone: 200 chained sin() on 32x32 float32 (4 KiB saved each), one thread.

    Each round times every variant once (interleaved, so drift hits all alike) as the best of
    ``repeats`` back-to-back steps; the table takes each variant's minimum over the rounds, the
    figure least disturbed by other work on a shared machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _per_saved_tensor_rows(device, rounds, repeats)
    finally:
        torch.set_num_threads(threads)


def _per_saved_tensor_rows(device: torch.device, rounds: int, repeats: int) -> None:
    chain = 200
    pin = device.type == "cuda"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(32, 32, device=device, requires_grad=True)
    offloading = offload_activations(min_bytes=0, devices=(device.type,))
    keeping = offload_activations(min_bytes="1MiB", devices=(device.type,))
    decide = OffloadPolicy(min_bytes=2**20, devices=(device.type,)).decide
    variants = {
        "no hooks": nullcontext,
        "pass-through hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        CHECKED: _checked_hooks,
        DECIDING: lambda: _checked_hooks(decide),
        "save_on_cpu": lambda: save_on_cpu(pin_memory=pin),
        COPYING: _copying_hooks,
        "lightmem offloading (min_bytes=0)": lambda: offloading,
        "lightmem keeping (min_bytes=1MiB)": lambda: keeping,
    }

    best = sin_chain_best_s(variants, x, chain, rounds, repeats, sync)
    assert offloading.stats.offloaded_tensors == chain and keeping.stats.kept_bytes == chain * 4096

    def added_us(name: str) -> float:
        return (best[name] - best["no hooks"]) / chain * 1e6

    rows = []
    for name in variants:
        ratio = ""
        if name.startswith("lightmem offloading"):
            ratio = (
                f"{added_us(name) / added_us('save_on_cpu'):.1f}x save_on_cpu, "
                f"{added_us(name) / added_us(COPYING):.1f}x copying hooks"
            )
        elif name.startswith("lightmem keeping") or name in (CHECKED, DECIDING):
            ratio = f"{added_us(name) / added_us('pass-through hooks'):.1f}x pass-through"
        added = f"{added_us(name):+.2f}" if name != "no hooks" else "-"
        rows.append([name, f"{best[name] * 1e3:.3f}", added, ratio])
    print_table(
        f"Per-saved-tensor cost: {chain} chained sin() on 32x32 float32 (4 KiB saved each), forward + "
        f"backward, min of {rounds} interleaved rounds x {repeats}; {hardware()}",
        ["variant", "step ms", "us added per saved tensor", "ratio"],
        rows,
    )


if __name__ == "__main__":
    main()
