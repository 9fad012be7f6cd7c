"""``python -m lightmem.selfcheck``: lightmem's GPU tests and benchmarks on this machine's GPU.

Writes a markdown report (``--output``, default ``lightmem-selfcheck.md``) section by section as each
finishes, prints each section's verdict line as it goes (a run killed midway still shows how far it
got) and the report's path at the end. The report opens with the torch and CUDA versions, the GPU
and the host's page-locked copy bandwidth each way.

``--quick`` (the default when ``LIGHTMEM_SELFCHECK_QUICK=1``) is for whoever has a GPU for a quarter of
an hour: ``QUICK_SECTIONS``, each under its own time limit. The first four give the verdict on the
mechanisms within six minutes on an H100 (their limits add up to ``VERDICT_BUDGET_S``); the plan
sections follow, all within ``QUICK_BUDGET_S``:

- ``steady_offload``: 10 interleaved steps of a 16-block GPT (vocab 50257, batch 8, bf16) with
  lightmem's offload, torchtune's and ``save_on_cpu``: every step's time, page-locked bytes and
  registrations, peak allocated; fails on a step after warm-up over 1.25x the median
  (``benchmarks/offload_steady.py``);
- ``gpu_tests``: ``pytest tests/gpu``, each test at most ``QUICK_TEST_TIMEOUT_S`` (pytest-timeout,
  where installed);
- ``estimator``: ``estimate_memory``'s predicted peak against the measured one;
- ``swap_row``: the swap-out/in paper's ResNet-50 (seed 001) at one batch under a 12 GB cap: the
  plan's choice and the paper's swap row, their peaks and step times (``benchmarks/swap_table.py``);
- ``plans_hold``: ``LightMem(plan="auto")`` at 1x, 1.5x and 2x (then 5x and 8x) the largest batch
  without lightmem under a 16 GiB cap: accepted or refused before the forward, never out of
  memory; peaks and step times beside the predictions (``benchmarks/plans_hold.py``);
- ``warm_start``: the first steps of a large offload against the steady one, with the host memory
  page-locked ahead of need (``benchmarks/warm_start.py``).

Without ``--quick`` (``FULL_SECTIONS``): the same and more, unhurried: the steady offload, every GPU
test, 10 rounds of step time, the largest batch of a GPT sized to the GPU with and without lightmem (search on OOM), the
measured frontier (`benchmarks/frontier.py --measure`)
and several timed steps at it, and the paper's whole table (each row's largest batch measured).

``--sections gpu_tests,swap_row`` runs only those (a failed part again). A section that hangs or
fails is reported as such and the report goes on. Adding a section is one line: a ``Section``
(name, time limit, function, what it shows) in ``QUICK_SECTIONS`` or ``FULL_SECTIONS``.

Run it from a lightmem checkout: the tests and the GPT live in ``tests/`` and ``examples/``.
Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import lightmem
from lightmem import estimate_memory, offload_activations
from lightmem.config import format_bytes
from lightmem.devices import cuda_seconds
from lightmem.estimate.search import largest_fitting
from lightmem.tables import markdown_table
from lightmem.testing.sections import VERDICT, Section, run_report, verdict_of  # noqa: F401 (a section's verdict, as the report reads it)
from lightmem.transfer.pool import registration_stats

CHECKOUT = Path(__file__).resolve().parent.parent
NO_CUDA = "lightmem selfcheck: CUDA is not available here, so there is nothing to check (no report written)"
# The benchmark GPT: small enough for any GPU, big enough that copies take milliseconds.
BENCH_GPT = {"vocab": 8192, "dim": 1024, "depth": 8, "heads": 16, "seq": 1024, "dropout": 0.0}
BENCH_BATCH = 8
SECTION_TIMEOUT_S = 1200.0
GPU_TESTS_TIMEOUT_S = 1800.0
QUICK_TEST_TIMEOUT_S = 60
"""``--quick``: the most one GPU test may take (pytest-timeout's ``--timeout``)."""
QUICK_ENV = "LIGHTMEM_SELFCHECK_QUICK"
BANDWIDTH_BYTES = 256 * 2**20
"""The page-locked copy the report's header times each way."""


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


def gpu_tests(timeout_s: float = GPU_TESTS_TIMEOUT_S, per_test_timeout_s: float | None = None) -> str:
    """``pytest tests/gpu`` in a child process, killed at ``timeout_s``; with ``per_test_timeout_s``
    each test is stopped at that (pytest-timeout, where installed). The output so far is kept."""
    tests = CHECKOUT / "tests" / "gpu"
    if not tests.is_dir():
        return "## GPU tests\n\nNot run: `tests/gpu` is not here (run the selfcheck from a lightmem checkout).\n"
    # Short tracebacks, and the report keeps the last 150 lines: each failure's reason reaches it.
    command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider"]
    note = ""
    if per_test_timeout_s is not None:
        if importlib.util.find_spec("pytest_timeout") is not None:
            command.append(f"--timeout={per_test_timeout_s:.0f}")
            note = f" Each test at most {per_test_timeout_s:.0f} s (pytest-timeout)."
        else:
            note = " pytest-timeout is not installed: no limit per test, only the section's."
    command.append(str(tests))
    with tempfile.TemporaryFile(mode="w+") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a killed run keeps what it printed
        child = subprocess.Popen(command, cwd=CHECKOUT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True, env=env)  # fmt: skip
        try:
            returncode: int | None = child.wait(timeout=max(timeout_s - 5, 1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # the tests' own children (the sanitizer runs) too
            child.wait()
            returncode = None
        log.seek(0)
        output = log.read()
    lines = output.strip().splitlines() or ["(no output)"]
    tail = "\n".join(lines[-150:])
    if returncode is None:
        verdict = f"did not finish within {timeout_s:.0f} s"
    else:
        verdict = f"{lines[-1]} (exit code {returncode})"
    return f"## GPU tests\n\n{VERDICT}`pytest tests/gpu`: {verdict}\n\n{note.strip()}\n\n```\n{tail}\n```\n"


def page_locked_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> tuple[float, float]:
    """Bytes per second of a page-locked host -> device and device -> host copy (the best of
    ``repeats``, timed with CUDA events)."""
    host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for destination, source in ((device, host), (host, device)):
        best = min(cuda_seconds(lambda: destination.copy_(source, non_blocking=True)) for _ in range(repeats))
        rates.append(nbytes / best)
    return rates[0], rates[1]


def header(quick: bool = False, sections: Sequence[Section] = ()) -> str:
    """The report's top: versions, the GPU, the page-locked copy bandwidth each way, and the
    sections with their time limits."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        to_device, to_host = page_locked_bandwidth()
        link = f"{to_device / 2**30:.1f} GiB/s host to device, {to_host / 2**30:.1f} GiB/s device to host"
    except Exception as error:  # the report goes on without it
        link = f"not measured (`{type(error).__name__}: {error}`)"
    limits = ", ".join(f"`{section.name}` {section.limit_s:.0f} s" for section in sections)
    mode = "quick" if quick else "full"
    return (
        f"# lightmem selfcheck\n\nlightmem {lightmem.__version__}, torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}, Python {sys.version.split()[0]}; {props.name} "
        f"({format_bytes(props.total_memory)}), {torch.cuda.device_count()} device(s); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
        f"Page-locked copies of {format_bytes(BANDWIDTH_BYTES)}: {link}.\n\n"
        f"Mode: {mode}. Sections and their time limits: {limits} "
        f"({sum(section.limit_s for section in sections):.0f} s in all).\n"
    )


def _benchmark(name: str) -> Any:
    """A module of ``benchmarks/`` (the selfcheck runs from a checkout)."""
    benchmarks = str(CHECKOUT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    return importlib.import_module(name)


def swap_row(limit_s: float) -> str:
    """``benchmarks/swap_table.py``'s quick section: seed 001's ResNet-50 at one batch under a 12 GB cap."""
    return _benchmark("swap_table").quick_selfcheck_section(time_limit_s=limit_s - 10)


def plans_hold(limit_s: float) -> str:
    """``benchmarks/plans_hold.py``'s section: plan="auto" at 1x, 1.5x, 2x, 5x and 8x under a 16 GiB cap."""
    return _benchmark("plans_hold").selfcheck_section(limit_s)


def frontier_measured(limit_s: float) -> str:
    """``benchmarks/frontier.py --measure``: each frontier row's plan run beside its prediction."""
    return _benchmark("frontier").selfcheck_section(limit_s)


def warm_start(limit_s: float) -> str:
    """``benchmarks/warm_start.py``'s section: first steps of a large offload against a steady one."""
    return _benchmark("warm_start").selfcheck_section(budget_s=limit_s - 5, gib=8.0, micro_gib=2.0)


def steady_offload(limit_s: float) -> str:
    """``benchmarks/offload_steady.py``'s section: every step of a 16-block GPT's offload beside its peers."""
    return _benchmark("offload_steady").selfcheck_section(limit_s)


QUICK_SECTIONS: list[Section] = [
    Section("steady_offload", 60, steady_offload,
            "10 interleaved steps of a 16-block GPT: lightmem, torchtune, save_on_cpu; steady after warm-up?"),
    Section("gpu_tests", 125, lambda limit: gpu_tests(limit, QUICK_TEST_TIMEOUT_S),
            f"pytest tests/gpu, each test at most {QUICK_TEST_TIMEOUT_S} s (98 s in all on an H200)"),
    Section("estimator", 30, lambda limit: estimate_vs_measured(),
            "estimate_memory's predicted peak against the measured one, without and with offload"),
    Section("swap_row", 80, swap_row,
            "seed 001's ResNet-50 (fp32, SGD, 224x224) at batch 256 under a 12 GB cap: the plan's choice and offload"),
    Section("plans_hold", 190, plans_hold,
            "plan='auto' at 1x, 1.5x, 2x (then 5x, 8x) the largest batch without lightmem, 16 GiB cap"),
    Section("warm_start", 45, warm_start, "the first steps of an 8 GiB offload against a steady one"),
]  # fmt: skip
"""What ``--quick`` runs, in order: the first ``VERDICT_SECTIONS`` give the verdict on the
mechanisms within ``VERDICT_BUDGET_S``, the rest the plans' verdict; all within ``QUICK_BUDGET_S``."""
VERDICT_SECTIONS = 4
VERDICT_BUDGET_S = 300
"""The first sections' limits add up to no more than this: with Python's and CUDA's start, the
verdict on the mechanisms stays within six minutes."""
QUICK_BUDGET_S = 540
"""The sum of ``QUICK_SECTIONS``' time limits may not exceed this (a test checks it): the run, started
on a fresh machine (a minute or two), fits a quarter hour of device time. Give a new section its
limit out of another's."""


def full_sections(rounds: int = 10, limit_s: float = SECTION_TIMEOUT_S) -> list[Section]:
    """What a run without ``--quick`` does: every section unhurried."""
    return [
        Section("steady_offload", limit_s, steady_offload, "every step of a 16-block GPT's offload beside its peers"),
        Section("gpu_tests", GPU_TESTS_TIMEOUT_S, gpu_tests, "pytest tests/gpu"),
        Section("step_time", limit_s, lambda limit: benchmark_steps(rounds),
                f"step time and device memory of the benchmark GPT, {rounds} rounds"),
        Section("largest_batch", limit_s, lambda limit: largest_batches(),
                "the largest batch of a GPT sized to the GPU, with and without lightmem"),
        Section("estimator", limit_s, lambda limit: estimate_vs_measured(), "estimate_memory against the device"),
        Section("swap_table", limit_s, lambda limit: swap_table(), "the swap-out/in paper's ResNet-50 table"),
        Section("frontier", limit_s, frontier_measured,
                "the frontier of the GPT, ResNet-50 and GPT-2: each row's plan run beside its prediction"),
    ]  # fmt: skip


def select_sections(sections: Sequence[Section], names: str | None) -> list[Section]:
    """``sections`` named in the comma-separated ``names`` (all when ``None``), in their order."""
    if not names:
        return list(sections)
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = [section.name for section in sections]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise SystemExit(
            f"lightmem selfcheck: --sections: no section {', '.join(unknown)}; this mode has {', '.join(known)}"
        )
    return [section for section in sections if section.name in wanted]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightmem.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="lightmem-selfcheck.md", help="the markdown report to write")
    parser.add_argument("--quick", action="store_true", default=os.environ.get(QUICK_ENV) == "1",
                        help=f"the verdict in minutes: {', '.join(s.name for s in QUICK_SECTIONS)} "
                        f"(default when {QUICK_ENV}=1)")  # fmt: skip
    parser.add_argument("--sections", help="run only these sections (comma-separated names)")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (one step per mode each)")
    parser.add_argument(
        "--section-timeout-s", type=float, default=SECTION_TIMEOUT_S, help="time limit of each section (full mode)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    sections = QUICK_SECTIONS if args.quick else full_sections(args.rounds, args.section_timeout_s)
    sections = select_sections(sections, args.sections)
    if args.skip_tests:
        sections = [section for section in sections if section.name != "gpu_tests"]
    hung = run_report(sections, Path(args.output), lambda: header(args.quick, sections))
    if hung:  # a thread stuck in CUDA would keep the interpreter from exiting
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
