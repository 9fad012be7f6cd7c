"""Activation offload at steady state: every step's time, lightmem beside its peers, and a verdict.

    python benchmarks/offload_steady.py                 # GPU: the H200 run's GPT (16 blocks, dim 1024,
                                                        # 1024 tokens, vocab 50257), batch 8, bf16, fused AdamW
    python benchmarks/offload_steady.py --device cpu    # CPU: a small GPT, devices=("cpu",), to try it out

One model and one optimizer; each round runs one step of every variant (the order rotates): no
hooks, lightmem's ``offload_activations`` at its defaults, the same without its windows
(``prefetch=0, max_inflight_bytes=0``: what the windows cost in peak memory and buy in time),
``save_on_cpu(pin_memory=True)`` and, where torchtune is installed, its
``OffloadActivations(use_streams=True)``. Each step is timed as
its forward and its backward plus optimizer step (synchronized between them). The tables show every
step of every variant, lightmem's page-locked bytes and its ``cudaHostRegister`` /
``cudaHostUnregister`` calls per step, and each variant's median, slowest step after warm-up and
peak allocated device memory.

The verdict (the last line; exit code 1 when it fails) holds lightmem to the promise of a steady
pool (docs/host-pool.md): after ``WARM_UP_STEPS`` steps no step more than ``SLOWEST_OVER_MEDIAN``
times its median, and no registration or release. It also states lightmem's median against the
peers' and against the link's floor (the bytes lightmem moved each way over the page-locked
bandwidth, measured here, where they exceed the forward's or the backward's compute without hooks).

On 2026-11-28 an H200 ran this GPT at 364, 1829, 357, 1597, 334, 1774 ms a step with lightmem (a
1.6 GB chunk page-locked at one step boundary and released at the next), against 426 ms for
torchtune and 428 ms for ``save_on_cpu``; ``tests/test_offload_pool_steady.py`` reproduces that
pattern on the CPU's simulated GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _common import hardware  # noqa: E402
from _torchtune import torchtune_cuda_offload_activations  # noqa: E402
from gpt_model import GPT  # noqa: E402

from lightmem import offload_activations  # noqa: E402
from lightmem.config import format_bytes  # noqa: E402
from lightmem.tables import format_table, markdown_table  # noqa: E402
from lightmem.transfer import page_lock  # noqa: E402

GPU_GPT = {"vocab": 50257, "dim": 1024, "depth": 16, "heads": 16, "seq": 1024, "dropout": 0.0}
GPU_BATCH = 8
CPU_GPT = {"vocab": 4096, "dim": 128, "depth": 4, "heads": 4, "seq": 128, "dropout": 0.0}
CPU_BATCH = 4
WARM_UP_STEPS = 2
"""Steps of each variant before the steady state: the first sizes lightmem's host pool, the second
may still wait for the chunks page-locked at the boundary after it."""
SLOWEST_OVER_MEDIAN = 1.25
"""The verdict fails on a step after warm-up slower than this times the variant's median."""
FLOOR_RATIO = 1.3
"""lightmem's median is held to at most this times the link's floor (stated, not failed on)."""
LIGHTMEM = "lightmem"
UNWINDOWED = "lightmem, no windows"
NO_HOOKS = "no hooks"


@dataclass
class Steps:
    """One variant's steps."""

    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    peak_allocated: list[int] = field(default_factory=list)
    forward_peak: list[int] = field(default_factory=list)
    """Peak allocated during the forward (the rest of ``peak_allocated`` is the backward's)."""
    pinned_bytes: list[int] = field(default_factory=list)
    registrations: list[int] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)

    @property
    def total_s(self) -> list[float]:
        return [forward + backward for forward, backward in zip(self.forward_s, self.backward_s)]

    def settled(self, values: list[Any]) -> list[Any]:
        return values[WARM_UP_STEPS:]


