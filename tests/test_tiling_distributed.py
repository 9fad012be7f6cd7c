"""Tiled MLPs under DDP and FSDP2: 2 CPU processes with gloo, one launch of tests/tile_ddp_script.py.

The tile hands the parameters' gradients to autograd once per backward, summed over its shards, so
DDP's reducer marks each parameter ready once (a second mark is an error) and FSDP2 reduce-scatters
each once; the reduced gradients are those without tiling within 1e-6 of their largest entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo subprocess test is Linux-only here")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tile_distributed")
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(tests / "tile_ddp_script.py"), str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_ddp_with_gradient_accumulation_reduces_the_untiled_gradients(ranks):
    for rank in ranks:
        assert rank["ddp"] <= 1e-6


def test_fsdp2_reduce_scatters_the_untiled_gradients(ranks):
    for rank in ranks:
        assert rank["fsdp2"] <= 1e-6
