"""``benchmarks/offload_steady.py``: its verdict fails where the H200's steps did, and it runs.

The verdict is what a GPU owner reads first (``python -m lightmem.selfcheck --quick`` runs it
first); these tests feed it step times and page-locking counts of known shape. Nothing is timed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import offload_steady  # noqa: E402
from offload_steady import LIGHTMEM, NO_HOOKS, Steps  # noqa: E402


class _Stats:
    offloaded_bytes = 6 * 2**30
    reloaded_bytes = 6 * 2**30


class _Offloader:
    stats = _Stats()


def _steps(total_ms: list[float], registrations: list[int] | None = None) -> Steps:
    steps = Steps()
    for index, milliseconds in enumerate(total_ms):
        steps.forward_s.append(milliseconds / 2e3)
        steps.backward_s.append(milliseconds / 2e3)
        steps.peak_allocated.append(0)
        steps.forward_peak.append(0)
        steps.pinned_bytes.append(0)
        steps.registrations.append(0 if registrations is None else registrations[index])
        steps.releases.append(0)
    return steps


def test_the_h200s_alternating_steps_fail_the_verdict():
    # What lightmem ran on the H200 (ms): every other step page-locked a 1.6 GB chunk.
    h200 = [7090, 2355, 364, 1829, 357, 1597, 334, 1774, 310, 1655]
    results = {NO_HOOKS: _steps([68.7] * 10), LIGHTMEM: _steps(h200), "torchtune": _steps([426.2] * 10)}
    steady, line = offload_steady.verdict(results, _Offloader(), None)
    assert not steady
    assert line.startswith("FAIL: lightmem's slowest step after 2 warm-up steps is 1.87x its median")


def test_a_registration_after_warm_up_fails_the_verdict_however_fast_the_steps():
    registrations = [4, 1, 0, 0, 0, 1, 0, 0, 0, 0]
    results = {NO_HOOKS: _steps([68.7] * 10), LIGHTMEM: _steps([300.0] * 10, registrations)}
    steady, line = offload_steady.verdict(results, _Offloader(), None)
    assert not steady
    assert "with 1 page-lock registrations and releases after warm-up" in line


def test_steady_steps_pass_and_the_line_states_the_peers_and_the_links_floor():
    results = {
        NO_HOOKS: _steps([100.0] * 10), LIGHTMEM: _steps([310.0] * 9 + [320.0]), "torchtune": _steps([426.0] * 10),
    }  # fmt: skip
    link = (51.5 * 2**30, 51.6 * 2**30)  # the H200's page-locked copies, bytes per second
    steady, line = offload_steady.verdict(results, _Offloader(), link)
    assert steady
    # 6 GiB each way over 51.5 / 51.6 GiB/s: 116.5 + 116.3 ms, each over its 50 ms of compute.
    assert line == (
        "PASS: lightmem's slowest step after 2 warm-up steps is 1.03x its median (limit 1.25x), with 0 "
        "page-lock registrations and releases after warm-up; its median 310.0 ms against torchtune "
        "426.0 ms; the link's floor for the 6.00 GiB moved each way is 232.8 ms (1.33x, goal at most 1.3x)."
    )


SMALL_GPT = {"vocab": 4096, "dim": 32, "depth": 2, "heads": 2, "seq": 64, "dropout": 0.0}  # 2 MiB logits


def test_the_benchmark_runs_every_variant_on_the_cpu_and_reports_each_step():
    results, offloader = offload_steady.run(SMALL_GPT, 2, 3, offload_steady.torch.device("cpu"))
    assert list(results) == [NO_HOOKS, LIGHTMEM, "lightmem, no windows", "save_on_cpu"]
    assert [len(steps.total_s) for steps in results.values()] == [3, 3, 3, 3]
    assert offloader.stats.offloaded_bytes > 0
    _, text = offload_steady.report(results, offloader, offload_steady.torch.device("cpu"), markdown=False)
    assert [line.split()[0] for line in text.splitlines()[4:7]] == ["0", "1", "2"]  # a row per step
    assert text.splitlines()[-1].startswith(("PASS: ", "FAIL: "))


def test_the_selfcheck_section_opens_with_the_verdict_the_report_prints():
    from lightmem.selfcheck import verdict_of

    section = offload_steady.selfcheck_section(60, steps=3, device=offload_steady.torch.device("cpu"), config=SMALL_GPT, batch=2)
    assert section.startswith("## Activation offload at steady state\n\n**Verdict:** ")
    assert verdict_of(section, finished=True).startswith(("PASS: lightmem's slowest step", "FAIL: lightmem's slowest step"))
