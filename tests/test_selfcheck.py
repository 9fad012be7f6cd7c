"""``python -m lightmem.selfcheck``: its pure parts, and its one line on a machine without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from lightmem import selfcheck
from lightmem.selfcheck import NO_CUDA, largest_batch, relative, run_with_time_limit, spread
from lightmem.tables import markdown_table

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_prints_one_line_writes_nothing_and_exits_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "lightmem.selfcheck"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, NO_CUDA + "\n", "")
    assert list(tmp_path.iterdir()) == []


def _device(largest: int, tried: list[int]):
    """A device on which a batch reserves 1 GiB + 100 MiB per sample and ``largest`` still fits."""
    budget = 2**30 + largest * 100 * 2**20 + 2**20

    def peak_bytes(batch):
        tried.append(batch)
        peak = 2**30 + batch * 100 * 2**20
        return peak if peak <= budget else None  # past the device: out of memory

    return peak_bytes, budget


@pytest.mark.parametrize("largest", [1, 2, 3, 37, 64, 1000])
def test_batch_search_finds_the_largest_that_fits_in_few_trials(largest):
    tried = []
    peak_bytes, budget = _device(largest, tried)
    assert largest_batch(peak_bytes, budget, limit=4096) == largest
    assert len(tried) <= 4  # two batches give the line, one or two confirm it
    assert len(set(tried)) == len(tried)  # no size is tried twice


def test_batch_search_when_nothing_fits_tries_only_one():
    tried = []
    assert largest_batch(lambda batch: tried.append(batch), 2**30) == 0
    assert tried == [1]


def test_batch_search_stops_at_the_limit():
    tried = []
    assert largest_batch(lambda batch: tried.append(batch) or 2**20, 2**40, limit=100) == 100
    assert max(tried) == 100


def test_report_tables_are_the_projects_markdown_tables():
    assert selfcheck._table(["mode", "peak"], [("no hooks", "1.00 GiB"), ("offload", 3)]) == markdown_table(
        [["no hooks", "1.00 GiB"], ["offload", "3"]], ["mode", "peak"]
    )


def test_a_section_that_hangs_is_reported_and_the_rest_goes_on():
    release = threading.Event()

    def stuck():
        release.wait()
        return "never"

    text, finished = run_with_time_limit(stuck, 0.05)
    release.set()
    assert not finished
    assert text == "## stuck\n\nDid not finish within 0 s (time limit); skipped.\n"
    text, finished = run_with_time_limit(lambda: 1 / 0, 5)
    assert finished and text == "## <lambda>\n\nFailed: `ZeroDivisionError: division by zero`\n"


def test_spread_is_median_and_range_in_ms():
    assert spread([0.0123, 0.0119, 0.0130]) == "12.3 ms (11.9-13.0)"


def test_relative_is_a_signed_percentage():
    assert (relative(112.5, 100.0), relative(75.0, 100.0), relative(1.0, 1.0)) == ("+12.5%", "-25.0%", "+0.0%")
