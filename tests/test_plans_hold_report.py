"""``benchmarks/plans_hold.py``'s report of a GPU run: the steady step of the last plan and when
``plan="auto"`` planned again (it may after timing blocks in steps 1-3), from the per-step figures."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from plans_hold import final_plan_steady, markdown, replans  # noqa: E402


def test_the_steady_step_is_the_last_plans_after_its_first_step():
    times = [0.5, 0.12, 0.12, 0.12, 0.3, 0.25, 0.125]
    priced = [0.12, 0.12, 0.12, 0.12, 0.1, 0.1, 0.1]
    assert final_plan_steady(times, priced) == 0.1875  # steps 5 and 6: step 4 is the new plan's first
    assert final_plan_steady([0.5, 0.1, 0.2, 0.3], [0.1] * 4) == 0.2
    assert final_plan_steady([0.5], [0.1]) is None


def test_the_report_says_after_which_steps_the_plan_changed():
    assert replans([0.12, 0.12, 0.12, 0.12, 0.1, 0.1, 0.1]) == "after step 3"
    assert replans([0.1] * 7) == "-"
    row = {
        "batch": 16, "multiple": 2, "outcome": "trained", "plan": "checkpoint blocks.0-8", "predicted_allocated": 2**30,
        "predicted_reserved": 2**31, "measured_allocated": 2**30, "measured_reserved": 2**31, "alloc_retries": 0,
        "step_times_s": [0.5, 0.1, 0.1, 0.1, 0.3, 0.09, 0.09], "steady_s": 0.09, "predicted_step_s": 0.1,
        "predicted_steps_s": [0.12, 0.12, 0.12, 0.12, 0.1, 0.1, 0.1],
    }  # fmt: skip
    text = markdown({"cap": "16GiB", "device": "GPU", "predicted_reference": 8, "reference_trials": {"8": True}, "rows": [row]})
    assert "| 16 (2x) | trained | checkpoint blocks.0-8 | 1.00 GiB / 2.00 GiB | 1.00 GiB / 2.00 GiB | 0 | 500.0 ms | 90.0 ms | 100.0 ms (0.90x) | after step 3 |" in text
