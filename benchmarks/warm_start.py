"""Warm start: the first steps of a large activation offload, and what page-locking host memory costs.

    python benchmarks/warm_start.py                          # 8 GiB microbenchmark, 16 GiB offload, every mode
    python benchmarks/warm_start.py --gib 48 --modes prepared --micro-gib 0
    python benchmarks/warm_start.py --budget-s 60            # what fits in a minute, as selfcheck runs it

Without CUDA it prints one line and exits 0: there is nothing to page-lock.

Two tables:

- **Registering N GiB of fresh host memory**: one ``cudaHostRegister`` call (what the step boundary
  did before the warm start), the same after touching every page from torch's intra-op threads, and
  chunks made on background threads as the pool makes them (``lightmem.transfer.page_lock``), with
  and without pre-faulting and at several thread counts; plus the bandwidth of 1 GiB page-locked
  device-to-host copies on the main thread while chunks are registered beside them (does
  registration stall the copies of a step that runs meanwhile?).
- **The first steps of a large offload**: a chain of ``sin`` saving ``--gib`` GiB per step (every
  saved tensor ``--tensor-mib`` MiB, all offloaded), steps 0, 1, 2, 3 and the median of the rest,
  the first step over the steady one, the page-locking time and the part of it the training thread
  waited for. Modes (``lightmem.transfer.pool``'s constants): ``before`` (``WARM_START=False``: the
  first step copies into pageable memory, the boundary after it page-locks one slab on the
  training thread), ``boundary`` (the warm start without ``prepare_host``: chunks page-locked in
  the background from the boundary after step 0), ``prepared`` (``prepare_host`` before step 0)
  and ``prepared-no-wait`` (``WAIT_FOR_CHUNKS=False``: requests that find no page-locked room take
  pageable memory instead of waiting for a chunk).

``selfcheck_section(budget_s)`` returns the same as markdown, running what fits in ``budget_s``
seconds (each part is skipped, with a line saying so, once its estimate would pass the budget).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, os.path.dirname(__file__))

from _common import hardware  # noqa: E402
from lightmem import offload_activations  # noqa: E402
from lightmem.tables import format_table, markdown_table  # noqa: E402
from lightmem.transfer import page_lock, pool  # noqa: E402

GiB = 1024**3
MiB = 1024**2
MODES = ("before", "boundary", "prepared", "prepared-no-wait", "prepared-huge")
NOTHING_TO_MEASURE = "warm_start: CUDA is not available, so there is no host memory to page-lock and nothing to measure"
_SETTINGS = {
    "before": {"WARM_START": False},
    "boundary": {"WARM_START": True},
    "prepared": {"WARM_START": True},
    "prepared-no-wait": {"WARM_START": True, "WAIT_FOR_CHUNKS": False},
    "prepared-huge": {"WARM_START": True},
}
_PAGE_LOCK_SETTINGS = {"prepared-huge": {"HUGE_PAGES": True}}
"""Modes that change ``lightmem.transfer.page_lock``'s constants too."""


@contextmanager
def _constants(module: Any, **values: Any) -> Iterator[None]:
    """``module``'s constants set to ``values`` inside, restored after."""
    previous = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f} GB/s" if seconds > 0 else "-"


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# -- registering N GiB ---------------------------------------------------------------------------


def _register_once(nbytes: int, prefault: bool, device: torch.device, huge: bool = False) -> tuple[float, float, float]:
    """(pre-fault s, register s, unregister s) of one buffer registered in one call."""
    start = time.perf_counter()
    buffer = page_lock.host_buffer(nbytes, huge_pages=huge)
    if prefault:
        page_lock.prefault(buffer)
    faulted = time.perf_counter()
    page_lock.register(buffer, device)
    registered = time.perf_counter()
    page_lock.unregister(buffer, device)
    return faulted - start, registered - faulted, time.perf_counter() - registered


