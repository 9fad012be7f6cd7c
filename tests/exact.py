"""One definition of "the same training state", shared by every exactness test.

Bitwise equality of the whole ``state_dict`` (parameters and every buffer: BatchNorm statistics,
step counters), of the optimizer's ``state_dict`` (per-parameter state and param groups) and, when
given, of RNG states.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def _assert_values_equal(expected: Any, actual: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: tensor vs {type(actual).__name__}"
        assert expected.dtype == actual.dtype, f"{where}: dtype {expected.dtype} vs {actual.dtype}"
        assert expected.shape == actual.shape, f"{where}: shape {tuple(expected.shape)} vs {tuple(actual.shape)}"
        assert torch.equal(expected, actual), f"{where} differs"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and list(expected) == list(actual), f"{where}: keys differ"
        for name in expected:
            _assert_values_equal(expected[name], actual[name], f"{where}[{name!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(expected) == len(actual), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(expected, actual)):
            _assert_values_equal(a, b, f"{where}[{i}]")
    else:
        assert expected == actual, f"{where}: {expected!r} vs {actual!r}"


def assert_state_equal(
    model_a: nn.Module,
    model_b: nn.Module,
    opt_a: torch.optim.Optimizer | None = None,
    opt_b: torch.optim.Optimizer | None = None,
) -> None:
    """The whole training state of two runs is bitwise equal: every state_dict entry and the optimizer."""
    _assert_values_equal(model_a.state_dict(), model_b.state_dict(), "state_dict")
    assert (opt_a is None) == (opt_b is None), "only one optimizer given"
    if opt_a is not None:
        _assert_values_equal(opt_a.state_dict(), opt_b.state_dict(), "optimizer")


def assert_same(expected: Any, actual: Any, where: str = "value") -> None:
    """Bitwise equality of nested tensors/containers (RNG states, gradient dicts, state dicts)."""
    _assert_values_equal(expected, actual, where)
