"""Estimator accuracy: predicted (fake tensors, device="cpu") against a real CPU step.

    python benchmarks/estimate_accuracy.py            # the six architectures, float32 and bf16-mixed
    python benchmarks/estimate_accuracy.py --small    # the sizes the test suite uses
    python benchmarks/estimate_accuracy.py --small --json   # what the test suite reads

The measurement is independent of the estimator: the real step runs on real tensors under
torch's MemTracker (torch.distributed._tools.mem_tracker), whose categories are mapped as
documented in lightmem/testing/measure.py. The table prints the peak and every category,
predicted / measured, with the ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from _common import hardware
from models import ConvNet, LSTMTagger, TinyGPT, chunked_gpt_loss, gpt_loss

from lightmem import estimate_memory
from lightmem.config import format_bytes
from lightmem.testing.measure import measure_cpu_step
from lightmem.estimate.trace.records import CATEGORIES


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(512, width), nn.ReLU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class EmbeddingClassifier(nn.Module):
    """Bag of token embeddings, mean-pooled, then a linear classifier."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def _classification_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch)
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))


def _tagging_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.zeros(tokens.numel(), dtype=torch.long)
    )


@dataclass
class Case:
    model: nn.Module
    batch: torch.Tensor
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


def make_case(name: str, small: bool = False) -> Case:
    """A fresh model, batch and loss for each benchmarked architecture (small: test-suite sizes)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    if name == "mlp":
        return Case(
            MLP(256 if small else 1024),
            torch.randn(64 if small else 256, 512, generator=generator),
            _classification_loss,
        )
    if name == "cnn-batchnorm":
        return Case(
            ConvNet(),
            torch.randn(8 if small else 32, 3, 16 if small else 32, 16 if small else 32, generator=generator),
            _classification_loss,
        )
    if name == "transformer":
        return Case(TinyGPT(), torch.randint(0, 128, (4 if small else 16, 33), generator=generator), gpt_loss)
    if name == "lstm":
        return Case(
            LSTMTagger(),
            torch.randint(0, 100, (4 if small else 16, 20 if small else 40), generator=generator),
            _tagging_loss,
        )
    if name == "embedding":
        return Case(
            EmbeddingClassifier(2000 if small else 5000, 64),
            torch.randint(0, 2000 if small else 5000, (16 if small else 64, 50), generator=generator),
            _classification_loss,
        )
    if name == "chunked-loss":
        # A large vocabulary's loss through lightmem.linear_cross_entropy: its chunks in forward,
        # the gradients it keeps for backward.
        return Case(
            TinyGPT(vocab=4096, depth=2),
            torch.randint(0, 4096, (4 if small else 16, 33), generator=generator),
            chunked_gpt_loss,
        )
    raise KeyError(name)


CASES = ("mlp", "cnn-batchnorm", "transformer", "lstm", "embedding", "chunked-loss")
# oneDNN has no bfloat16 LSTM on every CPU, so that real step cannot run.
RUNS = [("32-true", name) for name in CASES] + [("bf16-mixed", name) for name in CASES if name != "lstm"]


@dataclass
class Comparison:
    name: str
    precision: str
    predicted_peak: int
    measured_peak: int
    predicted: dict[str, int]
    measured: dict[str, int]
    phase: str
    seconds: float


def compare(name: str, precision: str = "32-true", small: bool = False) -> Comparison:
    """Estimate and measure one case; the real step runs on a copy of the model."""
    case = make_case(name, small)
    started = time.perf_counter()
    estimate = estimate_memory(
        case.model, case.batch, case.loss_fn, optimizer="adamw", precision=precision, device="cpu"
    )
    seconds = time.perf_counter() - started
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = measure_cpu_step(
            copy.deepcopy(case.model), case.batch, case.loss_fn, optimizer="adamw", precision=precision
        )
    return Comparison(
        name, precision, estimate.peak_bytes, measured.peak_bytes, dict(estimate.breakdown), dict(measured.breakdown),
        f"{estimate.peak_phase}: {estimate.peak_op}", seconds,
    )  # fmt: skip


def _ratio(predicted: int, measured: int) -> str:
    if measured == 0:
        return "exact" if predicted == 0 else "n/a"
    return f"{predicted / measured:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the sizes the test suite uses")
    parser.add_argument(
        "--json", action="store_true", help="one JSON list of comparisons instead of the table"
    )
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.json:
        results = [compare(name, precision, args.small) for precision, name in RUNS]
        print(json.dumps([vars(result) for result in results]))
        return
    print(f"Hardware: {hardware()}")
    print(
        "Estimate: lightmem.estimate_memory(device='cpu', optimizer='adamw'); measured: real CPU step under MemTracker"
    )
    print(
        "Each cell: predicted / measured (ratio). Steady-state step: previous step's gradients and state alive.\n"
    )
    header = ["model", "precision", "peak"] + list(CATEGORIES) + ["peak at", "estimate s"]
    rows = []
    for precision, name in RUNS:
        result = compare(name, precision, args.small)
        cells = [
            name,
            precision,
            f"{format_bytes(result.predicted_peak)} / {format_bytes(result.measured_peak)} ({_ratio(result.predicted_peak, result.measured_peak)})",
        ]
        for category in CATEGORIES:
            p, m = result.predicted[category], result.measured[category]
            cells.append(f"{format_bytes(p)} / {format_bytes(m)} ({_ratio(p, m)})")
        cells += [result.phase, f"{result.seconds:.2f}"]
        rows.append(cells)
    widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
