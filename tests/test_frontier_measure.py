"""``benchmarks/frontier.py --measure`` (issue 38): each frontier row's plan run on the GPU beside its
prediction. Here, without CUDA: the plan applied to a plain module as ``LightMem`` would apply it,
and the no-GPU paths. The measurement itself runs in ``python -m lightmem.selfcheck --sections frontier``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import TinyGPT, gpt_loss

from lightmem import plan
from lightmem.config import OffloadSettings
from lightmem.estimate.frontier import FrontierRow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import frontier as frontier_benchmark  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")


def test_a_rows_plan_is_applied_to_a_plain_module_with_its_checkpoint_policy_and_offload_flags():
    model, tokens = TinyGPT(), torch.randint(0, 128, (2, 32))
    chosen = plan(model, tokens, "1GiB", gpt_loss, gpu="h100")
    offload = OffloadSettings.parse(min_bytes="2MiB", include=["blocks.1"], prefetch="8MiB", max_inflight_bytes="16MiB")
    chosen = replace(chosen, checkpoint=["blocks.0", "blocks.2"], checkpoint_policy="save_matmuls", offload=offload)
    handle, offloader = frontier_benchmark.apply_plan(model, chosen)
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
    chosen = plan(model, tokens, "1GiB", gpt_loss, gpu="h100")
    assert (chosen.checkpoint, chosen.offload) == ([], None)
    assert frontier_benchmark.apply_plan(model, chosen) == (None, None)


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
