"""The swap-out/in paper's ResNet-50 table beside lightmem's predictions (and, on a GPU, measurements).

The paper lightmem grew from (Meng et al., "Training Deeper Models by GPU Memory Optimization on
TensorFlow", NIPS 2017 ML Systems Workshop) trains ResNet-50 on a 12 GB GPU and raises the
largest batch from 144 to 664 by swapping feature maps to host memory. This script asks
lightmem's estimator the same question for each configuration: the largest batch of ResNet-50
(fp32, SGD, 224x224 images, the layout torchvision uses) whose predicted step peak plus the
1 GiB overhead allowance fits 12 GB, and what the planner picks at the largest batch it finds.

    python benchmarks/swap_table.py              # predictions (fake tensors: any machine, ~2 min)
    python benchmarks/swap_table.py --measure    # also measured on this machine's GPU

``selfcheck_section()`` is what ``python -m lightmem.selfcheck`` calls on a GPU: the same rows,
each configuration's largest batch also found by real training steps (``measured_rows``: two per
trial, out-of-memory as the verdict) with the caching allocator capped at the budget less the
same overhead allowance. ``quick_selfcheck_section()`` is what ``--quick`` calls: one row at one
batch (the plan's choice at ``QUICK_BATCH``), a few timed steps, within a time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))

from _common import hardware  # noqa: E402
from examples.estimate_factories import ResNet, classification_loss, resnet50  # noqa: E402
from lightmem import apply_checkpointing, max_batch_size, offload_activations, plan  # noqa: E402
from lightmem.config import format_bytes, parse_size  # noqa: E402
from lightmem.estimate.search import largest_fitting  # noqa: E402
from lightmem.tables import format_table  # noqa: E402

BUDGET = "12GB"
OVERHEAD = "1GiB"
MIN_BYTES = "1MiB"
PAPER = {"baseline": 144, "offload": 664}
"""The paper's measured largest batches (TensorFlow, 12 GB GPU); it has no checkpointing rows."""


@dataclass(frozen=True)
class Row:
    """One configuration of the table: lightmem's flags for it."""

    name: str
    what: str
    offload: bool = False
    checkpoint: tuple[str, ...] = ()
    offload_include: tuple[str, ...] | None = None

    def flags(self) -> dict[str, Any]:
        include = None if self.offload_include is None else list(self.offload_include)
        return {
            "offload": {"min_bytes": MIN_BYTES, "include": include} if self.offload else None,
            "checkpoint": list(self.checkpoint) or None,
        }


ROWS = (
    Row("baseline", "nothing"),
    Row("offload", f"offload every saved tensor of at least {MIN_BYTES}", offload=True),
    Row("checkpoint", "checkpoint every Bottleneck block", checkpoint=("Bottleneck",)),
    Row("checkpoint + offload", "both of the above", offload=True, checkpoint=("Bottleneck",)),
)


def predicted_rows(budget: str = BUDGET, limit: int = 4096) -> list[tuple[Row, int]]:
    """Each row's predicted largest batch, the plan's choice last."""
    model, batch, loss_fn = resnet50(32)
    common: dict[str, Any] = {
        "optimizer": "sgd", "device": "cuda", "overhead_bytes": OVERHEAD, "limit": limit,
    }  # fmt: skip
    rows = []
    for row in ROWS:
        search = max_batch_size(model, batch, budget, loss_fn, **common, **row.flags())
        rows.append((row, search.baseline if row.name == "baseline" else search.configured or 0))
    planned = max_batch_size(model, batch, budget, loss_fn, plan=True, offload={"min_bytes": MIN_BYTES}, **common)
    chosen = planned.plan
    if chosen is not None and chosen.fits:
        include = chosen.offload.include if chosen.offload is not None else None
        row = Row("plan's choice", "; ".join(chosen.parts()) or "nothing", offload=chosen.offload is not None,
                  checkpoint=tuple(chosen.checkpoint), offload_include=include)  # fmt: skip
        rows.append((row, planned.planned or 0))
    else:
        rows.append((Row("plan's choice", "nothing fits"), 0))
    return rows


