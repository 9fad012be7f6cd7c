"""``python -m lightmem.selfcheck``: lightmem's GPU tests and benchmarks on this machine's GPU.

Writes a markdown report (default ``lightmem-selfcheck.md``) section by section as each finishes,
and prints its path:

- ``tests/gpu`` (races forced with delayed streams, negative controls, the CUDA sanitizer, device
  memory in the GPU's order of execution, two GPUs where there are two);
- step time of a GPT with lightmem's offload, without hooks and with ``save_on_cpu``, the modes
  interleaved round by round (median and spread); each mode's device memory as
  ``max_memory_allocated``, ``max_memory_reserved``, ``active_bytes.all.peak`` and
  ``num_alloc_retries``; lightmem's prefetch hits, misses and waits; page-locked host bytes held
  and the time registration took;
- the largest batch of a GPT sized to the GPU, with and without lightmem (search on OOM), and
  several timed steps at that batch (a batch that fits only through the allocator's
  free-and-retry shows its cost there);
- ``estimate_memory``'s predicted peak against the measured one;
- the swap-out/in paper's ResNet-50 table (``benchmarks/swap_table.py``): each configuration's
  largest batch on a 12 GB budget as the paper measured it, as lightmem predicts it and as this
  GPU gives it, and the plan's choice.

Every section has a time limit (``--section-timeout-s``): one that hangs is reported as such and
the report goes on. Run it from a lightmem checkout: the tests and the GPT live in ``tests/`` and
``examples/``. Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import lightmem
from lightmem import estimate_memory, offload_activations
from lightmem.config import format_bytes
from lightmem.estimate.search import largest_fitting
from lightmem.offload.pool import registration_stats
from lightmem.tables import markdown_table

CHECKOUT = Path(__file__).resolve().parent.parent
NO_CUDA = "lightmem selfcheck: CUDA is not available here, so there is nothing to check (no report written)"
# The benchmark GPT: small enough for any GPU, big enough that copies take milliseconds.
BENCH_GPT = {"vocab": 8192, "dim": 1024, "depth": 8, "heads": 16, "seq": 1024, "dropout": 0.0}
BENCH_BATCH = 8
SECTION_TIMEOUT_S = 1200.0
GPU_TESTS_TIMEOUT_S = 1800.0


OUT_OF_MEMORY_BYTES = 1 << 62
"""What a batch that ran out of memory counts as in the search: more than any device has."""


def largest_batch(peak_bytes: Callable[[int], int | None], budget_bytes: int, limit: int = 4096) -> int:
    """The largest batch in [1, limit] that fits; 0 if 1 does not.

    ``peak_bytes(batch)`` is the device memory a batch's steps reserved, or ``None`` when they ran
    out of memory. The search is the estimator's (``lightmem.estimate.search.largest_fitting``):
    memory grows about linearly with the batch, so two batches that fit point at the answer.
    """

    def total_bytes(batch: int) -> int:
        peak = peak_bytes(batch)
        return OUT_OF_MEMORY_BYTES if peak is None else peak

    return largest_fitting(total_bytes, budget_bytes, 1, limit)[0]


def relative(value: float, reference: float) -> str:
    """``value`` against ``reference`` as a signed percentage ("+12.5%")."""
    return f"{(value / reference - 1) * 100:+.1f}%"


def spread(times_s: Sequence[float]) -> str:
    """Median and range of step times in ms: "12.3 ms (11.9-13.0)"."""
    return f"{statistics.median(times_s) * 1e3:.1f} ms ({min(times_s) * 1e3:.1f}-{max(times_s) * 1e3:.1f})"


def run_with_time_limit(section: Callable[[], str], limit_s: float) -> tuple[str, bool]:
    """``section()``'s markdown, or a line saying it failed or did not finish within ``limit_s``.

    Returns (markdown, finished). A section that hangs keeps running on its daemon thread (a
    stuck CUDA call cannot be interrupted); the caller writes what it has and goes on.
    """
    result: list[str] = []

    def run() -> None:
        try:
            result.append(section())
        except Exception as error:  # one failing benchmark must not hide the others' figures
            result.append(f"## {section.__name__}\n\nFailed: `{type(error).__name__}: {error}`\n")

    worker = threading.Thread(target=run, name=f"selfcheck-{section.__name__}", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        return f"## {section.__name__}\n\nDid not finish within {limit_s:.0f} s (time limit); skipped.\n", False
    return result[0], True


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    return markdown_table([[str(cell) for cell in row] for row in rows], headers)


# -- the GPU work --------------------------------------------------------------------------------


def _gpt(config: dict[str, int | float]) -> torch.nn.Module:
    examples = str(CHECKOUT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from gpt_model import GPT

    torch.manual_seed(0)
    return GPT(**config).cuda()


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _tokens(config: dict[str, int | float], batch: int) -> torch.Tensor:
    return torch.randint(0, int(config["vocab"]), (batch, int(config["seq"]) + 1), device="cuda")


def _contexts(model: torch.nn.Module) -> dict[str, Callable[[], Any]]:
    offloader = offload_activations(model)
    return {
        "no hooks": contextlib.nullcontext,
        "lightmem offload": lambda: offloader,
        "save_on_cpu(pin_memory=True)": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
    }


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, context: Any) -> None:
    with context:
        loss = _loss(model, tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _memory_row(name: str) -> tuple[Any, ...]:
    """The device memory of what ran since the last ``reset_peak_memory_stats``."""
    stats = torch.cuda.memory_stats()
    return (
        name, format_bytes(torch.cuda.max_memory_allocated()), format_bytes(torch.cuda.max_memory_reserved()),
        format_bytes(stats.get("active_bytes.all.peak", 0)), stats.get("num_alloc_retries", 0),
    )  # fmt: skip


MEMORY_HEADERS = ["mode", "max_memory_allocated", "max_memory_reserved", "active_bytes.all.peak", "num_alloc_retries"]


def _measure_memory(model: torch.nn.Module, optimizer: Any, tokens: torch.Tensor, name: str, context: Any) -> tuple:
    """One mode's steady-state step from an empty cache: two warm-up steps, then one measured."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    for _ in range(2):
        _step(model, optimizer, tokens, context())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # also num_alloc_retries
    _step(model, optimizer, tokens, context())
    torch.cuda.synchronize()
    return _memory_row(name)


