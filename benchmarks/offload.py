"""Activation offload: step time and traffic for no hooks, torch's save_on_cpu, and lightmem.

    python benchmarks/offload.py                 # CPU: lightmem with devices=("cpu",)
    python benchmarks/offload.py --device cuda   # GPU: pinned host memory, side streams
    python benchmarks/offload.py --per-tensor-only   # only the per-saved-tensor table
    python benchmarks/offload.py --gpt2              # only the GPT-2 step tables (transformers):
                                                     # all variants in one process, then each in its own
    python benchmarks/offload.py --guard             # all three; exit 1 if lightmem costs more than torchtune
    python benchmarks/offload.py --first-steps       # only the first steps (host pool growth)

On CPU nothing is saved (host and "device" are the same memory); the figure that matters there is
the per-saved-tensor overhead of the hooks, against yardsticks: pass-through hooks, the least a
correct keeping hook does (version-checked hooks), hooks that copy each saved tensor out and back,
and save_on_cpu (which copies nothing on a CPU: ``.cpu()`` of a CPU tensor returns it); and,
when torchtune is installed (optional: ``pip install --no-deps torchtune``; see ``_torchtune.py``),
torchtune's ``OffloadActivations``, the pure-Python offloader users would pick instead.
``keep_cost.py`` breaks a kept save's cost into its parts.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
from torch.autograd.graph import save_on_cpu

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, gpt_loss, hardware, interleaved_median_s, interleaved_times_s, one_thread, print_table
from _torchtune import torchtune_hooks, torchtune_offload_activations

from lightmem import offload_activations
from lightmem.config import format_bytes
from lightmem.offload.hooks import _held
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
    parser.add_argument("--rounds", type=int, default=100, help="interleaved rounds of the per-tensor table")
    parser.add_argument("--repeats", type=int, default=3, help="steps per variant per round (per-tensor)")
    parser.add_argument("--step-rounds", type=int, default=20, help="interleaved rounds, GPT-2 step table")
    parser.add_argument("--per-tensor-only", action="store_true", help="only the per-saved-tensor table")
    parser.add_argument("--gpt2", action="store_true", help="only the GPT-2 step table")
    parser.add_argument("--guard", action="store_true",
                        help="per-tensor and GPT-2 tables, then exit 1 if lightmem adds more than torchtune")
    parser.add_argument("--guard-ratio", type=float, default=1.0,
                        help="largest lightmem/torchtune ratio --guard accepts for an offloaded tensor and "
                             "the GPT-2 step (the goal: 1.0)")
    parser.add_argument("--guard-keep-ratio", type=float, default=1.0,
                        help="the same for a kept tensor (the goal: 1.0)")
    parser.add_argument("--first-steps", action="store_true", help="only the first-steps table (host pool growth)")
    parser.add_argument("--process-rounds", type=int, default=6,
                        help="rounds of the GPT-2 table with each variant in its own process (0: skip it)")
    parser.add_argument("--process-steps", type=int, default=10, help="timed steps in each of those processes")
    parser.add_argument("--gpt2-child", metavar="VARIANT", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args()  # fmt: skip
    if args.gpt2_child:
        gpt2_child(args.gpt2_child, args.process_steps, args.warmup)
        return
    device = torch.device(args.device)
    if args.first_steps:
        first_steps_table(device)
        return
    if args.gpt2:
        gpt2_step_table(args.step_rounds, repeats=1)
        if args.process_rounds:
            gpt2_process_table(args.process_rounds, args.process_steps, args.warmup)
        return
    per_tensor = per_saved_tensor_table(device, args.rounds, args.repeats)
    if args.per_tensor_only:
        return
    if args.guard:
        gpt2_step_table(args.step_rounds, repeats=1)
        step = gpt2_process_table(max(args.process_rounds, 1), args.process_steps, args.warmup)
        missed = guard(per_tensor, step, args.guard_ratio, args.guard_keep_ratio)
        sys.exit(1 if missed else 0)
    if device.type == "cpu":
        gpt2_step_table(args.step_rounds, repeats=1)
        if args.process_rounds:
            gpt2_process_table(args.process_rounds, args.process_steps, args.warmup)
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
CHECKED_HELD = "version-checked hooks, detach only where a cycle could form (lightmem's rule)"
DECIDING = "version-checked hooks + lightmem's policy decision"


def _checked_hooks(decide=None, hold=None):
    """The least a correct keeping hook does: hold a ``detach()`` (never the tensor itself, whose
    grad_fn may be the node that holds the handle: a reference cycle through C++) with the saved
    version, and check the version in unpack (hooks switch off autograd's own check).

    With ``decide``, pack also runs lightmem's offload policy on the tensor (its verdict is unused):
    the policy's cost in place, on fresh tensors, apart from the rest of lightmem's bookkeeping.
    With ``hold`` (lightmem's ``_held``), pack holds ``hold(tensor)`` instead of a ``detach()``:
    the tensor itself unless its grad_fn could reach the handle. That row is the floor of a keeping
    hook with both guarantees lightmem keeps (in-place writes caught, no leak through a cycle).
    """
    held = (lambda tensor: tensor.detach()) if hold is None else hold

    def pack(tensor):
        if decide is not None:
            decide(tensor)
        return held(tensor), tensor._version

    def unpack(packed):
        tensor, version = packed
        if tensor._version != version:
            raise RuntimeError("modified in place")
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def sin_chain_times_s(
    variants, x, chain: int, rounds: int, repeats: int, sync=lambda: None, clock=time.thread_time
) -> dict[str, list[float]]:
    """Each variant's step (``chain`` chained sin() from ``x``, forward + backward) under its
    context, per round as the best of ``repeats`` steps, over ``rounds`` interleaved rounds: every
    round times each variant in turn, so drift hits all alike."""

    def make_step(make_context):
        def step() -> None:
            with make_context():
                y = x
                for _ in range(chain):
                    y = y.sin()
                loss = y.sum()
            loss.backward()
            x.grad = None

        return step

    steps = {name: make_step(make_context) for name, make_context in variants.items()}
    return interleaved_times_s(steps, rounds, repeats, sync=sync, clock=clock)


def added_s(times: dict[str, list[float]], name: str, baseline: str = "no hooks") -> tuple[float, float]:
    """``(min, median)`` seconds ``name`` adds over ``baseline``: the difference of the minimums,
    and the median of the per-round differences (rounds are interleaved, so each pairs the two)."""
    paired = sorted(a - b for a, b in zip(times[name], times[baseline]))
    return min(times[name]) - min(times[baseline]), statistics.median(paired)


def added_us_per_tensor(times: dict[str, list[float]], name: str, saves: int) -> tuple[float, float]:
    """``added_s`` of ``name`` over no hooks, in microseconds per saved tensor (``saves`` per step)."""
    low, mid = added_s(times, name)
    return low / saves * 1e6, mid / saves * 1e6


TT_OFFLOADING = "torchtune offloading (min_offload_size=0)"
TT_KEEPING = "torchtune keeping (min_offload_size=1MiB)"
LM_OFFLOADING = "lightmem offloading (min_bytes=0)"
LM_KEEPING = "lightmem keeping (min_bytes=1MiB)"


def per_saved_tensor_table(device: torch.device, rounds: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Hook overhead alone: 200 chained sin() on 32x32 float32 (4 KiB saved each), one thread.

    Each round times every variant (interleaved, so drift hits all alike) as the best of
    ``repeats`` back-to-back steps. Returns each variant's ``(min, median)`` microseconds added per
    saved tensor over no hooks.
    """
    with one_thread():
        return _per_saved_tensor_rows(device, rounds, repeats)


def _per_saved_tensor_rows(device: torch.device, rounds: int, repeats: int) -> dict[str, tuple[float, float]]:
    chain = 200
    pin = device.type == "cuda"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    x = torch.randn(32, 32, device=device, requires_grad=True)
    offloading = offload_activations(min_bytes=0, devices=(device.type,))
    keeping = offload_activations(min_bytes="1MiB", devices=(device.type,))
    decide = OffloadPolicy(min_bytes=2**20, devices=(device.type,)).decide
    variants = {
        "no hooks": nullcontext,
        "pass-through hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        CHECKED: _checked_hooks,
        CHECKED_HELD: lambda: _checked_hooks(hold=_held),
        DECIDING: lambda: _checked_hooks(decide),
        "save_on_cpu": lambda: save_on_cpu(pin_memory=pin),
        COPYING: _copying_hooks,
    }
    if device.type == "cpu" and torchtune_offload_activations() is not None:
        tt_offloading, tt_keeping = torchtune_hooks(0), torchtune_hooks(2**20)
        variants[TT_OFFLOADING] = lambda: tt_offloading
        variants[TT_KEEPING] = lambda: tt_keeping
    variants[LM_OFFLOADING] = lambda: offloading
    variants[LM_KEEPING] = lambda: keeping

    times = sin_chain_times_s(variants, x, chain, rounds, repeats, sync, clock)
    assert offloading.stats.offloaded_tensors == chain and keeping.stats.kept_bytes == chain * 4096
    added = {
        name: added_us_per_tensor(times, name, chain) for name in variants if name != "no hooks"
    }

    def ratio(name: str, yardstick: str, unit: str) -> str:
        if yardstick not in added:
            return ""
        (low, mid), (yard_low, yard_mid) = added[name], added[yardstick]
        return f"{low / yard_low:.2f}x / {mid / yard_mid:.2f}x {unit}"

    yardsticks = {
        LM_OFFLOADING: (TT_OFFLOADING, "torchtune offloading"),
        LM_KEEPING: (TT_KEEPING, "torchtune keeping"),
        TT_OFFLOADING: (COPYING, "copying hooks"),
        COPYING: ("pass-through hooks", "pass-through"),
        CHECKED: ("pass-through hooks", "pass-through"),
        CHECKED_HELD: (TT_KEEPING, "torchtune keeping"),
        DECIDING: ("pass-through hooks", "pass-through"),
    }
    rows = [["no hooks", f"{min(times['no hooks']) * 1e3:.3f}", "-", ""]]
    for name in added:
        low, mid = added[name]
        note = ratio(name, *yardsticks[name]) if name in yardsticks else ""
        rows.append([name, f"{min(times[name]) * 1e3:.3f}", f"{low:+.2f} / {mid:+.2f}", note])
    print_table(
        f"Per-saved-tensor cost: {chain} chained sin() on 32x32 float32 (4 KiB saved each), forward + "
        f"backward, {rounds} interleaved rounds x best of {repeats}, "
        f"{'thread CPU time' if clock is time.thread_time else 'wall time'}; {hardware()}",
        ["variant", "step ms (min)", "us added per saved tensor (min / median)", "ratio (min / median)"],
        rows,
    )
    return added


GPT2_BASELINE = "no hooks"
GPT2_LIGHTMEM = "lightmem min_bytes=0"
GPT2_TORCHTUNE = "torchtune default (min_offload_size=1KiB)"


def _gpt2_workload():
    """The GPT-2 of the step tables (4 layers, n_embd 256, vocab 4096; batch 4, seq 128, training
    mode), its tokens and its variants (name -> context factory), or ``None`` without transformers."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    hf_logging.set_verbosity_error()  # a config notice on every forward, not a measurement
    torch.manual_seed(0)
    vocab = 4096
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=vocab, n_positions=128,
                        bos_token_id=None, eos_token_id=None)  # fmt: skip
    model = GPT2LMHeadModel(config).train()
    tokens = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(1))
    variants = {
        GPT2_BASELINE: nullcontext,
        GPT2_LIGHTMEM: lambda off=offload_activations(model, min_bytes=0, devices=("cpu",)): off,
        "lightmem default (min_bytes=1MiB)": lambda off=offload_activations(model, devices=("cpu",)): off,
    }
    if torchtune_offload_activations() is not None:
        variants[GPT2_TORCHTUNE] = lambda tt=torchtune_hooks(1024): tt
        variants["torchtune min_offload_size=1MiB"] = lambda tt=torchtune_hooks(2**20): tt
    return model, tokens, variants


def _gpt2_step(model, tokens, make_context):
    def step() -> None:
        with make_context():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def gpt2_step_table(rounds: int, repeats: int, extra=None) -> dict[str, tuple[float, float]] | None:
    """Host time a training step gains from offload hooks on a transformers GPT-2 (4 layers,
    n_embd 256, batch 4, seq 128, CPU, one thread), every variant in this process, interleaved,
    and the Python calls the hooks add (cProfile).

    ``extra(model)``, when given, returns more variants (name -> context factory) to interleave
    (``per_tensor_ab.py --gpt2``: an earlier commit's lightmem). Returns each hooked variant's
    ``(min, median)`` milliseconds added per step, or ``None`` when transformers is not installed.
    Variants in one process share its allocator and caches: one that holds a host pool changes
    what the next one's allocations cost; ``gpt2_process_table`` gives each its own process.
    """
    with one_thread():
        workload = _gpt2_workload()
        if workload is None:
            print("\n(transformers is not installed: no GPT-2 step table)")
            return None
        model, tokens, variants = workload
        counter = _Counter()
        with counter():
            model(input_ids=tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)
        if extra is not None:
            variants.update(extra(model))
        steps = {name: _gpt2_step(model, tokens, f) for name, f in variants.items()}
        times = interleaved_times_s(steps, rounds, repeats)
        calls = {}
        for name, step in steps.items():
            profile = cProfile.Profile()
            profile.runcall(step)
            calls[name] = pstats.Stats(profile).total_calls
        machine = hardware()
    added = {name: tuple(s * 1e3 for s in added_s(times, name)) for name in variants if name != GPT2_BASELINE}
    rows = [[GPT2_BASELINE, f"{min(times[GPT2_BASELINE]) * 1e3:.1f}", "-", f"{calls[GPT2_BASELINE]:,}", "-"]]
    for name, (low, mid) in added.items():
        extra_calls = calls[name] - calls[GPT2_BASELINE]
        rows.append([name, f"{min(times[name]) * 1e3:.1f}", f"{low:+.1f} / {mid:+.1f}", f"{calls[name]:,}",
                     f"+{extra_calls:,} ({extra_calls / counter.count:.1f} per saved tensor)"])  # fmt: skip
    print_table(
        f"Training step, transformers GPT-2 (4 layers, n_embd 256, vocab 4096) batch 4 seq 128, "
        f"{counter.count} saved tensors per step, CPU, all variants in one process, {rounds} interleaved "
        f"rounds x best of {repeats}, thread CPU time; {machine}",
        ["variant", "step ms (min)", "ms added per step (min / median)", "Python calls per step (cProfile)",
         "calls added"],
        rows,
    )  # fmt: skip
    return added


def gpt2_child(name: str, steps: int, warmup: int) -> None:
    """One variant of the GPT-2 step in this process alone: prints its per-step thread CPU
    seconds and minor page faults as JSON (``gpt2_process_table`` starts this as ``offload.py
    --gpt2-child NAME``)."""
    torch.set_num_threads(1)
    model, tokens, variants = _gpt2_workload()
    step = _gpt2_step(model, tokens, variants[name])
    for _ in range(warmup):
        step()
    times, faults = [], []
    for _ in range(steps):
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    print(json.dumps({"name": name, "times_s": times, "minor_faults": faults}))


def gpt2_process_table(rounds: int, steps: int, warmup: int = 3) -> dict[str, tuple[float, float]] | None:
    """The GPT-2 step of ``gpt2_step_table``, each variant in a fresh process of its own, as a
    user's training run has one offloader: nothing one variant allocates or caches changes
    another's step. Each round starts one process per variant (the order rotates by round); a
    process times ``steps`` steps after ``warmup``, and its median step is paired with the no-hooks
    process of the same round. Returns each hooked variant's ``(min, median)`` over the rounds of
    the milliseconds added per step (median step minus the round's no-hooks median step).
    """
    workload = _gpt2_workload()
    if workload is None:
        print("\n(transformers is not installed: no GPT-2 per-process table)")
        return None
    names = list(workload[2])
    del workload
    medians: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            child = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--gpt2-child", name, "--process-steps", str(steps),
                 "--warmup", str(warmup)],
                capture_output=True, text=True,
            )  # fmt: skip
            if child.returncode:
                raise SystemExit(f"offload.py --gpt2-child {name!r} failed:\n{child.stderr}")
            result = json.loads(child.stdout.strip().splitlines()[-1])
            medians[name].append(statistics.median(result["times_s"]))
            faults[name].append(statistics.median(result["minor_faults"]))
    added = {}
    rows = [[GPT2_BASELINE, f"{statistics.median(medians[GPT2_BASELINE]) * 1e3:.1f}", "-",
             f"{statistics.median(faults[GPT2_BASELINE]):,.0f}"]]  # fmt: skip
    for name in names:
        if name == GPT2_BASELINE:
            continue
        paired = sorted((a - b) * 1e3 for a, b in zip(medians[name], medians[GPT2_BASELINE]))
        added[name] = (paired[0], statistics.median(paired))
        rows.append([name, f"{statistics.median(medians[name]) * 1e3:.1f}",
                     f"{paired[0]:+.1f} / {statistics.median(paired):+.1f} / {paired[-1]:+.1f}",
                     f"{statistics.median(faults[name]):,.0f}"])  # fmt: skip
    with one_thread():
        machine = hardware()
    print_table(
        f"Training step, the same GPT-2, each variant in its own process: {rounds} rounds x one process "
        f"per variant, each the median of {steps} steps after {warmup}, thread CPU time; {machine}",
        ["variant", "step ms (median of rounds)", "ms added per step, paired by round (min / median / max)",
         "minor page faults per step"],
        rows,
    )  # fmt: skip
    return added


def guard(
    per_tensor: dict[str, tuple[float, float]],
    step: dict[str, tuple[float, float]] | None,
    ratio: float,
    keep_ratio: float,
) -> list[str]:
    """The issue-25 goals: lightmem's added cost at most ``ratio`` (a kept tensor: ``keep_ratio``)
    times torchtune's, per saved tensor on the minimums (one process, interleaved rounds), per GPT-2
    step on the medians over rounds of separate processes (a process's step varies more than a
    sin() chain's). Returns the goals missed (empty when all hold)."""
    pairs = [
        ("offloaded tensor", per_tensor, LM_OFFLOADING, TT_OFFLOADING, "us", ratio, 0),
        ("kept tensor", per_tensor, LM_KEEPING, TT_KEEPING, "us", keep_ratio, 0),
    ]
    if step is not None:
        pairs.append(("GPT-2 step (own processes, medians)", step, GPT2_LIGHTMEM, GPT2_TORCHTUNE, "ms", ratio, 1))
    missed = []
    for what, figures, ours, theirs, unit, limit, which in pairs:
        if theirs not in figures:
            missed.append(f"{what}: torchtune is not installed (pip install --no-deps torchtune)")
            continue
        mine, peer = figures[ours][which], figures[theirs][which]
        verdict = "ok" if mine <= limit * peer else "MISSED"
        line = (
            f"{what}: lightmem {mine:+.2f} {unit} vs torchtune {peer:+.2f} {unit} "
            f"({mine / peer:.2f}x, at most {limit:.2f}x): {verdict}"
        )
        print(line)
        if verdict != "ok":
            missed.append(line)
    return missed


if __name__ == "__main__":
    main()