def variants(model: torch.nn.Module, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Each variant's context for one step (reused across steps, as a training loop would)."""
    on_cuda = device.type == "cuda"
    offloader = offload_activations(model, devices=("cuda",) if on_cuda else ("cpu",))
    # The same offload without its windows (no copy to host in flight, no reload ahead): its peak
    # against lightmem's says what the windows cost in device memory, its step what they buy.
    unwindowed = offload_activations(
        model, devices=("cuda",) if on_cuda else ("cpu",), prefetch=0, max_inflight_bytes=0
    )  # fmt: skip
    found: dict[str, Callable[[], Any]] = {
        NO_HOOKS: contextlib.nullcontext,
        LIGHTMEM: lambda: offloader,
        UNWINDOWED: lambda: unwindowed,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=on_cuda),
    }
    torchtune = torchtune_cuda_offload_activations() if on_cuda else None
    if torchtune is not None:
        context = torchtune(use_streams=True)
        found["torchtune"] = lambda: context
    return found


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def run(config: dict[str, Any], batch: int, steps: int, device: torch.device) -> tuple[dict[str, Steps], Any]:
    """``steps`` interleaved rounds; returns each variant's steps and lightmem's offloader."""
    torch.manual_seed(0)
    model = GPT(**config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    tokens = torch.randint(0, config["vocab"], (batch, config["seq"] + 1), device=device)
    contexts = variants(model, device)
    names = list(contexts)
    results = {name: Steps() for name in names}
    for index in range(steps):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            steps_of = results[name]
            before = page_lock.registration_stats()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16), contexts[name]():
                loss = _loss(model, tokens)
            _sync(device)
            middle = time.perf_counter()
            steps_of.forward_peak.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            steps_of.forward_s.append(middle - start)
            steps_of.backward_s.append(time.perf_counter() - middle)
            after = page_lock.registration_stats()
            steps_of.peak_allocated.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)
            steps_of.pinned_bytes.append(after.pinned_bytes)
            steps_of.registrations.append(after.registrations - before.registrations)
            steps_of.releases.append(after.unregistrations - before.unregistrations)
    return results, contexts[LIGHTMEM]()