def benchmark_steps(rounds: int = 10) -> str:
    """Step time (modes interleaved round by round), device memory and offload counters."""
    model = _gpt(BENCH_GPT)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = _tokens(BENCH_GPT, BENCH_BATCH)
    contexts = _contexts(model)
    names = list(contexts)
    memory = [_measure_memory(model, optimizer, tokens, name, contexts[name]) for name in names]
    for name in names:  # warm-up of each mode: optimizer state, pinned buffers, cuBLAS
        _step(model, optimizer, tokens, contexts[name]())
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:  # rotate who goes first
            torch.cuda.synchronize()
            start = time.perf_counter()
            _step(model, optimizer, tokens, contexts[name]())
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    stats = contexts["lightmem offload"]().stats  # its last step's forward and backward
    hits, misses = stats.prefetch_hits, stats.prefetch_misses
    counters = _table(
        ["offloaded", "reloaded", "prefetch hits", "prefetch misses", "hit rate", "compute waited", "in-flight waits"],
        [(format_bytes(stats.offloaded_bytes), format_bytes(stats.reloaded_bytes), hits, misses,
          f"{hits / max(hits + misses, 1):.0%}", f"{stats.wait_s * 1e3:.2f} ms", stats.inflight_waits)],
    )  # fmt: skip
    base = statistics.median(times[names[0]])
    timing = _table(
        ["mode", "median step (min-max)", "vs no hooks"],
        [(name, spread(times[name]), relative(statistics.median(times[name]), base)) for name in names],
    )
    registration = registration_stats()
    host = _table(
        ["page-locked bytes held", "lightmem host pool held", "registrations", "registration time", "failures"],
        [(format_bytes(registration.pinned_bytes), format_bytes(contexts["lightmem offload"]().host_bytes_held),
          registration.registrations, f"{registration.registration_s * 1e3:.1f} ms", registration.failures)],
    )  # fmt: skip
    return (
        f"## Step time and device memory\n\nGPT {BENCH_GPT}, batch {BENCH_BATCH}, AdamW, fp32.\n\n"
        f"Step time: {rounds} rounds, each running one step of every mode (the order rotates), after "
        f"one warm-up step per mode.\n\n{timing}\n\nDevice memory: for each mode alone, from an "
        "empty cache, the third step (peaks reset after two warm-up steps). `max_memory_allocated` "
        "drops a block at its free; reserved and active count blocks until the GPU has passed "
        f"their last use.\n\n{_table(MEMORY_HEADERS, memory)}\n\nlightmem's counters for its last "
        f"step:\n\n{counters}\n\nHost memory (page-locking happens at step boundaries, never "
        f"inside a saved-tensor hook):\n\n{host}\n"
    )


