"""The host step overlapped with backward (``overlap_step``), timed on the CPU path.

    python benchmarks/overlap_step.py [--rounds 15] [--threads 1]

A GPT-shaped model (``_common.GPT``, 3.74M fp32 parameters in 29 tensors) trains under
``offload_optimizer(model, AdamW(params, lr), devices=("cpu",))`` with and without
``overlap_step=True``, every variant once per round in turn, for two batch sizes: few tokens
(a backward about as long as the host step) and more tokens (a backward far longer). Per step,
wall time (work runs on two threads), medians and minimums in ms:

- ``backward``: ``loss.backward()``, the overlapped host steps running beside it;
- ``optimizer.step()``: what the training thread still waits for after backward (without the
  overlap: the whole host step and the copy back; with it: the steps not done yet, the checks,
  the copy back); with clipping after backward, ``clip_grad_norm_`` / ``clip_grad_value_`` over
  the host gradients is timed in it too;
- ``backward + step``; the training thread's CPU time for the two (``time.thread_time``: the
  work the overlap moves to its worker leaves it); and the share of parameter bytes whose host
  step was over when backward ended (``stats.overlapped_bytes``).

Clipping: by norm (max norm 1.0) after backward (``clip_grad_norm_`` by hand, then the step)
against ``offload_optimizer(..., overlap_step=True, clip_grad_norm=1.0)``, where each gradient's
norm is taken as it lands and the step of every parameter starts when backward ends; by value
(0.01) the same way, where each gradient is clamped and stepped as it lands.

On this CPU path backward itself runs on the host, so the overlap needs a second core: torch runs
on ``--threads`` intra-op threads (default 1), backward on the training thread's and the step
on the worker's. On a GPU machine backward runs on the device and the host cores are free for the
step; that case was not measured here.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import GPT, gpt_loss, hardware, print_table
from optimizer_offload import cpu_model

from lightmem import offload_optimizer

GPT_4M = dict(vocab=4096, dim=256, depth=2, heads=4, seq=256)
BATCHES = [("8 tokens", (1, 9)), ("256 tokens", (2, 129))]  # (batch, sequence + 1)


CLIP_NORM, CLIP_VALUE = 1.0, 0.01
VARIANTS = [
    ("after backward", False, None),
    ("overlapped", True, None),
    ("after backward, clip_grad_norm_", False, "norm"),
    ("overlapped, clip_grad_norm=1.0", True, "norm"),
    ("after backward, clip_grad_value_", False, "value"),
    ("overlapped, clip_grad_value=0.01", True, "value"),
]


def _trainer(model: torch.nn.Module, overlap: bool, clip: str | None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    flags = {"norm": {"clip_grad_norm": CLIP_NORM}, "value": {"clip_grad_value": CLIP_VALUE}}.get(clip, {})
    offloader = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=overlap, **(flags if overlap else {}))
    host_params = [param for group in optimizer.param_groups for param in group["params"]]
    times: dict[str, list[float]] = {
        "backward": [], "optimizer.step()": [], "backward + step": [], "training thread CPU": [], "hidden": [],
    }  # fmt: skip
    total_bytes = offloader.stats.host_param_bytes

    def step(tokens: torch.Tensor, record: bool) -> None:
        loss = gpt_loss(model, tokens)
        start, start_cpu = time.perf_counter(), time.thread_time()
        loss.backward()
        backward_end = time.perf_counter()
        if clip == "norm" and not overlap:
            torch.nn.utils.clip_grad_norm_(host_params, CLIP_NORM)
        elif clip == "value" and not overlap:
            torch.nn.utils.clip_grad_value_(host_params, CLIP_VALUE)
        optimizer.step()
        end, end_cpu = time.perf_counter(), time.thread_time()
        optimizer.zero_grad()
        if record:
            times["backward"].append(backward_end - start)
            times["optimizer.step()"].append(end - backward_end)
            times["backward + step"].append(end - start)
            times["training thread CPU"].append(end_cpu - start_cpu)
            times["hidden"].append(offloader.stats.overlapped_bytes / total_bytes)

    return step, times, offloader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Measured on: {cpu_model()}; {hardware()}")
    torch.manual_seed(0)
    base = GPT(**GPT_4M)
    millions = sum(param.numel() for param in base.parameters()) / 1e6
    for label, shape in BATCHES:
        tokens = torch.randint(0, GPT_4M["vocab"], shape, generator=torch.Generator().manual_seed(1))
        variants = {name: _trainer(copy.deepcopy(base), overlap, clip) for name, overlap, clip in VARIANTS}
        for step, _, _ in variants.values():
            for _ in range(3):
                step(tokens, record=False)
        for _ in range(args.rounds):
            for step, _, _ in variants.values():
                step(tokens, record=True)
        rows = []
        for name, (_, times, offloader) in variants.items():
            row = [name]
            for column in ("backward", "optimizer.step()", "backward + step", "training thread CPU"):
                row += [f"{min(times[column]) * 1e3:.2f}", f"{statistics.median(times[column]) * 1e3:.2f}"]
            row.append(f"{statistics.median(times['hidden']):.0%}")
            rows.append(row)
            offloader.close()
        print_table(
            f"GPT {millions:.2f}M fp32 parameters, AdamW (fused host kernel), batch {shape[0]} x {shape[1] - 1} "
            f"tokens ({label}), {args.threads} intra-op thread(s), {args.rounds} interleaved rounds, wall ms",
            ["host step", "backward: min", "median", "optimizer.step(): min", "median", "backward + step: min",
             "median", "training thread CPU: min", "median", "stepped by backward's end (median)"],
            rows,
        )  # fmt: skip


if __name__ == "__main__":
    main()