def _register_chunks(
    nbytes: int, chunk_bytes: int, threads: int, prefault: bool, device: torch.device, huge: bool = False
) -> tuple[float, float]:
    """(wall s until every chunk is registered, unregister s), chunks made as the pool makes them."""
    with _constants(page_lock, REGISTER_THREADS=threads, PREFAULT=prefault, HUGE_PAGES=huge):
        registrar = page_lock.ChunkRegistrar()
        start = time.perf_counter()
        registrar.submit([chunk_bytes] * max(1, nbytes // chunk_bytes), device)
        registrar.join()
        wall = time.perf_counter() - start
    chunks = list(registrar.done)
    errors = [chunk.error for chunk in chunks if chunk.error]
    start = time.perf_counter()
    for chunk in chunks:
        chunk.give_back()
    if errors:
        raise RuntimeError(errors[0])
    return wall, time.perf_counter() - start


def _copy_bandwidth(during: Callable[[], None] | None, device: torch.device, seconds: float = 2.0) -> float:
    """GB/s of 1 GiB device-to-host copies into page-locked memory on this thread, for ``seconds``,
    while ``during`` runs on another thread (when given)."""
    source = torch.empty(GiB, dtype=torch.uint8, device=device)
    target = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    target.copy_(source)
    torch.cuda.synchronize()
    worker = threading.Thread(target=during) if during is not None else None
    if worker is not None:
        worker.start()
    copies, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        copies += 1
    elapsed = time.perf_counter() - start
    if worker is not None:
        worker.join()
    del source, target
    return copies * GiB / elapsed / 1e9


def registration_rows(nbytes: int, device: torch.device, deadline: float = float("inf")) -> list[list[str]]:
    """The microbenchmark's rows: how, pre-fault, register (wall), total, rate, unregister."""
    rows: list[list[str]] = []
    chunk = min(pool.CHUNK_MAX_BYTES, nbytes)
    variants: list[tuple[str, Callable[[], tuple[float, float, float]]]] = [
        ("one call, fresh memory (before the warm start)", lambda: _register_once(nbytes, False, device)),
        ("one call after pre-faulting (intra-op threads)", lambda: _register_once(nbytes, True, device)),
    ]
    variants.append(("one call after pre-faulting, huge pages", lambda: _register_once(nbytes, True, device, huge=True)))
    for threads, prefault, huge in (
        (page_lock.REGISTER_THREADS, True, False), (page_lock.REGISTER_THREADS, True, True), (8, True, True),
        (page_lock.REGISTER_THREADS, False, False), (1, True, False), (8, True, False),
    ):  # fmt: skip
        name = (
            f"{chunk // MiB} MiB chunks, {threads} thread(s), {'pre-faulted' if prefault else 'not pre-faulted'}"
            + (", huge pages" if huge else "")
        )
        variants.append((name, lambda t=threads, p=prefault, h=huge: (0.0, *_register_chunks(nbytes, chunk, t, p, device, h))))
    for name, run in variants:
        if time.monotonic() > deadline:
            rows.append([name, "skipped: time budget", "", "", "", ""])
            continue
        try:
            fault_s, register_s, unregister_s = run()
        except Exception as error:  # a refused registration: say so in the table, measure the rest
            rows.append([name, f"failed: {error}", "", "", "", ""])
            continue
        total = fault_s + register_s
        rows.append([
            name, f"{fault_s:.2f} s" if fault_s else "-", f"{register_s:.2f} s", f"{total:.2f} s",
            _rate(nbytes, total), f"{unregister_s:.2f} s",
        ])  # fmt: skip
    return rows


def interference_rows(nbytes: int, device: torch.device) -> list[list[str]]:
    """Copy bandwidth on the main thread alone and while chunks are registered in the background."""
    chunk = min(pool.CHUNK_MAX_BYTES, nbytes)
    alone = _copy_bandwidth(None, device)
    beside = _copy_bandwidth(lambda: _register_chunks(nbytes, chunk, page_lock.REGISTER_THREADS, True, device), device)
    return [
        ["alone", f"{alone:.1f} GB/s"],
        [f"while {nbytes / GiB:.0f} GiB are page-locked in {chunk // MiB} MiB chunks", f"{beside:.1f} GB/s"],
    ]


# -- the first steps -----------------------------------------------------------------------------


class SinChain(nn.Module):
    """``saves`` sines in a row over a ``numel``-element tensor: each saves its input, so a step
    holds ``(saves + 1) * 4 * numel`` bytes of saved activations (the input times a weight too)."""

    def __init__(self, numel: int, saves: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(numel))
        self.saves = saves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.weight
        for _ in range(self.saves):
            y = y.sin()
        return y.sum()


def _chain(gib: float, tensor_mib: int, device: torch.device) -> tuple[SinChain, torch.Tensor]:
    numel = tensor_mib * MiB // 4
    saves = max(1, round(gib * GiB / (tensor_mib * MiB)) - 1)
    generator = torch.Generator(device=device).manual_seed(0)
    return SinChain(numel, saves).to(device), torch.randn(numel, device=device, generator=generator)


def reference_grad(gib: float, tensor_mib: int, device: torch.device) -> torch.Tensor:
    """The weight's gradient of one step without lightmem (every mode's last step must equal it)."""
    model, x = _chain(gib, tensor_mib, device)
    model(x).backward()
    grad = model.weight.grad.clone()
    del model, x
    _release()
    return grad


def run_mode(
    mode: str, gib: float, tensor_mib: int, steps: int, device: torch.device, reference: torch.Tensor | None = None
) -> dict[str, Any]:
    """``steps`` training steps of a ``gib`` GiB offload in ``mode``: step seconds and page-locking."""
    model, x = _chain(gib, tensor_mib, device)
    numel, saves = x.numel(), model.saves
    step_bytes = (saves + 1) * numel * 4
    window = f"{max(2 * tensor_mib, 1024)}MiB"
    off = offload_activations(
        model, min_bytes="1MiB", host_budget=0.8, prefetch=window, max_inflight_bytes=window
    )  # fmt: skip
    times: list[float] = []
    with _constants(pool, **_SETTINGS[mode]), _constants(page_lock, **_PAGE_LOCK_SETTINGS.get(mode, {})):
        before = page_lock.registration_stats()
        start = time.perf_counter()
        if mode.startswith("prepared"):
            off.prepare_host(step_bytes)
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            with off:
                loss = model(x)
            loss.backward()
            torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - start)
            start = now
        stats = off.stats
        after = page_lock.registration_stats()
        exact = "-" if reference is None else ("yes" if torch.equal(model.weight.grad, reference) else "NO")
        held = off.host_bytes_held
        start = time.perf_counter()
        off.release_host_memory()
        release_s = time.perf_counter() - start
    del off, model, x
    _release()
    steady = statistics.median(times[3:]) if len(times) > 3 else min(times)
    return {
        "mode": mode, "times": times, "steady": steady, "step_bytes": step_bytes,
        "page_lock_s": (after.registration_s + after.prefault_s) - (before.registration_s + before.prefault_s),
        "wait_s": after.blocked_s - before.blocked_s, "registrations": after.registrations - before.registrations,
        "held": held, "offloaded": stats.offloaded_bytes, "kept": stats.budget_kept_bytes + stats.kept_bytes,
        "release_s": release_s, "exact": exact,
    }  # fmt: skip


def step_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        times = r["times"] + [float("nan")] * 4
        first = max(times[0], times[1]) if len(r["times"]) > 1 else times[0]
        rows.append([
            r["mode"], *(f"{t:.2f} s" for t in times[:4]), f"{r['steady']:.2f} s", f"{times[0] / r['steady']:.1f}x",
            f"{first / r['steady']:.1f}x", f"{r['page_lock_s']:.2f} s", f"{r['wait_s']:.2f} s", str(r["registrations"]),
            f"{r['held'] / GiB:.1f} GiB", f"{r['offloaded'] / GiB:.1f} GiB", f"{r['release_s']:.2f} s", r["exact"],
        ])  # fmt: skip
    return rows


STEP_HEADERS = [
    "mode", "step 0", "step 1", "step 2", "step 3", "steady (median)", "step 0 / steady", "worst of 0-1 / steady",
    "page-locking (threads summed)", "training thread waited", "registrations", "host held", "offloaded (last step)",
    "release", "gradient bitwise equal",
]  # fmt: skip
REGISTRATION_HEADERS = ["how", "pre-fault", "register (wall)", "total", "rate", "unregister"]


def _estimate_mode_s(mode: str, gib: float, steps: int) -> float:
    """A deliberately pessimistic guess of a mode's seconds (pageable staging with page faults at
    1 GB/s, registration at 3 GB/s, a steady step at 10 GB/s each way), to keep within a budget."""
    nbytes = gib * GiB
    steady = 2 * nbytes / 10e9
    pageable = 2 * nbytes / 1e9
    register = 1.25 * nbytes / 3e9
    if mode.startswith("prepared"):
        return register + steps * steady
    return pageable + register + steps * steady


def selfcheck_section(budget_s: float = 60.0, gib: float = 8.0, micro_gib: float = 4.0, steps: int = 5) -> str:
    """Markdown for ``python -m lightmem.selfcheck``: what fits in ``budget_s`` seconds of the
    microbenchmark and of the first steps (``prepared`` first, then ``before``, then ``boundary``)."""
    if not torch.cuda.is_available():
        return f"## Warm start\n\n{NOTHING_TO_MEASURE}.\n"
    device = torch.device("cuda", torch.cuda.current_device())
    deadline = time.monotonic() + budget_s
    lines = [
        "## Warm start: page-locking host memory ahead of need",
        "",
        f"{hardware()}; `REGISTER_THREADS={page_lock.REGISTER_THREADS}`, `PREFAULT={page_lock.PREFAULT}`, "
        f"`HUGE_PAGES={page_lock.HUGE_PAGES}` (the kernel's transparent huge pages: "
        f"{page_lock.transparent_huge_pages()}), "
        f"chunks {pool.CHUNK_FIRST_BYTES // MiB} MiB doubling to {pool.CHUNK_MAX_BYTES // MiB} MiB; "
        f"time budget {budget_s:.0f} s.",
        "",
    ]
    micro = int(micro_gib * GiB)
    if micro and time.monotonic() + 8 * 1.25 * micro / 3e9 < deadline:
        rows = registration_rows(micro, device, deadline)
        lines += [f"Registering {micro_gib:g} GiB of fresh host memory:", "", markdown_table(rows, REGISTRATION_HEADERS), ""]
    else:
        lines += [f"Registering {micro_gib:g} GiB: skipped (time budget).", ""]
    results = []
    reference = reference_grad(gib, 256, device)
    for mode in ("prepared", "prepared-huge", "before", "boundary"):
        if time.monotonic() + _estimate_mode_s(mode, gib, steps) > deadline:
            lines.append(f"Mode `{mode}` at {gib:g} GiB: skipped (time budget).")
            continue
        results.append(run_mode(mode, gib, 256, steps, device, reference))
    if results:
        lines += [
            "", f"The first steps of a {gib:g} GiB offload (a chain of `sin`, 256 MiB per saved tensor):", "",
            markdown_table(step_rows(results), STEP_HEADERS), "",
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=16.0, help="saved activations per step (default 16)")
    parser.add_argument("--tensor-mib", type=int, default=256, help="bytes of each saved tensor (default 256 MiB)")
    parser.add_argument("--steps", type=int, default=6, help="steps per mode (default 6)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--micro-gib", type=float, default=8.0, help="registration microbenchmark size (0: skip)")
    parser.add_argument("--budget-s", type=float, default=None, help="print selfcheck_section(budget_s) instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NOTHING_TO_MEASURE)
        return 0
    if args.budget_s is not None:
        print(selfcheck_section(args.budget_s))
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(hardware(), flush=True)
    print(
        f"REGISTER_THREADS={page_lock.REGISTER_THREADS} PREFAULT={page_lock.PREFAULT} "
        f"HUGE_PAGES={page_lock.HUGE_PAGES} (THP: {page_lock.transparent_huge_pages()}) "
        f"chunks {pool.CHUNK_FIRST_BYTES // MiB} MiB doubling to {pool.CHUNK_MAX_BYTES // MiB} MiB",
        flush=True,
    )
    micro = int(args.micro_gib * GiB)
    if micro:
        rows = registration_rows(micro, device)
        print(format_table(rows, REGISTRATION_HEADERS, title=f"Registering {args.micro_gib:g} GiB of fresh host memory"), flush=True)
        rows = interference_rows(micro, device)
        print(format_table(rows, ["main thread: 1 GiB device-to-host copies", "bandwidth"], title="Copies beside background registration"), flush=True)
    results = []
    reference = reference_grad(args.gib, args.tensor_mib, device)
    for mode in args.modes.split(","):
        results.append(run_mode(mode, args.gib, args.tensor_mib, args.steps, device, reference))
        print(format_table(step_rows(results[-1:]), STEP_HEADERS, title=f"{mode}: {args.gib:g} GiB per step"), flush=True)
    print(format_table(step_rows(results), STEP_HEADERS, title=f"The first steps of a {args.gib:g} GiB offload ({args.tensor_mib} MiB per saved tensor)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
