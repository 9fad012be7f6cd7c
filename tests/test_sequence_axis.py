"""The sequence axis (issue 59): the batch's sequence is found (or named), ``max_sequence_length`` answers
the longest sequence with its plan and its time per token, that length trains within the budget on the
CPU (MemTracker's peak), ``plan="auto"`` re-plans before each longer batch and refuses one a quarter
past the answer before its forward, and the frontier's rows can be lengths."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch
from lit_models import cpu_trainer
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader

from lightmem import LightMem, PlanDoesNotFit, frontier, max_sequence_length
from lightmem.estimate.trace.batch import SequenceAxis, sequence_axis

transformers = pytest.importorskip("transformers")

BUDGET = 20 << 20
"""A CPU budget that a 2-layer Llama (width 64, MLP 512, eager attention) fits at 512 positions without
lightmem and, with a plan, at a few hundred more."""

_MEASURE = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_sequence_axis import llama, tokens
from test_tiling_estimate import llama_loss
from lightmem import apply_checkpointing, apply_tiling
from lightmem.testing.measure import measure_cpu_step
torch.set_num_threads(1)
module = torch.nn.Module()
module.model = llama()  # the plan names LitLlama's modules
if {checkpoint!r}:
    apply_checkpointing(module, {checkpoint!r})
if {tile!r}:
    apply_tiling(module, {tile!r})
print(json.dumps(measure_cpu_step(module.model, tokens({length}), llama_loss).peak_bytes))
"""


def llama() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=4096, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def tokens(length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids.clone()}


class LitLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama()
        self.lengths: list[int] = []  # of the batches its real training steps ran

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if not is_fake(batch["input_ids"]):  # the planner's dry run runs it too, on a stand-in
            self.lengths.append(batch["input_ids"].shape[1])
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_sequence_is_found_in_token_ids_or_vectors_and_named_otherwise():
    assert sequence_axis(tokens(33), None, fn_name="f") == SequenceAxis(1, 33)
    assert sequence_axis(torch.zeros(2, 37, 16), None, fn_name="f") == SequenceAxis(1, 37)
    assert sequence_axis(torch.zeros(2, 8, 37, 16), 2, fn_name="f") == SequenceAxis(2, 37)
    with pytest.raises(ValueError, match=r"f\(batch=...\): no tensor of the batch holds a sequence .* f\(seq_dim=...\)"):
        sequence_axis(torch.zeros(8, 16), None, fn_name="f")  # features, not positions
    with pytest.raises(ValueError, match=r"f\(seq_dim=...\): no tensor of the batch has a dimension 2"):
        sequence_axis(tokens(33), 2, fn_name="f")
    with pytest.raises(ValueError, match=r"f\(seq_dim=...\): expected a dimension after the batch's"):
        sequence_axis(tokens(33), 0, fn_name="f")


@pytest.fixture(scope="module")
def longest():
    return max_sequence_length(LitLlama(), tokens(256), BUDGET, device="cpu", multiple_of=64)


def test_the_longest_sequence_comes_with_its_plan_its_time_per_token_and_what_stopped_it(longest):
    assert (longest.baseline, longest.planned, longest.limited_by) == (512, 704, "device")
    assert longest.plan.fits and longest.plan.predicted_total_bytes <= BUDGET
    assert longest.plan.checkpoint == ["model.model.layers.0"]
    assert longest.seconds_per_token == longest.plan.step_seconds / 704
    assert longest.to_dict()["seconds_per_token"] == longest.seconds_per_token
    text = longest.to_text()
    assert text.startswith("Longest sequence (batch 1, dimension 1) that fits 20.00 MiB")
    assert "past it the device's memory sets the limit" in text


def test_the_longest_sequence_with_its_plan_trains_within_the_budget_on_the_cpu(longest):
    # MemTracker measures the real step in a child process (its hooks keep the measured model alive).
    kwargs = longest.plan.lightmem_kwargs()
    script = _MEASURE.format(
        tests=os.path.dirname(__file__), checkpoint=kwargs.get("checkpoint"), tile=kwargs.get("tile"), length=longest.planned
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured <= BUDGET
    assert abs(measured - longest.plan.predicted_peak_bytes) <= 16  # eager attention: the CPU estimate is the step's


def test_plan_auto_replans_before_each_longer_batch_and_refuses_a_quarter_past_the_longest_before_its_forward(longest, caplog):
    lengths = [256, 512, longest.planned, longest.planned * 5 // 4]
    module = LitLlama()
    callback = LightMem(plan="auto", device_budget=BUDGET, offload_devices=["cpu"])
    loader = DataLoader([tokens(length) for length in lengths], batch_size=None)
    with caplog.at_level(logging.INFO), pytest.raises(PlanDoesNotFit, match="Training stopped before this batch's forward"):
        cpu_trainer([callback], max_steps=len(lengths)).fit(module, loader)
    planned = [message for record in caplog.records if (message := record.getMessage()).startswith("lightmem: planned batches of")]
    assert [line.split(" in ")[0] for line in planned] == [f"lightmem: planned batches of [1, {n}], [1, {n}]" for n in lengths]
    assert module.lengths == lengths[:3]  # the longest trained; the one past it never ran its forward
    assert callback.chosen_plan.lightmem_kwargs() == longest.plan.lightmem_kwargs()


def test_the_frontiers_rows_can_be_sequence_lengths(longest):
    found = frontier(LitLlama(), tokens(256), BUDGET, device="cpu", axis="sequence", multiple_of=64, multiples=(1,))
    assert (found.axis, found.reference_batch, found.largest_batch) == ("sequence", 512, 704)
    assert [(row.batch_size, row.label) for row in found.rows] == [(512, "1x"), (704, "largest")]
    lines = found.to_text().splitlines()
    assert lines[0] == "Frontier on 20.00 MiB: reference length 512 (the largest without lightmem), largest with a plan 704"
    assert lines[1].split()[:2] == ["length", "plan"] and "per position" in lines[1]
    with pytest.raises(ValueError, match=r"frontier\(axis=...\): expected 'batch' or 'sequence'"):
        frontier(LitLlama(), tokens(256), BUDGET, device="cpu", axis="tokens")


def test_along_the_sequence_the_model_state_goes_to_the_host_where_the_host_stopped_the_plans_too():
    # At long context the configurations that fit the device without model-state offload can be the ones
    # that offload the most (Llama-3.1-8B at 730K positions on an H200, 1 TiB host: every one over the
    # host); gradients and optimizer state on the host free the device for configurations that offload
    # less. The retry was taken only where the device's budget stopped the plans.
    from lightmem.estimate.planning.result import Plan
    from lightmem.estimate.planning.space import plan_space

    model = llama()
    space = plan_space(model, tokens(256), lambda module, batch: module(**batch).loss, budget="64MiB", device="cuda", gpu="h100", fn_name="plan")
    asked: list[bool] = []

    def searched(budget_bytes: int, other: Plan | None, *, model_state: bool = False) -> Plan:
        asked.append(model_state)
        found = Plan([], None, 0, 0, budget_bytes, model_state, "", offload_optimizer=model_state)
        found.limited_by = "" if model_state else "host"
        return found

    space._plan = searched  # type: ignore[method-assign]
    assert not space.plan(1 << 26).fits and asked == [False]  # a batch space: no retry
    space.model_state_when_needed = True
    chosen = space.plan(1 << 26)
    assert (chosen.fits, chosen.offload_optimizer, asked) == (True, True, [False, False, True])
