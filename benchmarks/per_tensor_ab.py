"""Per-saved-tensor cost of this checkout against an earlier commit, both loaded in one process.

    python benchmarks/per_tensor_ab.py --base 557c1bd    # 100 interleaved rounds (default)

Timing two checkouts in separate processes one after the other mixes the change with the
machine's drift between processes (about +-1 us per saved tensor on the 2-core VM). Here the
earlier commit's ``lightmem`` is exported with ``git archive`` and renamed ``lightmem_base``
(its own imports rewritten), so both offloaders run in one process and every round times each
variant once: the workload of ``offload.py --per-tensor-only`` (200 chained ``sin()`` on 32x32
float32, one thread), each round the best of 3 steps on the thread's CPU clock; the table gives
the minimum and the median over the rounds. When torchtune is installed its ``OffloadActivations``
runs in the same rounds (``_torchtune.py``), the goal's yardstick.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware, print_table
from _torchtune import torchtune_hooks, torchtune_offload_activations
from offload import added_us_per_tensor, gpt2_step_table, sin_chain_times_s

import lightmem

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_base(rev: str, into: str):
    """``lightmem`` as of ``rev``, importable as ``lightmem_base``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "lightmem"], cwd=_ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = os.path.join(into, "lightmem_base")
    os.rename(os.path.join(into, "lightmem"), package)
    pattern = re.compile(r"\blightmem(?=[.\s])")
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as source:
                    text = pattern.sub("lightmem_base", source.read())
                with open(path, "w") as target:
                    target.write(text)
    sys.path.insert(0, into)
    import lightmem_base

    return lightmem_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--gpt2", action="store_true",
                        help="also the GPT-2 step table with the earlier commit's lightmem interleaved")
    parser.add_argument("--step-rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chain = 200
    x = torch.randn(32, 32, requires_grad=True)
    with tempfile.TemporaryDirectory() as folder:
        base = _import_base(args.base, folder)
        variants = {"no hooks": nullcontext}
        if torchtune_offload_activations() is not None:
            variants["offloading, torchtune (min_offload_size=0)"] = lambda tt=torchtune_hooks(0): tt
            variants["keeping, torchtune (min_offload_size=1MiB)"] = lambda tt=torchtune_hooks(2**20): tt
        for tag, module in ((args.base, base), ("this checkout", lightmem)):
            offloading = module.offload_activations(min_bytes=0, devices=("cpu",))
            keeping = module.offload_activations(min_bytes="1MiB", devices=("cpu",))
            variants[f"offloading (min_bytes=0), {tag}"] = lambda off=offloading: off
            variants[f"keeping (min_bytes=1MiB), {tag}"] = lambda off=keeping: off

        times = sin_chain_times_s(variants, x, chain, args.rounds, repeats=3)
        if args.gpt2:

            def earlier(model):
                zero = base.offload_activations(model, min_bytes=0, devices=("cpu",))
                default = base.offload_activations(model, devices=("cpu",))
                return {
                    f"lightmem min_bytes=0, {args.base}": lambda: zero,
                    f"lightmem default (min_bytes=1MiB), {args.base}": lambda: default,
                }

            gpt2_step_table(args.step_rounds, repeats=1, extra=earlier)
    rows = []
    for name in variants:
        if name != "no hooks":
            low, mid = added_us_per_tensor(times, name, chain)
            rows.append([name, f"{min(times[name]) * 1e3:.3f}", f"{low:+.2f} / {mid:+.2f}"])
    print_table(
        f"Per-saved-tensor cost, {args.base} against this checkout in one process, "
        f"{args.rounds} interleaved rounds x best of 3, thread CPU time; {hardware()}",
        ["variant", "step ms (min)", "us added per saved tensor (min / median)"],
        rows,
    )


if __name__ == "__main__":
    main()
