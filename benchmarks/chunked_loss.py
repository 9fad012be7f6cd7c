"""The loss's logits, chunked: peak memory and time of a language model's loss, unchunked
(``F.cross_entropy(lm_head(hidden).float(), target)``) against ``lightmem.linear_cross_entropy`` and,
where torch has it, torch's chunked ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``.

    python benchmarks/chunked_loss.py                # this machine's device (CUDA if there is one)
    python benchmarks/chunked_loss.py --json         # one JSON line

Two tables, each variant against the unchunked one:

- the loss alone: hidden states (rows x dim) that require grad and the head's weight, forward and
  backward (float32, and bf16 autocast);
- a training step of the example GPT (examples/gpt_model.py, no dropout) at a batch that fits both
  ways: forward, backward and an AdamW step, under bf16 autocast (float32 on the CPU as well).

Peak: on CUDA ``torch.cuda.max_memory_allocated`` over the step, less what was allocated before it;
on the CPU the most bytes of storages alive at once during the step, tracked op by op (the same
accounting). Time: the median over interleaved rounds (CUDA: wall time, synchronised; CPU: the
thread's CPU time on one intra-op thread, so other processes on a shared machine do not count).
The largest difference of the loss and of the head weight's gradient from the unchunked variant,
over its largest value, says how exact each variant is. Sizes: the CPU's are small (minutes on two
cores); a GPU runs the GPT of benchmarks/plans_hold.py (16 blocks, dim 1024, 1024 tokens, vocab
32,000) at batch 8.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, str(CHECKOUT / "examples"))
sys.path.insert(0, str(CHECKOUT / "benchmarks"))

from _common import hardware, interleaved_times_s, one_thread  # noqa: E402
from lightmem import linear_cross_entropy  # noqa: E402
from lightmem.config import format_bytes  # noqa: E402
from lightmem.estimate.words import format_seconds  # noqa: E402
from lightmem.tables import format_table  # noqa: E402

SIZES = {
    "cpu": {"loss": {"rows": 4096, "dim": 512, "vocab": 32_000},
            "gpt": {"vocab": 32_000, "dim": 256, "depth": 2, "heads": 4, "seq": 256, "batch": 4}},
    "cuda": {"loss": {"rows": 16_384, "dim": 1024, "vocab": 32_000},
             "gpt": {"vocab": 32_000, "dim": 1024, "depth": 16, "heads": 16, "seq": 1024, "batch": 8}},
}  # fmt: skip
HAS_TORCH_CHUNKED = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def unchunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float().flatten(0, -2), target.flatten())


def lightmem_chunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return linear_cross_entropy(hidden, weight, target)


def torch_chunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torch's chunked op, given what autocast would give F.linear (it is not autocast-aware)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = F.linear_cross_entropy(
            hidden.flatten(0, -2), weight, target.flatten(), options=torch.nn.LinearCrossEntropyOptions()
        )
    return loss.float()


VARIANTS: dict[str, Callable[..., torch.Tensor]] = {"unchunked": unchunked, "lightmem.linear_cross_entropy": lightmem_chunked}
if HAS_TORCH_CHUNKED:
    VARIANTS["torch F.linear_cross_entropy (chunked)"] = torch_chunked


class LiveBytes(TorchDispatchMode):
    """The most bytes of CPU storages alive at once while it is active (storages made before it
    count from their first use, as on CUDA's allocator they would count from their allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """The step's peak above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - before
    with LiveBytes() as tracker:
        step()
    return tracker.peak


def _rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    base = results["unchunked"]
    rows = []
    for name, result in results.items():
        rows.append([
            name, format_bytes(result["peak_bytes"]), f"{result['peak_bytes'] / base['peak_bytes']:.2f}x",
            format_seconds(result["seconds"]), f"{result['seconds'] / base['seconds']:.2f}x",
            f"{result['loss_difference']:.1e}", f"{result['grad_difference']:.1e}",
        ])  # fmt: skip
    return rows


def _difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def loss_alone(device: torch.device, autocast: torch.dtype | None, rounds: int) -> dict[str, dict[str, Any]]:
    """Each variant's loss over hidden states that require grad: forward and backward."""
    size = SIZES[device.type]["loss"]
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(size["rows"], size["dim"], device=device, generator=generator).requires_grad_()
    weight = (torch.randn(size["vocab"], size["dim"], device=device, generator=generator) * 0.02).requires_grad_()
    target = torch.randint(0, size["vocab"], (size["rows"],), device=device, generator=generator)
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def step_of(variant: Callable[..., torch.Tensor], name: str) -> Callable[[], None]:
        def step() -> None:
            hidden.grad = weight.grad = None
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                loss = variant(hidden, weight, target)
            loss.backward()
            outputs[name] = (loss.detach(), weight.grad)

        return step

    steps = {name: step_of(variant, name) for name, variant in VARIANTS.items()}
    return _measure(steps, outputs, device, rounds)


def gpt_step(device: torch.device, autocast: torch.dtype | None, rounds: int) -> dict[str, dict[str, Any]]:
    """A training step of the example GPT with each variant as its loss (the same weights each time:
    each variant steps its own copy from the same start)."""
    from gpt_model import GPT

    size = dict(SIZES[device.type]["gpt"])
    batch = size.pop("batch")
    torch.manual_seed(0)
    template = GPT(**size, dropout=0.0).to(device)
    tokens = torch.randint(0, size["vocab"], (batch, size["seq"] + 1), device=device)
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    models = {}

    def step_of(variant: Callable[..., torch.Tensor], name: str) -> Callable[[], None]:
        model = models[name] = GPT(**size, dropout=0.0).to(device)
        model.load_state_dict(template.state_dict())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=device.type == "cuda")

        def step() -> None:
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                loss = variant(model.hidden_states(tokens[:, :-1]), model.lm_head.weight, tokens[:, 1:])
            loss.backward()
            outputs[name] = (loss.detach(), model.lm_head.weight.grad.clone())
            optimizer.step()  # lr 0: every round starts from the same weights
            optimizer.zero_grad(set_to_none=True)

        return step

    steps = {name: step_of(variant, name) for name, variant in VARIANTS.items()}
    return _measure(steps, outputs, device, rounds)


