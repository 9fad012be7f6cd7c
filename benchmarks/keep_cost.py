"""Where a kept save's time goes: lightmem's pack hook with one part taken out at a time.

    python benchmarks/keep_cost.py              # 100 interleaved rounds (default)

A kept save (one under ``min_bytes``) costs lightmem about twice what torchtune's keeping hook
costs. This table says which part of ``Offloader.pack`` the difference is made of: each row is
the engine's own pack with one part removed by a text edit (a block between two anchor lines,
each found exactly once, so a changed engine fails loudly instead of timing something else), beside the
yardsticks, all interleaved in one process on the workload of ``offload.py --per-tensor-only``
(200 chained ``sin()`` on 32x32 float32, 4 KiB saved each, one thread, thread CPU time; each round
the best of 3 steps). A row without a part is not a correct hook: it only measures that part.

- the record: the kept-storage record (dedupe within a forward, the resident-bytes count and its
  finalizer);
- the cycle rule: reading the tensor's grad_fn to hold a ``detach()`` only where a reference
  cycle through autograd's C++ could form;
- the pre-checks: CUDA graph capture, deferred copies and copies still in flight;
- the policy decision: what the floor row plus ``OffloadPolicy.decide`` (its verdict unused) adds
  over the floor row (the decision is one call; removing it from pack would leave nothing to keep).

The floor row is the least a keeping hook with lightmem's two guarantees does: the version check
(an in-place write after the save is caught) and the cycle rule (a graph dropped without backward
is freed).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import textwrap
import types
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware, print_table
from _torchtune import torchtune_hooks, torchtune_offload_activations
from offload import CHECKED_HELD, LM_KEEPING, TT_KEEPING, _checked_hooks, added_us_per_tensor, sin_chain_times_s

import lightmem.offload.hooks as engine
from lightmem import offload_activations
from lightmem.offload.policy import OffloadPolicy

FLOOR_DECIDING = "the same + lightmem's policy decision (verdict unused)"

# Each part is the block of pack's lines from the one containing the first anchor to the one
# containing the last (each anchor must occur once), replaced by ``replacement``.
WITHOUT = {
    "lightmem keeping without the record": (
        "kept = by_storage[key] = _KeptStorage(alias)", "stats.peak_resident_bytes = resident", "kept = None"
    ),
    "lightmem keeping without the cycle rule": ("grad_fn = tensor.grad_fn", "tensor = tensor.detach()", "pass"),
    "lightmem keeping without the pre-checks": ("capturing = self._capturing", "self._settle()", "pass"),
}


def _pack_without(first: str, last: str, replacement: str):
    """``Offloader.pack`` with the lines from ``first`` to ``last`` replaced by ``replacement``."""
    lines = textwrap.dedent(inspect.getsource(engine.Offloader.pack)).splitlines()
    starts = [i for i, line in enumerate(lines) if first in line]
    ends = [i for i, line in enumerate(lines) if last in line]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise SystemExit(f"keep_cost.py: the engine's pack no longer has one block from {first!r} to {last!r}")
    indent = lines[starts[0]][: len(lines[starts[0]]) - len(lines[starts[0]].lstrip())]
    source = "\n".join(lines[: starts[0]] + [indent + replacement] + lines[ends[0] + 1 :])
    namespace: dict[str, object] = {}
    exec(source, vars(engine), namespace)
    return namespace["pack"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chain = 200
    x = torch.randn(32, 32, requires_grad=True)
    decide = OffloadPolicy(min_bytes=2**20, devices=("cpu",)).decide
    variants = {
        "no hooks": nullcontext,
        CHECKED_HELD: lambda: _checked_hooks(hold=engine._held),
        FLOOR_DECIDING: lambda: _checked_hooks(decide, hold=engine._held),
    }
    if torchtune_offload_activations() is not None:
        variants[TT_KEEPING] = lambda tt=torchtune_hooks(2**20): tt
    keeping = offload_activations(min_bytes="1MiB", devices=("cpu",))
    variants[LM_KEEPING] = lambda: keeping
    for name, (first, last, replacement) in WITHOUT.items():
        context = offload_activations(min_bytes="1MiB", devices=("cpu",))
        # The context pushes the offloader's pack at each enter: an instance attribute replaces it.
        context._offloader.pack = types.MethodType(_pack_without(first, last, replacement), context._offloader)
        variants[name] = lambda context=context: context

    times = sin_chain_times_s(variants, x, chain, args.rounds, repeats=3)
    full_low, full_mid = added_us_per_tensor(times, LM_KEEPING, chain)
    rows = []
    for name in variants:
        if name == "no hooks":
            continue
        low, mid = added_us_per_tensor(times, name, chain)
        part = ""
        if name in WITHOUT:
            part = f"{full_low - low:+.2f} / {full_mid - mid:+.2f}"
        elif name == FLOOR_DECIDING:
            floor_low, floor_mid = added_us_per_tensor(times, CHECKED_HELD, chain)
            part = f"{low - floor_low:+.2f} / {mid - floor_mid:+.2f} (the decision)"
        rows.append([name, f"{low:+.2f} / {mid:+.2f}", part])
    print_table(
        f"Kept save, 200 chained sin() on 32x32 float32, {args.rounds} interleaved rounds x best of 3, "
        f"thread CPU time; {hardware()}",
        ["variant", "us added per saved tensor (min / median)", "the part removed costs (min / median)"],
        rows,
    )


if __name__ == "__main__":
    main()
