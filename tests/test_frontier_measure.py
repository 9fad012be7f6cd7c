"""``benchmarks/frontier.py --measure`` (issue 38): each frontier row's plan run on the GPU beside its
prediction. Here, without CUDA: the plan applied to a plain module as ``LightMem`` would apply it,
and the no-GPU paths. The measurement itself runs in ``python -m lightmem.selfcheck --sections frontier``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import TinyGPT, gpt_loss

from lightmem import plan
from lightmem.checkpoint import is_checkpointed
from lightmem.config import OffloadSettings
from lightmem.estimate.frontier import FrontierRow, measured_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import frontier as frontier_benchmark  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")


def test_a_rows_plan_is_applied_to_a_plain_module_with_its_checkpoint_policy_and_offload_flags():
    model, tokens = TinyGPT(), torch.randint(0, 128, (2, 32))
    chosen = plan(model, tokens, "2GiB", gpt_loss, gpu="h100")
    offload = OffloadSettings.parse(min_bytes="2MiB", include=["blocks.1"], prefetch="8MiB", max_inflight_bytes="16MiB")
    chosen = replace(chosen, checkpoint=["blocks.0", "blocks.2"], checkpoint_policy="save_matmuls", offload=offload)
    handle, offloader = frontier_benchmark.apply_plan(model, chosen.lightmem_kwargs())
    try:
        assert handle.modules == ["blocks.0", "blocks.2"]
        settings = offloader.settings
        assert (settings.min_bytes, settings.include, settings.prefetch_bytes, offloader.max_inflight_bytes) == (
            2 << 20, ("blocks.1",), 8 << 20, 16 << 20,
        )
        with offloader:
            loss = gpt_loss(model, tokens)
        loss.backward()  # on the CPU nothing moves (the offloader serves CUDA); the step still runs
        assert all(p.grad is not None for p in model.parameters())
    finally:
        handle.remove()


def test_a_plan_without_checkpoint_or_offload_applies_nothing():
    model, tokens = TinyGPT(), torch.randint(0, 128, (2, 32))
    chosen = plan(model, tokens, "2GiB", gpt_loss, gpu="h100")
    assert (chosen.checkpoint, chosen.offload) == ([], None)
    assert frontier_benchmark.apply_plan(model, chosen.lightmem_kwargs()) == (None, None)


def test_a_plan_that_moves_model_state_is_refused_by_name_not_run_without_it():
    with pytest.raises(ValueError, match=r"^apply_plan: this benchmark does not apply offload_optimizer$"):
        frontier_benchmark.apply_plan(TinyGPT(), {"offload": False, "offload_optimizer": True})


@NO_CUDA
def test_without_cuda_measure_says_so_and_the_selfcheck_section_measures_nothing(capsys):
    assert frontier_benchmark.main(["--measure"]) == 0
    assert capsys.readouterr().out == (
        "frontier: no CUDA device here: nothing to measure (run without --measure for the predictions)\n"
    )
    assert frontier_benchmark.selfcheck_section() == "## The frontier, measured\n\nNo CUDA device: nothing to measure.\n"


def test_the_measured_table_says_which_steps_are_off_their_prediction():
    rows = [_row(10, "1x", 0.070), _row(15, "1.5x", 0.110), _row(30, "3x", 0.0, fits=False)]
    result = SimpleNamespace(rows=rows, speeds=SimpleNamespace(describe=lambda: "an H100 (measured)"))
    text = frontier_benchmark.measured_table(
        result, [{"outcome": "ran", "step_s": 0.075}, {"outcome": "ran", "step_s": 0.140}, {"outcome": "does not fit"}]
    )
    assert text.endswith("Verdict: off by more than 15%: 15 (1.27x)\n")
    assert "1.07x" in text and "does not fit" in text


def _row(batch, label, step_s, fits=True):
    return FrontierRow(batch, label, fits, "nothing", 0, step_s, step_s, 0.007)


def test_the_rows_and_plans_saved_for_a_gpu_are_read_back_as_planned(tmp_path):
    # --save-plans here, --measure --plans there: the GPU spends none of its minutes planning.
    from lightmem.devices import GPU_TABLE
    from lightmem.estimate.frontier import Frontier

    model, tokens = TinyGPT(), torch.randint(0, 128, (2, 32))
    nothing = plan(model, tokens, "2GiB", gpt_loss, gpu="h100")
    offload = OffloadSettings.parse(min_bytes="2MiB", include=["blocks.1"], prefetch="8MiB", max_inflight_bytes="16MiB")
    moving = replace(nothing, checkpoint=["blocks.0"], checkpoint_policy="save_matmuls", offload=offload, host_bytes=3 << 20)
    rows = [_row(10, "1x", 0.070), _row(15, "1.5x", 0.110), _row(30, "3x", 0.0, fits=False)]
    result = Frontier(1 << 30, 10, 15, rows, GPU_TABLE["h100"], {10: nothing, 15: moving})
    planned = frontier_benchmark.Planned.of(result)
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"tiny": planned.to_dict()}))
    back = frontier_benchmark.Planned.from_dict(json.loads(path.read_text())["tiny"])
    assert back == planned
    assert back.kwargs == {10: {"offload": False}, 15: moving.lightmem_kwargs()}
    assert back.kwargs[15]["checkpoint_policy"] == "save_matmuls" and back.host_bytes == {10: 0, 15: 3 << 20}
    assert (back.speeds, back.rows, back.reference_batch, back.largest_batch) == (GPU_TABLE["h100"], rows, 10, 15)


def _tiny_case(**overrides):
    case = {"real": TinyGPT, "optimizer": "adamw", "precision": "32-true", "loss_fn": gpt_loss,
            "make_batch": lambda n, device: torch.randint(0, 128, (n, 32), device=device)}  # fmt: skip
    return {**case, **overrides}


def _counting_timer():
    calls = []

    def timer(run):
        run()
        calls.append(1)
        return 0.01 * len(calls)

    return timer, calls


def test_a_row_runs_two_warm_ups_then_its_timed_steps_with_the_plan_applied_and_removed_after():
    # The loop of --measure, on the CPU (the device and the timer are the GPU's by default).
    timer, calls = _counting_timer()
    kwargs = {"offload": False, "checkpoint": ["blocks.0", "blocks.1"], "checkpoint_policy": "save_matmuls"}
    seen = []
    case = _tiny_case(real=lambda: seen.append(TinyGPT()) or seen[-1])
    got = frontier_benchmark.measure_row(case, kwargs, 0, 2, 3, device=torch.device("cpu"), timer=timer)
    assert got == {"outcome": "ran", "steps_s": [0.03, 0.04, 0.05], "step_s": 0.04, "reserved": None}
    assert len(calls) == 5
    model = seen[0]
    assert all(p.grad is None for p in model.parameters())  # the optimizer stepped and zeroed them
    assert not any(is_checkpointed(block) for block in model.blocks)  # the plan was removed after the row


def test_a_row_that_fails_is_reported_as_its_outcome_and_the_next_row_still_runs():
    def broken_loss(model, tokens):
        raise RuntimeError("shape mismatch\nsecond line")

    timer, _ = _counting_timer()
    failed = frontier_benchmark.measure_row(_tiny_case(loss_fn=broken_loss), {"offload": False}, 0, 2, 2,
                                            device=torch.device("cpu"), timer=timer)  # fmt: skip
    assert failed == {"outcome": "failed: RuntimeError: shape mismatch", "steps_s": [], "step_s": None, "reserved": None}
    ran = frontier_benchmark.measure_row(_tiny_case(), {"offload": False}, 0, 2, 2, device=torch.device("cpu"), timer=timer)
    assert ran["outcome"] == "ran" and len(ran["steps_s"]) == 2


def test_the_verdict_names_rows_that_did_not_run_and_says_when_none_did():
    rows = [_row(10, "1x", 0.070), _row(15, "1.5x", 0.110), _row(20, "2x", 0.150)]
    result = SimpleNamespace(rows=rows, speeds=SimpleNamespace(describe=lambda: "an H100 (measured)"))
    ran = {"outcome": "ran", "step_s": 0.072, "reserved": 3 << 30}
    text = frontier_benchmark.measured_table(
        result, [ran, {"outcome": "OUT OF MEMORY", "reserved": 16 << 30}, {"outcome": "not run (time limit)"}]
    )
    assert text.endswith("Verdict: every measured step within 15% of its prediction (1 rows); did not run: 15 (OUT OF MEMORY)\n")
    assert "3.00 GiB of" in text
    none = frontier_benchmark.measured_table(result, [{"outcome": "not run (time limit)"}] * 3)
    assert none.endswith("Verdict: no row ran\n")


# The GPT of the GPU runs under 16 GiB, planned at the H100's prices, run on the H200 on 2026-11-28
# (../shared/gpu-runs/2026-11-28/frontier.json): predicted step and floor, then the measured step.
H200_GPT = [
    (10, "1x", 0.055485199913772876, 0.055485199913772876, 0.04538591957092285),
    (15, "1.5x", 0.08456832250956707, 0.07583287039027652, 0.08309894561767578),
    (20, "2x", 0.1173258336384596, 0.10673547189814692, 0.11601756668090821),
    (28, "largest", 0.17300367690687363, 0.15600663752435912, 0.17735049438476563),
]


def test_measured_rows_tell_each_sample_against_the_measured_1x_and_their_distance_to_the_floor():
    # The H200 ran the 1x step at 4.5 ms a sample where 5.5 ms was predicted: against the prediction
    # the larger batches cost 9-19% per sample more; against the measured 1x, 22-40%.
    rows = [FrontierRow(b, label, True, "plan", 0, step, floor, H200_GPT[0][2] / 10) for b, label, step, floor, _ in H200_GPT]
    measured = measured_rows(rows, {b: got for b, *_, got in H200_GPT})
    assert [f"{row.vs_reference:.2f}" for row in measured] == ["1.00", "1.02", "1.06", "1.11"]
    assert [f"{row.measured_vs_reference:.2f}" for row in measured] == ["1.00", "1.22", "1.28", "1.40"]
    pace = H200_GPT[0][4] / H200_GPT[0][2]  # the device ran the 1x step at 0.82x its price
    assert [row.measured_vs_floor for row in measured] == [got / (floor * pace) for *_, floor, got in H200_GPT]
    assert [f"{row.measured_vs_floor:.2f}" for row in measured] == ["1.00", "1.34", "1.33", "1.39"]
    unmeasured = measured_rows(rows, {15: 0.083})  # without the reference: nothing to tell against
    assert unmeasured[1].measured_step_s == 0.083 and unmeasured[1].measured_vs_reference is None


def test_the_measured_table_tells_per_sample_costs_against_the_measured_1x():
    rows = [FrontierRow(b, label, True, "plan", 0, step, floor, H200_GPT[0][2] / 10) for b, label, step, floor, _ in H200_GPT]
    result = SimpleNamespace(rows=rows, speeds=SimpleNamespace(describe=lambda: "an H100 (measured)"))
    text = frontier_benchmark.measured_table(result, [{"outcome": "ran", "step_s": got} for *_, got in H200_GPT])
    assert "per sample vs 1x, measured (predicted)" in text and "measured / floor at the measured pace" in text
    assert "1.40x (1.11x)" in text and "1.39x" in text