def _measure(
    steps: dict[str, Callable[[], None]], outputs: dict[str, Any], device: torch.device, rounds: int
) -> dict[str, dict[str, Any]]:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for step in steps.values():  # warm-up: the optimizer's state, the allocator's blocks
        step()
    peaks = {name: peak_bytes(step, device) for name, step in steps.items()}
    times = interleaved_times_s(steps, rounds, sync=sync, clock=time.perf_counter if cuda else time.thread_time)
    loss, grad = outputs["unchunked"]
    results = {}
    for name in steps:
        got_loss, got_grad = outputs[name]
        results[name] = {
            "peak_bytes": peaks[name], "seconds": sorted(times[name])[len(times[name]) // 2],
            "loss_difference": _difference(got_loss, loss), "grad_difference": _difference(got_grad, grad),
        }  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the tables")
    args = parser.parse_args(argv)
    kind = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(kind)
    runs = [("loss alone", loss_alone, None), ("loss alone", loss_alone, torch.bfloat16), ("GPT step", gpt_step, torch.bfloat16)]
    if kind == "cpu":
        runs.insert(2, ("GPT step", gpt_step, None))
    tables = []
    with one_thread() if kind == "cpu" else contextlib.nullcontext():
        machine = hardware()
        for what, run, autocast in runs:
            tables.append((what, "bf16 autocast" if autocast else "float32", run(device, autocast, args.rounds)))
    if args.json:
        print(json.dumps({"hardware": machine, "sizes": SIZES[kind], "tables": [
            {"what": what, "precision": precision, "results": results} for what, precision, results in tables
        ]}))  # fmt: skip
        return 0
    print(f"Hardware: {machine}")
    print(f"Sizes: {SIZES[kind]}")
    if not HAS_TORCH_CHUNKED:
        print(f"torch {torch.__version__} has no chunked F.linear_cross_entropy: not measured.")
    headers = ["loss", "peak", "vs unchunked", "step", "vs unchunked", "loss diff", "head grad diff"]
    for what, precision, results in tables:
        print()
        print(format_table(_rows(results), headers, title=f"{what}, {precision}", align="lrrrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