def measured_rows(
    rows: list[tuple[Row, int]], budget: str = BUDGET, limit: int = 4096
) -> dict[str, tuple[int, str]]:
    """Each row's largest batch on this machine's GPU, by real steps (CUDA only), by row name.

    The caching allocator is capped at ``budget`` less the 1 GiB overhead allowance (what the
    estimate's peak must fit), so the figure compares with the prediction; each search starts
    at the row's predicted batch. Offload needs pinned host memory for the whole batch's feature
    maps (about 80 MB per ResNet-50 image): ``offload_activations``' default host budget is half
    the machine's RAM, and past it tensors stay on the GPU.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("measured_rows needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    cap = parse_size(budget, flag="budget") - parse_size(OVERHEAD, flag="overhead")
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    found: dict[str, tuple[int, str]] = {}
    try:
        for row, guess in rows:
            torch.manual_seed(0)
            model = ResNet().to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            handle = apply_checkpointing(model, list(row.checkpoint)) if row.checkpoint else None
            offloader = (
                offload_activations(model, min_bytes=MIN_BYTES, include=row.offload_include) if row.offload else None
            )

            def fits(size: int, model: torch.nn.Module = model, optimizer: Any = optimizer, offloader: Any = offloader) -> bool:
                try:
                    for _ in range(2):  # the second step is the steady state
                        images = torch.randn(size, 3, 224, 224, device=device)
                        labels = torch.randint(0, 1000, (size,), device=device)
                        with offloader if offloader is not None else contextlib.nullcontext():
                            loss = classification_loss(model, (images, labels))
                        loss.backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    torch.cuda.synchronize()
                    return True
                except torch.cuda.OutOfMemoryError:
                    return False
                finally:
                    optimizer.zero_grad(set_to_none=True)
                    gc.collect()
                    torch.cuda.empty_cache()

            started = time.perf_counter()
            # The estimator's search, with a real step's out of memory as the only verdict.
            batch, _ = largest_fitting(lambda size: 0 if fits(size) else 1, 0, guess or 128, limit)
            found[row.name] = (batch, f"search took {time.perf_counter() - started:.0f} s")
            if handle is not None:
                handle.remove()
            del model, optimizer, offloader
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return found


def table(predicted: list[tuple[Row, int]], measured: dict[str, tuple[int, str]] | None = None) -> str:
    headers = ["configuration", "paper (TensorFlow, measured)", "lightmem (predicted)"]
    if measured is not None:
        headers.append(f"lightmem (measured, {torch.cuda.get_device_name()})")
    headers.append("what lightmem does")
    rows = []
    for row, batch in predicted:
        cells = [row.name, str(PAPER.get(row.name, "-")), str(batch)]
        if measured is not None:
            cells.append(str(measured.get(row.name, ("-", ""))[0]))
        rows.append([*cells, row.what])
    return format_table(rows, headers, title=f"ResNet-50, fp32, SGD, 224x224: largest batch on a {BUDGET} GPU")


def selfcheck_section(budget: str = BUDGET) -> str:
    """A markdown section for ``python -m lightmem.selfcheck`` on a GPU: the paper's figures,
    lightmem's predictions and this GPU's measurements, row by row."""
    predicted = predicted_rows(budget)
    measured = measured_rows(predicted, budget)
    lines = [
        f"## ResNet-50 on a {budget} GPU: the swap-out/in paper's table",
        "",
        f"fp32, SGD, 224x224; predicted: estimator peak + {OVERHEAD} allowance <= {budget}; measured: "
        f"two real steps per trial on {torch.cuda.get_device_name()}, caching allocator capped at "
        f"{budget} less {OVERHEAD}, out of memory as the verdict.",
        "",
        "| configuration | paper (TensorFlow, measured) | lightmem predicted | lightmem measured | what lightmem does | search |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row, batch in predicted:
        found, note = measured.get(row.name, ("-", ""))
        lines.append(f"| {row.name} | {PAPER.get(row.name, '-')} | {batch} | {found} | {row.what} | {note} |")
    return "\n".join(lines) + "\n"


QUICK_BATCH = 256
"""The quick selfcheck's batch: above the 143 that fit a 12 GiB cap without lightmem on an H100
(../shared/gpu-runs/2026-11-27), below the paper's 664 with swapping."""


def _timed_steps(
    row: Row, batch: int, steps: int, deadline: float, device: torch.device
) -> tuple[list[float], str, dict[str, Any], str]:
    """Up to ``steps`` real steps of ``row``'s configuration at ``batch``, each timed, stopping when
    the next would pass ``deadline`` (``time.perf_counter()``): (step times, what stopped it, the
    allocator's statistics, bytes offloaded per step)."""
    torch.manual_seed(0)
    model = ResNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = apply_checkpointing(model, list(row.checkpoint)) if row.checkpoint else None
    offloader = offload_activations(model, min_bytes=MIN_BYTES, include=row.offload_include) if row.offload else None
    times: list[float] = []
    outcome = ""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        for step in range(steps):
            if times and time.perf_counter() + times[-1] > deadline:
                outcome = f"stopped after {step} steps (time limit)"
                break
            images = torch.randn(batch, 3, 224, 224, device=device)
            labels = torch.randint(0, 1000, (batch,), device=device)
            torch.cuda.synchronize(device)
            begin = time.perf_counter()
            with offloader if offloader is not None else contextlib.nullcontext():
                loss = classification_loss(model, (images, labels))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - begin)
            del images, labels, loss
    except torch.cuda.OutOfMemoryError as error:
        outcome = f"OUT OF MEMORY at step {len(times) + 1}: {str(error).splitlines()[0]}"
    finally:
        if handle is not None:
            handle.remove()
    stats = torch.cuda.memory_stats(device)
    moved = format_bytes(offloader.stats.offloaded_bytes) if offloader is not None else "-"
    del model, optimizer, offloader
    gc.collect()
    torch.cuda.empty_cache()
    return times, outcome, stats, moved


