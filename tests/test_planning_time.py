"""Planning is visible and traces each configuration once (issue 50): ``plan="auto"`` says what it plans
before the fit waits for it and how long it took, and a configuration traced for one plan is not
traced again for the next plan of the same batches (new prices, another budget, the other checkpoint
policy)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from lit_models import LitGPT, cpu_trainer
from models import TinyGPT, gpt_loss
from torch.utils.data import DataLoader

from lightmem import LightMem, plan

BUDGET = 4_496_356  # TinyGPT of 3 blocks: 4 x 33 tokens checkpoint a block within it (test_callback_auto_plan)


def _tokens(batch: int, seq: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq)),)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_plan_auto_says_what_it_plans_before_the_fit_waits_for_it_and_how_long_it_took(caplog):
    callback = LightMem(plan="auto", device_budget=BUDGET, offload_devices=["cpu"])
    with caplog.at_level(logging.INFO):
        cpu_trainer([callback], max_steps=2).fit(LitGPT(), DataLoader([_tokens(4, 33)] * 2, batch_size=None))
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("lightmem: plan")]
    assert lines[0] == (
        "lightmem: plan='auto' is planning for batches of [4, 33] within a 4.29 MiB device budget (each "
        "configuration's step traced on fake tensors)"
    )
    took = re.fullmatch(r"lightmem: planned batches of \[4, 33\] in (\d+\.\d) s \((\d+) configuration\(s\) traced on fake tensors\)", lines[1])
    assert took is not None
    assert int(took.group(2)) == callback.chosen_plan.evaluations > 0
    assert lines[2].startswith("lightmem: plan for a 4.29 MiB device budget: checkpoint ['model.blocks.0']")


def test_a_second_plan_for_the_same_batches_traces_nothing_again():
    model = LitGPT()
    first = plan(model, _tokens(4, 33), BUDGET, device="cpu")
    assert first.checkpoint and first.evaluations > 0
    again = plan(model, _tokens(4, 33), BUDGET, device="cpu", flops_per_s=1e12)  # new prices, same steps
    assert again.evaluations == 0 and again.checkpoint == first.checkpoint
    assert again.predicted_total_bytes == first.predicted_total_bytes
    narrower = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    model.model.blocks[0].mlp = narrower  # changed in place: its steps are its own
    assert plan(model, _tokens(4, 33), BUDGET, device="cpu").evaluations > 0


def test_a_plain_module_planned_again_with_an_optimizer_by_name_traces_nothing_again():
    # The name's optimizer factory is one object at every parse: made anew each call, it matched no
    # step planned before, and every plan of a plain module traced its whole search again.
    model, loss = TinyGPT(depth=3), lambda m, batch: gpt_loss(m, batch[0])
    first = plan(model, _tokens(4, 33), BUDGET, loss, optimizer="adamw", device="cpu")
    assert first.checkpoint and first.evaluations > 0
    assert plan(model, _tokens(4, 33), BUDGET, loss, optimizer="adamw", device="cpu").evaluations == 0
