"""The planner with a chunked loss: a batch no plan fits because of the loss's logits is planned
again with the loss priced as chunked (``Plan.chunked_loss``), ``frontier`` adds the rows a chunked
loss reaches, ``plan="auto"``'s refusal names the change in the user's line and the batch it would
reach, and the GPT of benchmarks/plans_hold.py with ``lightmem.linear_cross_entropy`` plans five
times its largest batch without lightmem under 16 GiB at an H200's speeds.

A 2-block GPT of width 64 with a 32,000-token vocabulary (its logits are most of its step, and its
fake steps are cheap) stands for the logits-dominated case, priced at an H200's table speeds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from lit_models import cpu_trainer
from models import TinyGPT, chunked_gpt_loss, gpt_loss

from lightmem import LightMem, PlanDoesNotFit, frontier, plan

CHECKOUT = Path(__file__).resolve().parent.parent
COMMON = {"gpu": "h200", "overhead_bytes": 0}
BUDGET = "700MiB"
"""Batch 8 fits without lightmem and 24 (3x) fits no plan as written; with the loss chunked 24 fits
without lightmem (its logits in one chunk of 250 MiB, as 3072 rows of 32,000 logits take more)."""


def _wide_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=32_000, dim=64, depth=2, seq=128)


def _tokens(batch: int) -> torch.Tensor:
    return torch.zeros(batch, 129, dtype=torch.long)


def test_a_batch_no_plan_fits_for_its_logits_is_planned_again_with_the_loss_priced_as_chunked():
    refused = plan(_wide_gpt(), _tokens(24), BUDGET, gpt_loss, **COMMON)
    chunked = refused.chunked_loss
    assert not refused.fits and chunked is not None and chunked.fits and chunked.chunked_loss is None
    # The loss priced as chunked is what the chunked loss itself plans, a little above it.
    real = plan(_wide_gpt(), _tokens(24), BUDGET, lambda m, t: chunked_gpt_loss(m, t, None), **COMMON)
    assert real.fits and real.chunked_loss is None and real.parts() == chunked.parts()
    assert real.predicted_peak_bytes <= chunked.predicted_peak_bytes <= 1.01 * real.predicted_peak_bytes
    assert refused.describe().splitlines()[-1] == (
        f"  with a chunked loss (lightmem.linear_cross_entropy): fits at "
        f"{_size(chunked.predicted_total_bytes)}: nothing; predicted step {_seconds(chunked.step_seconds)}"
    )
    assert refused.to_dict()["chunked_loss"] == chunked.to_dict()


def test_a_step_priced_as_chunked_is_never_served_from_the_steps_verified_as_written():
    # The planner remembers verified steps across plans of one model: the what-if plan with the
    # loss priced as chunked must trace its own (it found the steps as written and kept refusing).
    from lightmem.estimate.planning.space import plan_space

    model = _wide_gpt()
    written = plan_space(model, _tokens(24), gpt_loss, **COMMON)
    as_written = [written.verify(candidate).peak_bytes for candidate in written.extremes()]
    space = plan_space(model, _tokens(24), gpt_loss, loss_as_chunked=True, **COMMON)
    chunked = [space.verify(candidate).peak_bytes for candidate in space.extremes()]
    assert space.traced == len(chunked) > 0
    assert all(peak < peak_as_written for peak, peak_as_written in zip(chunked, as_written))


def test_a_plan_that_fits_or_misses_for_other_reasons_is_not_planned_again():
    assert plan(_wide_gpt(), _tokens(2), BUDGET, gpt_loss, **COMMON).chunked_loss is None
    # Batch 3 of a model without a vocabulary-sized head: nothing fits a tiny budget, no logits.
    assert plan(TinyGPT(), torch.zeros(3, 33, dtype=torch.long), "1MiB", gpt_loss, **COMMON).chunked_loss is None


def test_frontier_adds_the_rows_a_chunked_loss_reaches_against_the_same_reference():
    # On "cpu" (a plan checkpoints only: fewer fake steps), the search for the largest batch
    # stopped at 60: the rows past 2.5x are what this is about.
    found = frontier(
        _wide_gpt(), _tokens(2), BUDGET, gpt_loss, multiples=(1, 3), checkpoint_policy="full", limit=60,
        device="cpu", **COMMON,
    )  # fmt: skip
    assert (found.reference_batch, [(row.batch_size, row.fits) for row in found.rows]) == (13, [(13, True), (39, False)])
    chunked = found.chunked_loss
    assert chunked is not None and chunked.reference_batch == 13 and chunked.largest_batch == 60
    assert [(row.batch_size, row.label, row.fits) for row in chunked.rows] == [(39, "3x", True), (60, "largest", True)]
    assert all(row.reference_per_sample_s == found.rows[0].reference_per_sample_s for row in chunked.rows)
    text = found.to_text()
    assert (
        f"With a chunked loss (lightmem.linear_cross_entropy; the loss's logits dominate the rows that do not fit): "
        f"largest with a plan {chunked.largest_batch}\n"
    ) in text
    assert found.to_dict()["chunked_loss"]["largest_batch"] == 60
    assert found.plans[39].chunked_loss is chunked.plans[39]


class _LitWideGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _wide_gpt()

    def training_step(self, batch, batch_idx):
        return gpt_loss(self.model, batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_plan_auto_refusal_names_the_change_in_the_users_line_and_the_batch_it_would_reach():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens(16)), batch_size=8)
    with pytest.raises(PlanDoesNotFit) as raised:
        callback = LightMem(plan="auto", device_budget="300MiB", checkpoint_policy="full", metrics=[])
        cpu_trainer([callback], max_steps=1).fit(_LitWideGPT(), loader)
    message = str(raised.value)
    start = message.index(" To chunk the loss: ")
    end = message.index(" Training stopped")
    assert message[start:end] == (
        " To chunk the loss: in models.py:64, `return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), "
        "tokens[:, 1:].reshape(-1))`, compute the loss as `lightmem.linear_cross_entropy(hidden, "
        "model.lm_head.weight, tokens[:, 1:].reshape(-1))`, where hidden is the output of model.ln_f, which "
        "model.lm_head reads (have the model return it in place of the logits). With it this batch fits (without lightmem, predicted step "
        f"{message.split('predicted step ')[1].split(')')[0]}) and plans fit batches up to 14."
    )
    assert "The largest batch a plan fits is 5 (this one: 8)." in message


def test_the_plans_hold_gpt_with_the_chunked_loss_plans_five_times_its_batch_under_16_gib_on_an_h200(monkeypatch):
    """benchmarks/plans_hold.py's GPT (16 blocks, dim 1024, 1024 tokens, vocab 32,000, bf16-mixed,
    fused AdamW) trains batch 11 at most without lightmem on an H200 under 16 GiB (measured,
    2026-11-28), and plan="auto" refused 5x (55) for the loss's logits. With the loss chunked, a plan
    fits 55 at the H200's table speeds."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as plan="auto" sets them
    sys.path[:0] = [str(CHECKOUT / "benchmarks"), str(CHECKOUT / "examples")]
    try:
        import plans_hold
    finally:
        del sys.path[:2]
    spec = plans_hold.MODELS["gpt-chunked"]
    found = plan(
        spec["meta"](), spec["batch"](55), plans_hold.CAP, spec["loss"], optimizer=spec["optimizer"],
        precision="bf16-mixed", device="cuda", gpu="h200", checkpoint_policy="full",
    )  # fmt: skip
    assert found.fits and found.predicted_total_bytes <= 16 * 2**30
    assert found.checkpoint and found.chunked_loss is None


def _size(nbytes: int) -> str:
    from lightmem.config import format_bytes

    return format_bytes(nbytes)


def _seconds(seconds: float) -> str:
    from lightmem.estimate.words import format_seconds

    return format_seconds(seconds)


def test_the_reach_in_words_says_nothing_when_not_a_batch_fits_and_not_even_1_as_written():
    from lightmem.estimate.chunked_loss import ChunkedLossReach, reach_sentence

    assert reach_sentence(ChunkedLossReach(2**30, 0, 0)) == "" and reach_sentence(None) == ""
    assert reach_sentence(ChunkedLossReach(2**30, 12, 0)) == (
        " Under the 1.00 GiB budget without lightmem, batches up to 12 would fit with it, not even 1 as written."
    )