def link_bytes_per_s(device: torch.device, nbytes: int = 2**30) -> tuple[float, float]:
    """Page-locked copies to the host and back, bytes per second (the best of three each)."""
    host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for destination, source in ((host, on_device), (on_device, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            destination.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        rates.append(nbytes / best)
    return rates[0], rates[1]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def step_rows(results: dict[str, Steps]) -> tuple[list[str], list[list[str]]]:
    names = list(results)
    headers = ["step", *(f"{name} (ms)" for name in names), "lightmem page-locked", "registered", "released"]
    ours = results[LIGHTMEM]
    rows = []
    for index in range(len(ours.forward_s)):
        rows.append([
            str(index), *(_ms(results[name].total_s[index]) for name in names),
            format_bytes(ours.pinned_bytes[index]), str(ours.registrations[index]), str(ours.releases[index]),
        ])  # fmt: skip
    return headers, rows


def summary_rows(results: dict[str, Steps], on_cuda: bool) -> tuple[list[str], list[list[str]]]:
    headers = [
        "variant", "median step", "forward", "backward", "slowest after warm-up", "vs no hooks",
        "peak allocated", "forward's peak",
    ]  # fmt: skip
    base = statistics.median(results[NO_HOOKS].settled(results[NO_HOOKS].total_s))
    rows = []
    for name, steps in results.items():
        total = steps.settled(steps.total_s)
        median = statistics.median(total)
        rows.append([
            name, f"{_ms(median)} ms", f"{_ms(statistics.median(steps.settled(steps.forward_s)))} ms",
            f"{_ms(statistics.median(steps.settled(steps.backward_s)))} ms", f"{max(total) / median:.2f}x",
            f"{median / base:.2f}x", format_bytes(max(steps.settled(steps.peak_allocated))) if on_cuda else "n/a",
            format_bytes(max(steps.settled(steps.forward_peak))) if on_cuda else "n/a",
        ])  # fmt: skip
    return headers, rows


def verdict(results: dict[str, Steps], offloader: Any, link: tuple[float, float] | None) -> tuple[bool, str]:
    """Whether lightmem was steady after warm-up, and the line that says so with its medians."""
    ours = results[LIGHTMEM]
    total = ours.settled(ours.total_s)
    median = statistics.median(total)
    slowest = max(total) / median
    calls = sum(ours.settled(ours.registrations)) + sum(ours.settled(ours.releases))
    steady = slowest <= SLOWEST_OVER_MEDIAN and calls == 0
    peers = [
        f"{name} {_ms(statistics.median(steps.settled(steps.total_s)))} ms"
        for name, steps in results.items() if name not in (LIGHTMEM, NO_HOOKS, UNWINDOWED)
    ]  # fmt: skip
    line = (
        f"{'PASS' if steady else 'FAIL'}: lightmem's slowest step after {WARM_UP_STEPS} warm-up steps is "
        f"{slowest:.2f}x its median (limit {SLOWEST_OVER_MEDIAN}x), with {calls} page-lock registrations and "
        f"releases after warm-up; its median {_ms(median)} ms against {', '.join(peers)}"
    )
    if link is not None:
        stats = offloader.stats  # its last step's
        none = results[NO_HOOKS]
        floor = max(statistics.median(none.settled(none.forward_s)), stats.offloaded_bytes / link[0]) + max(
            statistics.median(none.settled(none.backward_s)), stats.reloaded_bytes / link[1]
        )
        line += (
            f"; the link's floor for the {format_bytes(stats.offloaded_bytes)} moved each way is "
            f"{_ms(floor)} ms ({median / floor:.2f}x, goal at most {FLOOR_RATIO}x)"
        )
    return steady, line + "."


def report(results: dict[str, Steps], offloader: Any, device: torch.device, markdown: bool) -> tuple[bool, str]:
    on_cuda = device.type == "cuda"
    link = link_bytes_per_s(device) if on_cuda else None
    table = markdown_table if markdown else format_table
    steps_headers, steps = step_rows(results)
    summary_headers, summary = summary_rows(results, on_cuda)
    steady, line = verdict(results, offloader, link)
    where = (
        f"page-locked copies {link[0] / 2**30:.1f} GiB/s to the host, {link[1] / 2**30:.1f} GiB/s back"
        if link is not None else "on the CPU (no link: lightmem with devices=('cpu',), save_on_cpu copies nothing)"
    )  # fmt: skip
    text = "\n\n".join([
        f"{hardware()}; {where}.", table(steps, steps_headers), table(summary, summary_headers), line,
    ])  # fmt: skip
    return steady, text


def selfcheck_section(
    limit_s: float, steps: int = 10, device: torch.device | None = None, config: dict[str, Any] = GPU_GPT,
    batch: int = GPU_BATCH,
) -> str:
    """Markdown for ``python -m lightmem.selfcheck --quick`` (its first section), its verdict first."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    start = time.monotonic()
    results, offloader = run(config, batch, steps, device)
    _, text = report(results, offloader, device, markdown=True)
    *body, line = text.split("\n\n")
    return (
        f"## Activation offload at steady state\n\n**Verdict:** {line}\n\nGPT {config}, batch {batch}, bf16 "
        f"autocast, fused AdamW; {steps} interleaved rounds ({time.monotonic() - start:.0f} s of {limit_s:.0f}).\n\n"
        + "\n\n".join(body) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=10, help=f"rounds (the first {WARM_UP_STEPS} are warm-up)")
    parser.add_argument("--batch", type=int, default=None, help=f"default {GPU_BATCH} on CUDA, {CPU_BATCH} on the CPU")
    args = parser.parse_args(argv)
    if args.steps <= WARM_UP_STEPS:
        parser.error(f"--steps must be more than the {WARM_UP_STEPS} warm-up steps")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a quiet core: one intra-op thread
    config, batch = (GPU_GPT, GPU_BATCH) if device.type == "cuda" else (CPU_GPT, CPU_BATCH)
    results, offloader = run(config, args.batch or batch, args.steps, device)
    print(f"GPT {config}, batch {args.batch or batch}, bf16 autocast, fused AdamW, {args.steps} rounds")
    steady, text = report(results, offloader, device, markdown=False)
    print(text)
    return 0 if steady else 1


if __name__ == "__main__":
    sys.exit(main())
