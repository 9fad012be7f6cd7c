"""``python -m lightmem.selfcheck``: its pure parts, and its one line on a machine without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightmem.selfcheck import NO_CUDA, largest_fitting, markdown_table, relative

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_prints_one_line_writes_nothing_and_exits_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "lightmem.selfcheck"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, NO_CUDA + "\n", "")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("largest", [1, 2, 3, 37, 64, 1000])
def test_batch_search_finds_the_largest_that_fits_in_few_trials(largest):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= largest

    assert largest_fitting(fits, limit=4096) == largest
    assert len(tried) <= 2 * largest.bit_length() + 1
    assert len(set(tried)) == len(tried)  # no size is tried twice


def test_batch_search_when_nothing_fits_tries_only_one():
    tried = []
    assert largest_fitting(lambda batch: tried.append(batch) or False) == 0
    assert tried == [1]


def test_batch_search_stops_at_the_limit():
    tried = []
    assert largest_fitting(lambda batch: tried.append(batch) or True, limit=100) == 100
    assert tried == [1, 2, 4, 8, 16, 32, 64, 100]


def test_markdown_table():
    table = markdown_table(["mode", "peak"], [("no hooks", "1.00 GiB"), ("offload", 3)])
    assert table == "| mode | peak |\n| --- | --- |\n| no hooks | 1.00 GiB |\n| offload | 3 |"


def test_relative_is_a_signed_percentage():
    assert (relative(112.5, 100.0), relative(75.0, 100.0), relative(1.0, 1.0)) == ("+12.5%", "-25.0%", "+0.0%")