def quick_selfcheck_section(
    batch: int = QUICK_BATCH, budget: str = BUDGET, steps: int = 4, time_limit_s: float = 80.0
) -> str:
    """One batch, for ``python -m lightmem.selfcheck --quick`` (CUDA only): the plan's choice for
    ``batch`` on a ``budget`` GPU and the paper's swap row (offload every saved tensor of at least
    ``MIN_BYTES``), each run for up to ``steps`` real steps with the caching allocator capped at
    ``budget`` less the overhead allowance, each step timed (offload's first steps page-lock host
    memory), while ``time_limit_s`` lasts; their device peaks and the bytes moved."""
    started = time.perf_counter()
    deadline = started + time_limit_s
    meta_model, example, loss_fn = resnet50(batch)
    chosen = plan(meta_model, example, budget, loss_fn, optimizer="sgd", device="cuda", overhead_bytes=OVERHEAD,
                  offload={"min_bytes": MIN_BYTES})  # fmt: skip
    planned_s = time.perf_counter() - started
    rows = [ROWS[1]]  # the paper's swap row
    if chosen.fits:
        include = chosen.offload.include if chosen.offload is not None else None
        rows.insert(0, Row("plan's choice", "; ".join(chosen.parts()) or "nothing", offload=chosen.offload is not None,
                           checkpoint=tuple(chosen.checkpoint), offload_include=include))  # fmt: skip
    device = torch.device("cuda", torch.cuda.current_device())
    cap = parse_size(budget, flag="budget") - parse_size(OVERHEAD, flag="overhead")
    total = torch.cuda.get_device_properties(device).total_memory
    table = [
        "| configuration | steps (each) | peak allocated | peak reserved | num_alloc_retries | offloaded per step | outcome |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    verdicts = []
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    try:
        for row in rows:
            if time.perf_counter() > deadline - 20:  # an offloaded first step alone takes that long
                table.append(f"| {row.name}: {row.what} | - | - | - | - | - | not run (time limit) |")
                verdicts.append(f"{row.name} not run")
                continue
            times, outcome, stats, moved = _timed_steps(row, batch, steps, deadline, device)
            step_times = ", ".join(f"{seconds:.2f} s" for seconds in times) or "-"
            table.append(
                f"| {row.name}: {row.what} | {step_times} | {format_bytes(stats.get('allocated_bytes.all.peak', 0))} | "
                f"{format_bytes(stats.get('reserved_bytes.all.peak', 0))} | {stats.get('num_alloc_retries', 0)} | "
                f"{moved} | {outcome or 'ran'} |"
            )
            failed = outcome.startswith("OUT OF MEMORY")
            verdicts.append(f"{row.name} {'FAILED (out of memory)' if failed else f'ran {len(times)} steps'}")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    plan_line = (
        f"the plan for batch {batch} within {budget} ({planned_s:.0f} s to plan): {'; '.join(chosen.parts()) or 'nothing'}, "
        f"predicted peak {format_bytes(chosen.predicted_peak_bytes)}"
        if chosen.fits else f"no plan fits batch {batch}: {chosen.reason}"
    )  # fmt: skip
    lines = [
        f"## ResNet-50 at batch {batch} on a {budget} GPU (seed 001's row, quick)",
        "",
        f"**Verdict:** {'; '.join(verdicts)}",
        "",
        f"fp32, SGD, 224x224 (the layout torchvision uses); {plan_line}. Run on "
        f"{torch.cuda.get_device_name(device)} with the caching allocator capped at {budget} less {OVERHEAD} "
        f"({format_bytes(cap)}); the paper reached 664 with swapping, and 143 fit without lightmem on an H100.",
        "",
        *table,
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also measure on this machine's GPU")
    parser.add_argument("--budget", default=BUDGET, help="the card's memory (default 12GB)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    predicted = predicted_rows(args.budget)
    took = time.perf_counter() - started
    measured = measured_rows(predicted, args.budget) if args.measure else None
    print(table(predicted, measured))
    print(
        f"\nPredicted: lightmem's estimator (fake tensors, device='cuda'), peak + {OVERHEAD} overhead "
        f"allowance <= {args.budget} ({format_bytes(parse_size(args.budget, flag='budget'))}); offload "
        f"min_bytes {MIN_BYTES}; checkpoint = every Bottleneck block; {took:.0f} s on {hardware()}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
