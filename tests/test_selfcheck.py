"""``python -m lightmem.selfcheck``: its pure parts, and its one line on a machine without CUDA."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from lightmem import selfcheck
from lightmem.selfcheck import NO_CUDA, largest_batch, relative, spread
from lightmem.testing import sections as sections_module
from lightmem.testing.sections import run_with_time_limit
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


# -- --quick: named sections, each time-boxed; the report is written as it goes ------------------


def test_quick_sections_have_unique_names_and_their_limits_fit_the_quick_budget():
    names = [section.name for section in selfcheck.QUICK_SECTIONS]
    assert names == ["steady_offload", "gpu_tests", "estimator", "swap_row", "plans_hold", "warm_start"]
    assert len(set(names)) == len(names)
    verdict = selfcheck.QUICK_SECTIONS[: selfcheck.VERDICT_SECTIONS]
    assert sum(section.limit_s for section in verdict) <= selfcheck.VERDICT_BUDGET_S <= 360
    assert sum(section.limit_s for section in selfcheck.QUICK_SECTIONS) <= selfcheck.QUICK_BUDGET_S <= 600


def test_a_section_that_hangs_leaves_the_report_written_and_the_next_sections_run(tmp_path):
    release = threading.Event()

    def hangs(limit_s):
        release.wait()
        return "never"

    sections = [
        selfcheck.Section("first", 5, lambda limit_s: "## First\n\n**Verdict:** 3 passed\n", "a quick one"),
        selfcheck.Section("hangs", 0.2, hangs, "a stuck GPU call"),
        selfcheck.Section("fails", 5, lambda limit_s: 1 / 0, "one that raises"),
        selfcheck.Section("last", 5, lambda limit_s: "## Last\n\nno verdict line\n", "after the hang"),
    ]
    report, printed = tmp_path / "selfcheck.md", io.StringIO()
    hung = selfcheck.run_report(sections, report, lambda: "# lightmem selfcheck\n", out=printed)
    release.set()
    assert hung
    assert report.read_text() == (
        "# lightmem selfcheck\n"
        "\n## First\n\n**Verdict:** 3 passed\n"
        "\n## hangs\n\nDid not finish within 0 s (time limit); skipped.\n"
        "\n## fails\n\nFailed: `ZeroDivisionError: division by zero`\n"
        "\n## Last\n\nno verdict line\n"
    )
    verdicts = [line.split(" (")[0] for line in printed.getvalue().splitlines()]
    assert verdicts == [
        "lightmem selfcheck: first: 3 passed",
        "lightmem selfcheck: hangs: did not finish within its time limit",
        "lightmem selfcheck: fails: Failed: `ZeroDivisionError: division by zero`",
        "lightmem selfcheck: last: done",
        f"lightmem selfcheck: report written to {report.resolve()}",
    ]


def test_a_header_that_hangs_still_leaves_a_report(tmp_path):
    release = threading.Event()
    report = tmp_path / "selfcheck.md"
    sections = [selfcheck.Section("only", 5, lambda limit_s: "## Only\n", "")]
    original = sections_module.run_with_time_limit

    def quick_limit(section, limit_s):  # the header's limit, shortened for the test
        return original(section, 0.2 if section.__name__ == "header" else limit_s)

    sections_module.run_with_time_limit = quick_limit
    try:
        selfcheck.run_report(sections, report, lambda: release.wait() and "", out=io.StringIO())
    finally:
        sections_module.run_with_time_limit = original
        release.set()
    assert report.read_text() == "## header\n\nDid not finish within 0 s (time limit); skipped.\n\n## Only\n"


def test_sections_option_picks_sections_by_name_in_the_modes_order():
    picked = selfcheck.select_sections(selfcheck.QUICK_SECTIONS, "swap_row, gpu_tests")
    assert [section.name for section in picked] == ["gpu_tests", "swap_row"]
    assert selfcheck.select_sections(selfcheck.QUICK_SECTIONS, None) == selfcheck.QUICK_SECTIONS
    with pytest.raises(SystemExit, match="no section frontier; this mode has steady_offload, gpu_tests"):
        selfcheck.select_sections(selfcheck.QUICK_SECTIONS, "frontier")


def test_quick_is_the_default_when_the_environment_asks_for_it(monkeypatch):
    monkeypatch.delenv(selfcheck.QUICK_ENV, raising=False)
    assert not selfcheck.parse_args([]).quick
    assert selfcheck.parse_args(["--quick", "--sections", "gpu_tests"]).sections == "gpu_tests"
    monkeypatch.setenv(selfcheck.QUICK_ENV, "1")
    assert selfcheck.parse_args([]).quick


def _checkout_with_gpu_tests(tmp_path, body: str) -> Path:
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_stub.py").write_text(body)
    return tmp_path


def test_gpu_tests_report_pytests_summary_as_the_verdict(tmp_path, monkeypatch):
    monkeypatch.setattr(selfcheck, "CHECKOUT", _checkout_with_gpu_tests(tmp_path, "def test_one():\n    pass\n"))
    text = selfcheck.gpu_tests(60, per_test_timeout_s=30)
    assert selfcheck.verdict_of(text, True).startswith("`pytest tests/gpu`: 1 passed in ")
    assert selfcheck.verdict_of(text, True).endswith("(exit code 0)")
    has_plugin = importlib.util.find_spec("pytest_timeout") is not None
    assert ("Each test at most 30 s (pytest-timeout)." in text) == has_plugin
    assert ("pytest-timeout is not installed" in text) == (not has_plugin)


def test_gpu_tests_that_outlast_the_section_are_killed_and_their_output_so_far_kept(tmp_path, monkeypatch):
    body = "import time\n\ndef test_fast():\n    pass\n\ndef test_stuck():\n    time.sleep(600)\n"
    monkeypatch.setattr(selfcheck, "CHECKOUT", _checkout_with_gpu_tests(tmp_path, body))
    text = selfcheck.gpu_tests(20)  # pytest gets 15 s: collection and the first test, then the stuck one
    assert selfcheck.verdict_of(text, True) == "`pytest tests/gpu`: did not finish within 20 s"
    assert "\n```\n." in text  # the first test's dot, printed before the kill
