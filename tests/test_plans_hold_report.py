"""``benchmarks/plans_hold.py``'s report of a GPU run: the steady step of the last plan and when
``plan="auto"`` planned again (it may after timing blocks in steps 1-3), from the per-step figures."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from plans_hold import final_plan_steady, markdown, replan_lines, replans, steps_line  # noqa: E402


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
    assert "| 16 (2x) | trained | checkpoint blocks.0-8 | 1.00 GiB / 2.00 GiB | 1.00 GiB / 2.00 GiB | 0 | 500.0 ms | 90.0 ms | 100.0 ms (0.90x) | - | after step 3 |" in text


def test_the_report_shows_each_plan_a_fit_ran_and_why_it_planned_again():
    # The H100's third run re-planned batch 16 after step 3 into a plan that measured 105 ms where the
    # second run's measured 87 ms: the report must show both plans and the reason plan="auto" gave.
    row = {
        "batch": 16, "multiple": 2, "outcome": "trained", "step_times_s": [0.5, 0.09, 0.088, 0.09, 0.4, 0.105, 0.104],
        "plans": [
            {"from_step": 0, "plan": ["checkpoint blocks.0-8 (Block)"], "predicted_s": 0.091},
            {"from_step": 4, "plan": ["checkpoint blocks.9-15 (Block)", "offload lm_head (Linear)"], "predicted_s": 0.1029},
        ],
        "replan_reasons": ["block blocks.12's forward measured 3.1 ms, 1.31x its priced 2.4 ms"],
    }  # fmt: skip
    assert replan_lines(row) == [
        "- batch 16, steps 0-3: checkpoint blocks.0-8 (Block), predicted 91.0 ms, measured 90.0 ms",
        "- batch 16, steps 4-6: checkpoint blocks.9-15 (Block); offload lm_head (Linear), predicted 102.9 ms, measured 104.5 ms",
        "- batch 16: planned again because block blocks.12's forward measured 3.1 ms, 1.31x its priced 2.4 ms",
    ]
    assert replan_lines({**row, "plans": row["plans"][:1]}) == []
    result = {"cap": "16GiB", "device": "GPU", "predicted_reference": 8, "reference_trials": {"8": True},
              "rows": [{**row, "measured_allocated": 1, "measured_reserved": 1, "alloc_retries": 0}]}  # fmt: skip
    assert "\nPlanned again:\n\n- batch 16, steps 0-3:" in markdown(result)


def test_gpt2s_report_names_its_model_and_labels_its_rows_by_the_frontier():
    # GPT-2's fits run at the frontier's batches (no reference trials): the header says so, and each
    # row carries its frontier label.
    row = {
        "batch": 5, "label": "1.5x", "outcome": "trained", "plan": "checkpoint transformer.h.0-8 (GPT2Block)",
        "predicted_allocated": 2**30, "predicted_reserved": 2**31, "measured_allocated": 2**30,
        "measured_reserved": 2**31, "alloc_retries": 0, "step_times_s": [0.5, 0.08, 0.08], "steady_s": 0.08,
        "predicted_step_s": 0.0765, "predicted_steps_s": [0.0765] * 3,
    }  # fmt: skip
    text = markdown({"cap": "8GiB", "device": "GPU", "model": "gpt2", "predicted_reference": None,
                     "reference_trials": {}, "rows": [row]})  # fmt: skip
    assert "GPU, cap 8GiB (`set_per_process_memory_fraction`), GPT-2 (transformers' default config, 1024 tokens)" in text
    assert "| 5 (1.5x) | trained | checkpoint transformer.h.0-8 (GPT2Block) |" in text
    assert "| 80.0 ms | 76.5 ms (1.05x) | - |" in text


def test_each_row_costs_per_sample_against_the_measured_1x_and_the_steps_are_judged_against_15_percent():
    # GPT-2 on the H200 (2026-11-28, docs/gpu-runs): batch 3 (1x) and 5 (1.5x), steady steps and the
    # last plans' predictions as measured there. Per sample, 1.5x cost 1.01x the measured 1x; the 1x
    # step measured 1.18x its prediction (host-bound), 1.5x 0.98x.
    rows = [
        {"batch": 3, "label": "1x", "outcome": "trained", "plan": "nothing", "steady_s": 0.03470224599999483,
         "predicted_step_s": 0.02933249161997032},
        {"batch": 5, "label": "1.5x", "outcome": "trained", "plan": "checkpoint transformer.h.0-8 (GPT2Block)",
         "steady_s": 0.058293144999993274, "predicted_step_s": 0.05953923136557706},
        {"batch": 8, "label": "largest", "outcome": "refused before its forward (right)"},
    ]  # fmt: skip
    text = markdown({"cap": "8GiB", "device": "NVIDIA H200", "model": "gpt2", "predicted_reference": None,
                     "reference_trials": {}, "rows": rows})  # fmt: skip
    table = [line for line in text.splitlines() if line.startswith("| 3 (1x)") or line.startswith("| 5 (1.5x)")]
    assert [line.split(" | ")[-2] for line in table] == ["1.00x", "1.01x"]
    assert "| 8 (largest) | refused before its forward (right) | - | - | 0 B / 0 B | - | - | - | - | - | - |" in text
    assert steps_line(rows) == "**Steps:** 1 of 2 steady steps within 15% of their prediction (off: batch 3 1.18x)"
    assert "\n**Steps:** 1 of 2" in text and "the 1x batch did not train" not in text
    without_1x = markdown({"cap": "8GiB", "device": "GPU", "model": "gpt2", "predicted_reference": None,
                           "reference_trials": {}, "rows": rows[1:]})  # fmt: skip
    assert "Per sample: the 1x batch did not train here, so no row is told against a measured 1x." in without_1x
