"""The runnable examples in docstrings run."""

from __future__ import annotations

import doctest

import pytest

import lightmem.causal_lm
import lightmem.checkpoint
import lightmem.estimate.estimator
import lightmem.loss
import lightmem.offload.context
import lightmem.model_state.host_grads
import lightmem.model_state.offloader
import lightmem.tiling.apply


@pytest.mark.parametrize(
    "module",
    [
        lightmem.offload.context, lightmem.model_state.offloader, lightmem.model_state.host_grads, lightmem.checkpoint,
        lightmem.estimate.estimator, lightmem.loss, lightmem.causal_lm, lightmem.tiling.apply,
    ],
)
def test_docstring_examples(module):
    if module is lightmem.causal_lm:
        pytest.importorskip("transformers")  # its example builds a GPT-2
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
