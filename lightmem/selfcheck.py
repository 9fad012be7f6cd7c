"""``python -m lightmem.selfcheck``: lightmem's GPU tests and benchmarks on this machine's GPU.

Writes a markdown report (default ``lightmem-selfcheck.md``) and prints its path:

- ``tests/gpu`` (races forced with delayed streams, negative controls, the CUDA sanitizer);
- step time of a GPT with lightmem's offload, without hooks and with ``save_on_cpu``; the device
  peak of each; lightmem's prefetch hits, misses and waits;
- the largest batch of a GPT sized to the GPU, with and without lightmem (binary search on OOM);
- ``estimate_memory``'s predicted peak against the measured one.

Run it from a lightmem checkout: the tests and the GPT live in ``tests/`` and ``examples/``.
Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import lightmem
from lightmem import estimate_memory, offload_activations
from lightmem.config import format_bytes

CHECKOUT = Path(__file__).resolve().parent.parent
NO_CUDA = "lightmem selfcheck: CUDA is not available here, so there is nothing to check (no report written)"
# The benchmark GPT: small enough for any GPU, big enough that copies take milliseconds.
BENCH_GPT = {"vocab": 8192, "dim": 1024, "depth": 8, "heads": 16, "seq": 1024, "dropout": 0.0}
BENCH_BATCH = 8


def largest_fitting(fits: Callable[[int], bool], limit: int = 4096) -> int:
    """The largest n in [1, limit] with ``fits(n)``, assuming fits is monotone; 0 if 1 does not fit.

    Doubles until a size fails, then bisects between the last fit and the first failure.
    """
    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        trial = min(good * 2, limit)
        if trial == good:
            return good
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def relative(value: float, reference: float) -> str:
    """``value`` against ``reference`` as a signed percentage ("+12.5%")."""
    return f"{(value / reference - 1) * 100:+.1f}%"


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


def benchmark_steps(steps: int = 10) -> str:
    """Step time, device peak and offload counters of the benchmark GPT in each mode."""
    model = _gpt(BENCH_GPT)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = _tokens(BENCH_GPT, BENCH_BATCH)
    rows, counters = [], ""
    for name, context in _contexts(model).items():
        for _ in range(3):  # warm-up: optimizer state, pinned buffers, cuBLAS
            _step(model, optimizer, tokens, context())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            _step(model, optimizer, tokens, context())
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rows.append((name, statistics.median(times), torch.cuda.max_memory_allocated()))
        if name == "lightmem offload":
            stats = context().stats  # the last step's forward and backward
            hits, misses = stats.prefetch_hits, stats.prefetch_misses
            counters = markdown_table(
                ["offloaded", "reloaded", "prefetch hits", "prefetch misses", "hit rate", "compute waited"],
                [(format_bytes(stats.offloaded_bytes), format_bytes(stats.reloaded_bytes), hits, misses,
                  f"{hits / max(hits + misses, 1):.0%}", f"{stats.wait_s * 1e3:.2f} ms")],
            )  # fmt: skip
    base_time, base_peak = rows[0][1], rows[0][2]
    table = markdown_table(
        ["mode", "median step", "vs no hooks", "device peak", "vs no hooks"],
        [(name, f"{t * 1e3:.1f} ms", relative(t, base_time), format_bytes(peak), relative(peak, base_peak))
         for name, t, peak in rows],
    )  # fmt: skip
    return (
        f"## Step time and device peak\n\nGPT {BENCH_GPT}, batch {BENCH_BATCH}, AdamW, fp32; median of "
        f"{steps} steps after 3 warm-up steps; peak = `torch.cuda.max_memory_allocated` over those steps.\n\n"
        f"{table}\n\nlightmem's counters for its last step:\n\n{counters}\n"
    )


def sized_gpt() -> dict[str, int | float]:
    """The benchmark GPT made deep enough that its training state is ~1/8 of device memory."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    dim = int(BENCH_GPT["dim"])
    state_bytes_per_layer = 16 * 12 * dim * dim  # weights, gradients, AdamW's two moments, fp32
    return {**BENCH_GPT, "depth": max(2, min(64, total // 8 // state_bytes_per_layer))}


def largest_batches(limit: int = 1024) -> str:
    config = sized_gpt()
    rows = []
    for name in ("no hooks", "lightmem offload"):
        model = _gpt(config)
        optimizer = torch.optim.AdamW(model.parameters())
        context = _contexts(model)[name]

        def fits(batch: int) -> bool:
            try:
                for _ in range(2):  # the second step is the steady state: optimizer state alive
                    _step(model, optimizer, _tokens(config, batch), context())
                torch.cuda.synchronize()
                return True
            except torch.cuda.OutOfMemoryError:
                return False
            finally:
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()

        start = time.perf_counter()
        rows.append((name, largest_fitting(fits, limit), f"{time.perf_counter() - start:.0f} s"))
        del model, optimizer, context
        gc.collect()
        torch.cuda.empty_cache()
    table = markdown_table(["mode", "largest batch", "search took"], rows)
    return (
        f"## Largest batch\n\nGPT {config} (training state ~1/8 of device memory), AdamW, fp32, two "
        f"steps per trial, searched up to {limit}.\n\n{table}\n"
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
    table = markdown_table(["mode", "predicted peak", "measured peak", "prediction error"], rows)
    return f"## Estimator against the device\n\nGPT {BENCH_GPT}, batch {BENCH_BATCH}, AdamW, fp32.\n\n{table}\n"


def gpu_tests() -> str:
    tests = CHECKOUT / "tests" / "gpu"
    if not tests.is_dir():
        return "## GPU tests\n\nNot run: `tests/gpu` is not here (run the selfcheck from a lightmem checkout).\n"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", str(tests)],
        cwd=CHECKOUT, capture_output=True, text=True,
    )  # fmt: skip
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    parts = [header()]
    if not args.skip_tests:
        parts.append(gpu_tests())
    for section in (benchmark_steps, largest_batches, estimate_vs_measured):
        try:
            parts.append(section())
        except Exception as error:  # one failing benchmark must not hide the others' figures
            parts.append(f"## {section.__name__}\n\nFailed: `{type(error).__name__}: {error}`\n")
        gc.collect()
        torch.cuda.empty_cache()
    output = Path(args.output)
    output.write_text("\n".join(parts))
    print(f"lightmem selfcheck: report written to {output.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
