"""How long ``LightMem(plan="auto")`` takes to re-plan when a batch grows past the one planned for.

    python benchmarks/replan_time.py [--repeats 1] [--skip-large] [--gpt]

A re-plan is one ``lightmem.plan`` call on the new batch, before that batch's forward: the
training step waits for it. Each row is a batch of a growing sequence planned for at one budget, as
the callback plans them (the first is the fit's first plan); the time is the minimum of
``--repeats`` calls (other processes share the machine). Models: ``tiny_gpt`` of
``examples/estimate_factories.py`` on ``device="cpu"`` (checkpointing only, as on a CPU
training device), and the GPT-2-large-sized model (774M parameters, on the meta device,
bf16-mixed, ``device="cuda"``: a CPU trace corrected for CUDA); with ``--gpt``, the first plan
for each of the GPU runs' GPT batches (``plans_hold.py``, 16 GiB, H200 prices), then a re-plan of
the same batch at new prices, as ``plan="auto"`` re-plans once blocks are timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from _common import hardware, print_table  # noqa: E402

from examples.estimate_factories import gpt2_large, tiny_gpt  # noqa: E402
from lightmem import estimate_memory, plan  # noqa: E402
from lightmem.config import format_bytes  # noqa: E402
from lightmem.estimate.steps import STEPS  # noqa: E402


def _choice(chosen) -> str:
    offload = "nothing" if chosen.offload is None else (
        "everywhere" if chosen.offload.include is None else f"{len(chosen.offload.include)} blocks"
    )
    fits = "fits" if chosen.fits else "does not fit"
    return f"{fits}: {len(chosen.checkpoint)} checkpointed, offload {offload}, {chosen.evaluations} verified"


def _rows(name: str, factory, batches: list[int], budget: int | str, repeats: int, **common) -> list[list[str]]:
    rows = []
    for index, batch_size in enumerate(batches):
        model, batch, loss_fn = factory(batch_size)
        best, chosen = float("inf"), None
        for _ in range(repeats):
            started = time.perf_counter()
            chosen = plan(model, batch, budget, loss_fn, **common)
            best = min(best, time.perf_counter() - started)
        what = "first plan" if index == 0 else "re-plan"
        rows.append([name, f"{what}, batch {batch_size}", _choice(chosen), format_bytes(chosen.predicted_total_bytes), f"{best:.2f} s"])
    return rows


def _gpt_rows(repeats: int) -> list[list[str]]:
    """``benchmarks/plans_hold.py``'s 16-block GPT (meta device, bf16-mixed, fused AdamW) under 16 GiB,
    as ``plan="auto"`` plans it (``checkpoint_policy="auto"``, expandable segments), at 1x, 1.5x, 2x
    and 3x its largest batch without lightmem (11): each batch's first plan at the H200's table
    prices, then the same batch with products priced at 500 TFLOP/s (what a re-plan at measured
    prices costs: the baseline is priced again, the verified steps are remembered)."""
    import plans_hold

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    model = plans_hold._meta_model()
    common = {"optimizer": plans_hold.fused_adamw, "precision": "bf16-mixed", "device": "cuda", "checkpoint_policy": "auto",
              "gpu": "h200"}  # fmt: skip
    rows = []
    for batch_size, label in ((11, "1x"), (16, "1.5x"), (22, "2x"), (33, "3x")):
        best: dict[str, float] = {}
        chosen: dict[str, Any] = {}
        for _ in range(repeats):
            STEPS.clear()  # each repeat's first plan is a first plan: no step remembered
            for what, prices in (("first plan", {}), ("re-plan, new prices", {"flops_per_s": 500e12})):
                started = time.perf_counter()
                chosen[what] = plan(model, plans_hold._tokens(batch_size), "16GiB", plans_hold.gpt_loss, **prices, **common)
                best[what] = min(best.get(what, float("inf")), time.perf_counter() - started)
        for what, found in chosen.items():
            rows.append(["GPT, cuda bf16-mixed", f"{what}, batch {batch_size} ({label})", _choice(found),
                         format_bytes(found.predicted_total_bytes), f"{best[what]:.2f} s"])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model (seconds, not minutes)")
    parser.add_argument("--gpt", action="store_true", help="also the GPT of the GPU runs at 1x-3x, 16 GiB, H200 prices")
    args = parser.parse_args()
    model, batch, loss_fn = tiny_gpt(8)
    budget = estimate_memory(model, batch, loss_fn, device="cpu").total_bytes  # batch 8 fits as it is
    rows = _rows("tiny_gpt, cpu", tiny_gpt, [8, 12, 16], budget, args.repeats, device="cpu")
    if args.gpt:
        rows += _gpt_rows(args.repeats)
    if not args.skip_large:
        rows += _rows(
            "GPT-2 large, cuda bf16-mixed", gpt2_large, [8, 16, 24], "40GiB", args.repeats,
            precision="bf16-mixed", device="cuda",
        )  # fmt: skip
    print_table(
        f"Re-plan time ({hardware()}; min of {args.repeats} run(s); tiny_gpt budget {format_bytes(budget)}, "
        "GPT-2 large 40 GiB)",
        ["model", "plan", "choice", "predicted", "time"], rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
