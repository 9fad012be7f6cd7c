"""How long estimation, batch search and planning take on a GPT-2-large-sized model.

    python benchmarks/estimate_speed.py [--repeats 3] [--full-optimizer-step]

The model (774M parameters, 36 layers, width 1280, sequence 1024) lives on the meta device; the
step is bf16-mixed on device="cuda" (a CPU trace corrected for CUDA). Each call is timed
``--repeats`` times after one warm-up estimate; the table gives the minimum (other processes
share the machine) and the answer of each call, so a faster version can be checked to give the
same answers. ``--full-optimizer-step`` times the estimator as it was before the previous step's
optimizer state was created by one update per kind of parameter (a full fake ``optimizer.step()``),
for a before/after comparison on the same machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples.estimate_factories import gpt2_large  # noqa: E402
from lightmem import estimate_memory, max_batch_size, plan  # noqa: E402
from lightmem.config import format_bytes  # noqa: E402


def _timed(function, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--full-optimizer-step", action="store_true")
    args = parser.parse_args()
    if args.full_optimizer_step:
        from lightmem.estimate.trace import optimizers

        optimizers.create_state = lambda optimizer: optimizer.step()
    model, tokens, loss_fn = gpt2_large(16)
    common = {"precision": "bf16-mixed", "device": "cuda"}

    started = time.perf_counter()
    first = estimate_memory(model, tokens, loss_fn, **common)
    first_s = time.perf_counter() - started
    estimate_s, est = _timed(lambda: estimate_memory(model, tokens, loss_fn, **common), args.repeats)
    search_s, search = _timed(lambda: max_batch_size(model, tokens, "80GiB", loss_fn, **common), args.repeats)
    plan_s, chosen = _timed(lambda: plan(model, tokens, "40GiB", loss_fn, **common), args.repeats)
    assert first.peak_bytes == est.peak_bytes

    print(
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"min of {args.repeats} runs"
        + (", full fake optimizer step for the previous step's state" if args.full_optimizer_step else "")
    )
    print("| call | answer | time |")
    print("| --- | --- | --- |")
    print(
        f"| `estimate_memory`, batch 16 | peak {format_bytes(est.peak_bytes)} | "
        f"{first_s:.1f} s first call, {estimate_s:.1f} s warm |"
    )
    evaluated = dict(search.evaluations["baseline"])
    nxt = search.baseline + 1
    verdict = "does not fit" if nxt in evaluated else "predicted not to fit"
    print(
        f"| `max_batch_size`, 80 GiB | batch {search.baseline} ({nxt} {verdict}), "
        f"{len(evaluated)} sizes estimated | {search_s:.1f} s |"
    )
    offloaded = "nothing" if chosen.offload is None else (
        "everywhere" if chosen.offload.include is None else f"{len(chosen.offload.include)} blocks"
    )
    print(
        f"| `plan`, 40 GiB | fits: {chosen.fits}, {len(chosen.checkpoint)} checkpointed, offload "
        f"{offloaded}, predicted {format_bytes(chosen.predicted_total_bytes)}, "
        f"{chosen.evaluations} configurations verified | {plan_s:.1f} s |"
    )


if __name__ == "__main__":
    main()
