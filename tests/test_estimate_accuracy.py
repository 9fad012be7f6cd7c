"""The estimate (device="cpu") equals a real CPU step measured independently by MemTracker."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from estimate_accuracy import CASES, compare  # noqa: E402

from lightmem.estimate.tracer import CATEGORIES  # noqa: E402


def _assert_close(result) -> None:
    # The issue asks for 10% on the peak and 15% per category; the CPU trace is exact up to
    # a few bytes (scalar temporaries), so the bound here is 1% of the peak.
    tolerance = 0.01 * result.measured_peak
    assert abs(result.predicted_peak - result.measured_peak) <= tolerance, (
        result.predicted_peak,
        result.measured_peak,
    )
    for category in CATEGORIES:
        predicted, measured = result.predicted[category], result.measured[category]
        assert abs(predicted - measured) <= tolerance, (category, predicted, measured)


@pytest.mark.parametrize("name", CASES)
def test_cpu_estimate_matches_measured_step_float32(name):
    _assert_close(compare(name, "32-true", small=True))


@pytest.mark.parametrize("name", ["cnn-batchnorm", "transformer"])
def test_cpu_estimate_matches_measured_step_bf16_mixed(name):
    _assert_close(compare(name, "bf16-mixed", small=True))
