"""Gradients with offload are bitwise equal to gradients without it."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise_equal, run_grads
from models import CASES, make_case

from lightmem import offload_activations
from lightmem.config import warn_once


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("case", CASES)
def test_gradients_bitwise_equal_with_everything_offloaded(case, autocast):
    model, loss_fn = make_case(case)
    expected, _ = run_grads(model, loss_fn, autocast=autocast)
    actual, off = run_grads(
        model, loss_fn, lambda m: offload_activations(m, min_bytes=0, devices=("cpu",)), autocast=autocast
    )
    assert_bitwise_equal(expected, actual)
    assert off.stats.offloaded_tensors > 0
    assert off.stats.reloaded_bytes == off.stats.offloaded_bytes


@pytest.mark.parametrize("case", CASES)
def test_gradients_bitwise_equal_with_threshold_and_no_prefetch(case):
    model, loss_fn = make_case(case)
    expected, _ = run_grads(model, loss_fn)
    actual, off = run_grads(
        model, loss_fn, lambda m: offload_activations(m, min_bytes="4KiB", devices=("cpu",), prefetch=0)
    )
    assert_bitwise_equal(expected, actual)
    assert off.stats.kept_bytes > 0 and off.stats.offloaded_bytes > 0
    assert off.stats.prefetch_hits == 0


def test_default_devices_offload_nothing_on_cpu_tensors(monkeypatch):
    monkeypatch.setitem(warn_once.__globals__, "_warned", set())  # an earlier test may have said it once
    model, loss_fn = make_case("transformer")
    expected, _ = run_grads(model, loss_fn)
    with pytest.warns(UserWarning, match="CUDA is not available") if not torch.cuda.is_available() else _null():
        actual, off = run_grads(model, loss_fn, lambda m: offload_activations(m, min_bytes=0))
    assert_bitwise_equal(expected, actual)
    assert off.stats.offloaded_tensors == 0
    assert off.stats.packed_tensors > 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
