"""The estimate (device="cpu") equals a real CPU step measured independently by MemTracker.

The comparisons run in a child process (the benchmark with ``--small --json``): MemTracker's
module hooks keep the measured model alive from C++ after it exits, which would disturb the
tests of this process that count live tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightmem.estimate.trace.records import CATEGORIES

BENCHMARK = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "estimate_accuracy.py")
EXPECTED_RUNS = [
    ("32-true", "mlp"), ("32-true", "cnn-batchnorm"), ("32-true", "transformer"), ("32-true", "lstm"),
    ("32-true", "embedding"), ("32-true", "chunked-loss"), ("bf16-mixed", "mlp"), ("bf16-mixed", "cnn-batchnorm"),
    ("bf16-mixed", "transformer"), ("bf16-mixed", "embedding"), ("bf16-mixed", "chunked-loss"),
]  # fmt: skip
""""chunked-loss": a 4096-token vocabulary's loss through ``lightmem.linear_cross_entropy``, whose
autograd function computes the gradients in forward and keeps them for backward."""


@pytest.fixture(scope="module")
def comparisons() -> dict[tuple[str, str], dict]:
    done = subprocess.run(
        [sys.executable, BENCHMARK, "--small", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {(result["precision"], result["name"]): result for result in results}


def test_every_architecture_and_precision_was_compared(comparisons):
    assert sorted(comparisons) == sorted(EXPECTED_RUNS)


@pytest.mark.parametrize(("precision", "name"), EXPECTED_RUNS)
def test_cpu_estimate_matches_the_measured_step(comparisons, precision, name):
    result = comparisons[(precision, name)]
    # The issue asks for 10% on the peak and 15% per category; the CPU trace is exact up to a
    # few bytes (scalar temporaries), so the bound here is 1% of the peak.
    tolerance = 0.01 * result["measured_peak"]
    assert abs(result["predicted_peak"] - result["measured_peak"]) <= tolerance
    for category in CATEGORIES:
        predicted, measured = result["predicted"][category], result["measured"][category]
        assert abs(predicted - measured) <= tolerance, (category, predicted, measured)
