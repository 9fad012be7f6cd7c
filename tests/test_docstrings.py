"""The runnable examples in docstrings run."""

from __future__ import annotations

import doctest

import pytest

import lightmem.checkpoint
import lightmem.estimate.estimator
import lightmem.offload.context
import lightmem.model_state.host_grads
import lightmem.model_state.offloader


@pytest.mark.parametrize(
    "module",
    [lightmem.offload.context, lightmem.model_state.offloader, lightmem.model_state.host_grads, lightmem.checkpoint, lightmem.estimate.estimator],
)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