def sized_gpt() -> dict[str, int | float]:
    """The benchmark GPT made deep enough that its training state is ~1/8 of device memory."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    dim = int(BENCH_GPT["dim"])
    state_bytes_per_layer = 16 * 12 * dim * dim  # weights, gradients, AdamW's two moments, fp32
    return {**BENCH_GPT, "depth": max(2, min(64, total // 8 // state_bytes_per_layer))}


def largest_batches(limit: int = 1024, steps: int = 5) -> str:
    """The largest batch per mode (search on OOM), then ``steps`` timed steps at it."""
    config = sized_gpt()
    rows, at_largest = [], []
    for name in ("no hooks", "lightmem offload"):
        model = _gpt(config)
        optimizer = torch.optim.AdamW(model.parameters())
        context = _contexts(model)[name]

        def peak_bytes(batch: int) -> int | None:
            try:
                torch.cuda.reset_peak_memory_stats()
                for _ in range(2):  # the second step is the steady state: optimizer state alive
                    _step(model, optimizer, _tokens(config, batch), context())
                torch.cuda.synchronize()
                return torch.cuda.max_memory_reserved()
            except torch.cuda.OutOfMemoryError:
                return None
            finally:
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()

        start = time.perf_counter()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        batch = largest_batch(peak_bytes, total, limit)
        rows.append((name, batch, f"{time.perf_counter() - start:.0f} s"))
        if batch:
            tokens = _tokens(config, batch)
            _step(model, optimizer, tokens, context())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(steps):
                begin = time.perf_counter()
                _step(model, optimizer, tokens, context())
                torch.cuda.synchronize()
                times.append(time.perf_counter() - begin)
            at_largest.append((*_memory_row(f"{name}, batch {batch}"), spread(times)))
        del model, optimizer, context
        gc.collect()
        torch.cuda.empty_cache()
    search = _table(["mode", "largest batch", "search took"], rows)
    timed = _table([*MEMORY_HEADERS, f"step over {steps} steps: median (min-max)"], at_largest)
    return (
        f"## Largest batch\n\nGPT {config} (training state ~1/8 of device memory), AdamW, fp32, two "
        f"steps per trial, searched up to {limit}.\n\n{search}\n\nAt that batch, {steps} timed steps "
        "after one warm-up step (`num_alloc_retries` counts the allocator's free-and-retry, whose "
        f"synchronisations a batch that barely fits pays every step):\n\n{timed}\n"
    )


def estimate_vs_measured() -> str:
    rows = []
    for offload in (False, True):
        model = _gpt(BENCH_GPT)
        tokens = _tokens(BENCH_GPT, BENCH_BATCH)
        predicted = estimate_memory(model, tokens, _loss, optimizer="adamw", device="cuda", offload=offload)
        optimizer = torch.optim.AdamW(model.parameters())
        context = offload_activations(model) if offload else contextlib.nullcontext()
        _step(model, optimizer, tokens, context)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(model, optimizer, tokens, context)  # the steady-state step the estimator predicts
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
        rows.append(("lightmem offload" if offload else "no hooks", format_bytes(predicted.peak_bytes),
                     format_bytes(measured), relative(predicted.peak_bytes, measured)))  # fmt: skip
        del model, optimizer, context
        gc.collect()
        torch.cuda.empty_cache()
    table = _table(["mode", "predicted peak", "measured peak", "prediction error"], rows)
    return f"## Estimator against the device\n\nGPT {BENCH_GPT}, batch {BENCH_BATCH}, AdamW, fp32.\n\n{table}\n"


def swap_table() -> str:
    """``benchmarks/swap_table.py``'s section: the paper's ResNet-50 table, predicted and measured here."""
    benchmarks = str(CHECKOUT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import swap_table as table

    return table.selfcheck_section()


def gpu_tests(timeout_s: float = GPU_TESTS_TIMEOUT_S) -> str:
    tests = CHECKOUT / "tests" / "gpu"
    if not tests.is_dir():
        return "## GPU tests\n\nNot run: `tests/gpu` is not here (run the selfcheck from a lightmem checkout).\n"
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", str(tests)],
            cwd=CHECKOUT, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        tail = "\n".join(output.strip().splitlines()[-60:])
        return f"## GPU tests\n\n`pytest tests/gpu`: **did not finish within {timeout_s:.0f} s**\n\n```\n{tail}\n```\n"
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-60:])
    return f"## GPU tests\n\n`pytest tests/gpu`: **{summary}** (exit code {result.returncode})\n\n```\n{tail}\n```\n"


def header() -> str:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return (
        f"# lightmem selfcheck\n\nlightmem {lightmem.__version__}, torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}, {props.name} ({format_bytes(props.total_memory)}), "
        f"{torch.cuda.device_count()} device(s); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightmem.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="lightmem-selfcheck.md", help="the markdown report to write")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (one step per mode each)")
    parser.add_argument(
        "--section-timeout-s", type=float, default=SECTION_TIMEOUT_S, help="time limit of each section"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    output = Path(args.output)
    output.write_text(header())  # written as it goes: a hang still leaves a report
    sections: list[Callable[[], str]] = []
    if not args.skip_tests:
        sections.append(lambda: gpu_tests(args.section_timeout_s))
        sections[-1].__name__ = "gpu_tests"
    timed = lambda: benchmark_steps(args.rounds)  # noqa: E731
    timed.__name__ = "benchmark_steps"
    sections += [timed, largest_batches, estimate_vs_measured, swap_table]
    hung = False
    for section in sections:
        text, finished = run_with_time_limit(section, args.section_timeout_s + 60)
        hung = hung or not finished
        with output.open("a") as report:
            report.write("\n" + text)
        print(f"lightmem selfcheck: {section.__name__} {'done' if finished else 'timed out'}", flush=True)
        if finished:
            gc.collect()
            torch.cuda.empty_cache()
    print(f"lightmem selfcheck: report written to {output.resolve()}", flush=True)
    if hung:  # a thread stuck in CUDA would keep the interpreter from exiting
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
