"""``LightMem(plan="auto")`` on its own: the budget of the device it runs on, plans that follow the
batch, and the predicted peak held against the measured one. On CPU, through a simulated device
(``lightmem.testing.device``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from exact import assert_state_equal
from lit_models import LitGPT, cpu_trainer, lit_gpt_class, token_loader
from test_callback_metrics import MemoryLogger
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import DataLoader

from lightmem import LightMem, PlanDoesNotFit, max_batch_size, plan
from lightmem import fit_session as fit_session_module
from lightmem.auto_plan import REPLAN_MARGIN, TIMED_STEPS, AutoPlan, covers, format_shapes, shapes_covering, twins
from lightmem.checkpoint import is_checkpointed
from lightmem.cli import main
from lightmem.device_memory import (
    FRAGMENTATION_MARGIN,
    NCCL_ALLOWANCE_BYTES,
    measure_device_budget,
    measured_speeds,
)
from lightmem.estimate.trace.batch import batch_shapes
from lightmem.estimate.words import format_seconds
from lightmem.estimate.pricing.timeline import forward_intervals
from lightmem.metrics.names import GiB
from lightmem.testing.device import SimulatedDeviceMemory, simulated_device

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")

# TinyGPT (depth 3) on CPU: within this budget a batch of 4 x 9 or 4 x 17 tokens needs nothing,
# 4 x 33 one checkpointed block and 8 x 33 more (asserted below against the planner itself).
BUDGET = 4_496_356
CAPACITY = 4_733_006  # the device whose budget is BUDGET: 5% of it is 236,650 bytes


def _tokens(batch, seq):
    return (torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq)),)


def growing_loader(shapes):
    """One batch of each shape, in order (variable sequence lengths, a larger last batch)."""
    return DataLoader([_tokens(*shape) for shape in shapes], batch_size=None)


def _lines(caplog):
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith("lightmem: ")]


def _predicted(chosen) -> str:
    """How the line at fit start and the re-plan lines give a plan's prediction, on a CPU (priced at
    the table's CPU figures: nothing measured)."""
    return (
        f"predicted peak {chosen.predicted_total_bytes / 2**20:.2f} MiB (reserved, overhead allowance included), "
        f"step {format_seconds(chosen.step_seconds)} (priced at CPU figures: a generic server CPU; not measured on "
        f"this machine): {chosen.slowdown:.2f}x the step without lightmem"
    )


def test_the_budget_is_free_memory_plus_what_this_process_holds_less_the_fragmentation_margin():
    device = SimulatedDeviceMemory(10_000, used_by_others_bytes=3_000, held_bytes=1_000)
    budget = measure_device_budget(device)
    assert (budget.free_bytes, budget.held_bytes, budget.total_bytes) == (6_000, 1_000, 10_000)
    assert budget.margin_bytes == int(7_000 * FRAGMENTATION_MARGIN) == 350
    assert budget.budget_bytes == 6_650
    assert budget.describe() == (
        "6.49 KiB (simulated device of 10000 bytes: 5.86 KiB free of 9.77 KiB + 1000 B held by this process, "
        "less 5% (350 B) for allocator fragmentation)"
    )


def test_the_guide_states_the_margin_and_the_nccl_allowance_the_code_uses():
    root = Path(__file__).parent.parent
    readme, design, docstring = (
        " ".join(text.split())
        for text in ((root / "README.md").read_text(), (root / "docs" / "callback.md").read_text(), LightMem.__doc__)
    )  # fmt: skip
    margin = f"{FRAGMENTATION_MARGIN:.0%}"
    assert f"less {margin} of that for the allocator's fragmentation" in readme
    assert f"less {margin} for fragmentation" in docstring
    replan = f"{REPLAN_MARGIN:.0%}"
    assert f"passes the prediction by more than {replan}" in readme and f"REPLAN_MARGIN`` ({replan})" in docstring
    assert f"{NCCL_ALLOWANCE_BYTES >> 20} MiB for the buffers NCCL" in readme
    assert f"({NCCL_ALLOWANCE_BYTES >> 20} MiB, an" in design


def test_without_a_budget_it_plans_for_what_the_simulated_device_gives_as_with_that_budget(caplog, lightning_package):
    module_class = lit_gpt_class(lightning_package)
    given = LightMem(plan="auto", device_budget=BUDGET, offload_devices=["cpu"])
    cpu_trainer([given], lightning_package, max_steps=1).fit(module_class(), token_loader())
    measured = LightMem(plan="auto", offload_devices=["cpu"])
    device = {"capacity_bytes": CAPACITY + 1_500, "used_by_others_bytes": 1_500, "held_bytes": 500}
    with simulated_device(**device), caplog.at_level(logging.INFO):
        cpu_trainer([measured], lightning_package, max_steps=1).fit(module_class(), token_loader())
    assert measured.chosen_plan.budget_bytes == BUDGET
    assert measured.chosen_plan.checkpoint == given.chosen_plan.checkpoint != []
    assert measured.chosen_plan.predicted_peak_bytes == given.chosen_plan.predicted_peak_bytes
    budget = measure_device_budget(SimulatedDeviceMemory(**device))
    assert [line for line in _lines(caplog) if "measured at fit start" in line] == [
        f"lightmem: plan='auto' device budget, measured at fit start: {budget.describe()}"
    ]


@pytest.mark.parametrize(("world_size", "expected"), [(1, 0), (2, NCCL_ALLOWANCE_BYTES)])
def test_a_measured_budget_sets_aside_only_what_is_not_allocated_yet(world_size, expected):
    # The CUDA context is already out of the free memory measured: only NCCL's buffers, which
    # collectives may still allocate, are set aside, and only with several ranks.
    with simulated_device(CAPACITY):
        measured = AutoPlan.at_fit_start(LightMem(plan="auto").settings.plan, torch.device("cuda", 0), world_size)
    assert measured.plan_overhead_bytes == expected
    given = AutoPlan.at_fit_start(LightMem(plan="auto", device_budget="20GiB").settings.plan, torch.device("cpu"), 1)
    assert given.plan_overhead_bytes is None  # the planner's own allowance (1 GiB on CUDA, 0 on CPU)


def test_without_a_budget_or_a_cuda_device_it_fails_at_fit_start_saying_what_to_pass():
    callback = LightMem(plan="auto")  # constructing it is fine: the device is known at fit start
    with pytest.raises(ValueError) as error:
        cpu_trainer([callback], max_steps=1).fit(LitGPT(), token_loader())
    assert str(error.value) == (
        "LightMem(plan=...): without device_budget, 'auto' plans for the memory the CUDA device can give this "
        "process, and the training device is 'cpu' (no CUDA device here); pass the budget to plan for, e.g. "
        "LightMem(plan='auto', device_budget='20GiB')"
    )
    assert callback.fit_session is None


def test_a_plan_covers_the_batches_no_larger_in_any_dimension_of_any_tensor():
    planned = batch_shapes({"tokens": torch.zeros(4, 33), "labels": torch.zeros(4)})
    assert planned == ((4, 33), (4,))  # in the batch's flattening order
    assert covers(planned, batch_shapes({"tokens": torch.zeros(2, 33), "labels": torch.zeros(2)}))
    assert not covers(planned, batch_shapes({"tokens": torch.zeros(2, 40), "labels": torch.zeros(2)}))
    assert not covers(planned, batch_shapes({"tokens": torch.zeros(4, 33)}))  # other tensors
    assert not covers(planned, batch_shapes({"tokens": torch.zeros(4, 33, 1), "labels": torch.zeros(4)}))
    assert format_shapes(planned) == "[4, 33], [4]"


def test_the_next_plan_covers_the_batch_and_every_batch_planned_for_before():
    assert shapes_covering(((4, 33), (4,)), ((8, 17), (8,))) == ((8, 33), (8,))  # elementwise maximum
    assert shapes_covering(None, ((8, 17),)) == ((8, 17),)  # the first batch
    assert shapes_covering(((4, 33), (4,)), ((8, 17),)) == ((8, 17),)  # other tensors: this batch alone
    assert shapes_covering(((4, 33),), ((8, 17, 2),)) == ((8, 17, 2),)


SHAPES = [(4, 9), (4, 9), (4, 17), (4, 33), (4, 17), (8, 33), (4, 33)]


def _record_plans(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of the first tensor of every batch the fit plans for, as it plans."""
    planned_for = []
    real_plan = fit_session_module.plan

    def spy(model, batch, budget, **kwargs):
        planned_for.append(tuple(batch[0].shape))
        return real_plan(model, batch, budget, **kwargs)

    monkeypatch.setattr(fit_session_module, "plan", spy)
    return planned_for


def test_a_fit_whose_batches_grow_replans_exactly_when_needed_and_trains_as_the_final_plan(monkeypatch, caplog):
    planned_for = _record_plans(monkeypatch)
    # What the planner chooses for each batch shape on its own, at the same budget.
    expected = {shape: plan(LitGPT(), _tokens(*shape), BUDGET, device="cpu").checkpoint for shape in set(SHAPES)}
    assert expected[(4, 9)] == expected[(4, 17)] == [] and [] != expected[(4, 33)] != expected[(8, 33)]

    callback = LightMem(plan="auto", offload_devices=["cpu"])
    checkpointed = []

    class Spy(pl.Callback):  # after each batch's forward and backward: what it ran under
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            checkpointed.append([name for name, module in pl_module.named_modules() if is_checkpointed(module)])

    pl.seed_everything(0, verbose=False)
    module = LitGPT()
    trainer = cpu_trainer([callback, Spy()], max_steps=len(SHAPES))
    with simulated_device(CAPACITY), caplog.at_level(logging.INFO):
        trainer.fit(module, growing_loader(SHAPES))

    # Planned for the first batch and for each one the plan in force did not cover: never for
    # (4, 9) again, nor for (4, 17) after (4, 33), nor for (4, 33) after (8, 33).
    assert planned_for == [(4, 9), (4, 17), (4, 33), (8, 33)]
    # Each new choice is in force from the forward of the batch it was made for.
    nothing, one, more = expected[(4, 9)], expected[(4, 33)], expected[(8, 33)]
    assert checkpointed == [nothing, nothing, nothing, one, one, more, more]
    final = callback.chosen_plan
    assert final.checkpoint == expected[(8, 33)]
    lines = [line for line in _lines(caplog) if line.startswith(("lightmem: plan for", "lightmem: re-planned"))]
    plans = {shape: plan(LitGPT(), _tokens(*shape), BUDGET, device="cpu") for shape in ((4, 9), (4, 33), (8, 33))}
    assert [plans[shape].predicted_total_bytes / 2**20 for shape in plans] == pytest.approx([3.05, 4.24, 4.16], abs=0.005)
    assert lines == [
        f"lightmem: plan for a 4.29 MiB device budget: checkpoint nothing, offload nothing; {_predicted(plans[(4, 9)])}",
        f"lightmem: re-planned for a larger batch ([4, 33]) at step 3: checkpoint {expected[(4, 33)]}, offload "
        f"nothing; {_predicted(plans[(4, 33)])} (was: checkpoint nothing, offload nothing)",
        f"lightmem: re-planned for a larger batch ([8, 33]) at step 5: checkpoint {expected[(8, 33)]}, offload "
        f"nothing; {_predicted(plans[(8, 33)])} (was: checkpoint {expected[(4, 33)]}, offload nothing)",
    ]
    pl.seed_everything(0, verbose=False)
    reference = LitGPT()
    same_from_the_start = LightMem(**final.lightmem_kwargs(), offload_devices=["cpu"])
    reference_trainer = cpu_trainer([same_from_the_start], max_steps=len(SHAPES))
    reference_trainer.fit(reference, growing_loader(SHAPES))
    assert_state_equal(reference, module, reference_trainer.optimizers[0], trainer.optimizers[0])


def _fit_recording_plans(monkeypatch, shapes):
    """Fit over one batch of each of ``shapes``; what each plan was made for, and after each batch
    the forward of each checkpointed block (the wrapper objects themselves)."""
    planned_for = _record_plans(monkeypatch)
    wrappers = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            modules = pl_module.named_modules()
            wrappers.append({name: module.__dict__["forward"] for name, module in modules if is_checkpointed(module)})

    callback = LightMem(plan="auto", offload_devices=["cpu"])
    with simulated_device(CAPACITY):
        cpu_trainer([callback, Spy()], max_steps=len(shapes)).fit(LitGPT(), growing_loader(shapes))
    return callback, planned_for, wrappers


def test_alternating_batch_shapes_are_planned_for_once_as_their_elementwise_maximum(monkeypatch, caplog):
    # A token-bucketed loader: neither shape covers the other; one plan for [8, 33] covers both.
    shapes = [(4, 33), (8, 17)] * 3
    with caplog.at_level(logging.INFO):
        callback, planned_for, wrappers = _fit_recording_plans(monkeypatch, shapes)
    assert planned_for == [(4, 33), (8, 33)]
    both = plan(LitGPT(), _tokens(8, 33), BUDGET, device="cpu").checkpoint
    assert callback.chosen_plan.checkpoint == both == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert [sorted(w) for w in wrappers] == [["model.blocks.0"]] + [both] * 5
    assert all(w == wrappers[1] for w in wrappers[1:])  # the same wrapper objects from the second batch on
    lines = [line for line in _lines(caplog) if line.startswith("lightmem: re-planned")]
    assert lines == [
        f"lightmem: re-planned for batches up to [8, 33] (this one: [8, 17]) at step 1: checkpoint {both}, "
        f"offload nothing; {_predicted(callback.chosen_plan)} (was: checkpoint ['model.blocks.0'], offload nothing)"
    ]


def test_a_replan_that_keeps_the_choice_leaves_the_checkpointed_blocks_untouched(monkeypatch, caplog):
    # Each batch is larger than the last and gets a plan, which each time checkpoints the same two
    # blocks: the wrappers applied for the first batch stay (a compiled model sees no change).
    with caplog.at_level(logging.INFO):
        callback, planned_for, wrappers = _fit_recording_plans(monkeypatch, [(5, 33), (6, 33), (7, 33)])
    assert planned_for == [(5, 33), (6, 33), (7, 33)]
    assert sorted(wrappers[0]) == ["model.blocks.0", "model.blocks.1"]
    assert all(w[name] is wrappers[0][name] for w in wrappers for name in wrappers[0])
    assert [line for line in _lines(caplog) if line.startswith("lightmem: re-planned")] == []


def test_predicted_and_measured_peaks_are_logged_each_step_and_the_worst_ratio_summarised(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    memory, tensorboard = MemoryLogger(), pl.loggers.TensorBoardLogger(tmp_path, name="run")
    callback = LightMem(plan="auto", offload_devices=["cpu"], metrics=["lightmem"], log_every_n_steps=1)
    measured_peaks = [3_000_000, 3_100_000, 4_000_000, 4_100_000]

    class DeviceRuns(pl.Callback):  # what the simulated device's allocator reaches in each step
        def on_before_backward(self, trainer, pl_module, loss):
            device.peak_bytes = measured_peaks[trainer.fit_loop.epoch_loop.batch_idx]

    shapes = [(4, 9), (4, 17), (4, 33), (4, 33)]
    with simulated_device(CAPACITY) as device:
        cpu_trainer([DeviceRuns(), callback], max_steps=4, logger=[memory, tensorboard]).fit(LitGPT(), growing_loader(shapes))
    predicted = {shape: plan(LitGPT(), _tokens(*shape), BUDGET, device="cpu").predicted_peak_bytes for shape in shapes}
    highest = [max(predicted[s] for s in shapes[: i + 1]) for i in range(4)]
    rows = [(step, m) for step, m in memory.metrics if "lightmem/memory/plan/predicted_peak_GiB" in m]
    assert [step for step, _ in rows] == [0, 1, 2, 3]
    assert [m["lightmem/memory/plan/predicted_peak_GiB"] for _, m in rows] == [p / GiB for p in highest]
    assert [m["lightmem/memory/plan/measured_peak_GiB"] for _, m in rows] == [p / GiB for p in measured_peaks]
    worst = max(m / p for m, p in zip(measured_peaks, highest))
    assert callback.summary()["plan: worst measured / predicted reserved peak"] == f"{worst:.2f}"
    assert memory.metrics[-1][1]["lightmem/summary/plan/worst_peak_ratio"] == worst
    accumulator = EventAccumulator(tensorboard.log_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    config = accumulator.Tensors("custom_scalars__config__")[-1]
    (category,) = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0]).category
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert charts["Plan: predicted and measured peak (GiB)"] == [
        "lightmem/memory/plan/predicted_peak_GiB", "lightmem/memory/plan/measured_peak_GiB"
    ]  # fmt: skip


def test_a_reserved_peak_over_the_prediction_warns_once_and_the_next_batch_is_planned_tighter(caplog):
    # From the third batch on the device reserves 30% more than the plan predicted: the warning
    # names the step and the batch, and the fourth batch gets a plan for a budget smaller by the
    # overshoot, which checkpoints more.
    callback = LightMem(plan="auto", offload_devices=["cpu"])
    overshoot = {}

    class DeviceRuns(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.fit_loop.epoch_loop.batch_idx == 2:
                predicted = callback.chosen_plan.predicted_reserved_bytes
                device.reserved_peak_bytes = int(1.3 * predicted)
                overshoot["bytes"] = device.reserved_peak_bytes - predicted

    shapes = [(4, 9), (4, 9), (4, 17), (4, 17)]
    with simulated_device(CAPACITY) as device, caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_trainer([callback, DeviceRuns()], max_steps=4).fit(LitGPT(), growing_loader(shapes))
    first = plan(LitGPT(), _tokens(4, 17), BUDGET, device="cpu")
    measured = first.predicted_reserved_bytes + overshoot["bytes"]
    messages = [str(w.message) for w in caught if "plan='auto' predicted" in str(w.message)]
    assert messages == [
        f"lightmem: at step 2 (batch shape [4, 17]) the device's peak reserved memory, {measured / 2**20:.2f} MiB, "
        f"exceeds the peak plan='auto' predicted, {first.predicted_reserved_bytes / 2**20:.2f} MiB, by more than 15%: "
        f"the next batch is planned again for a budget {overshoot['bytes'] / 2**20:.2f} MiB smaller."
    ]
    tighter = plan(LitGPT(), _tokens(4, 17), BUDGET - overshoot["bytes"], device="cpu")
    assert callback.chosen_plan.checkpoint == tighter.checkpoint and len(tighter.checkpoint) > len(first.checkpoint)
    (line,) = [line for line in _lines(caplog) if line.startswith("lightmem: re-planned")]
    assert line.startswith(
        "lightmem: re-planned for the same batches (the reserved peak measured at step 2, "
        f"{measured / 2**20:.2f} MiB, passed the predicted {first.predicted_reserved_bytes / 2**20:.2f} MiB by more "
        f"than 15%: planned again for a budget {overshoot['bytes'] / 2**20:.2f} MiB smaller) at step 3: "
        f"checkpoint {tighter.checkpoint}"
    )
    assert callback.summary()["plan: worst measured / predicted reserved peak"] == "1.30"


def test_when_no_tighter_plan_fits_training_stops_before_the_next_batchs_forward():
    callback = LightMem(plan="auto", offload_devices=["cpu"])
    forwards = []

    class DeviceRuns(pl.Callback):  # the second batch reserves twice the prediction
        def on_before_backward(self, trainer, pl_module, loss):
            forwards.append(trainer.fit_loop.epoch_loop.batch_idx)
            if len(forwards) == 2:
                device.reserved_peak_bytes = 2 * callback.chosen_plan.predicted_reserved_bytes

    with simulated_device(CAPACITY) as device, pytest.raises(PlanDoesNotFit) as error:
        cpu_trainer([callback, DeviceRuns()], max_steps=4).fit(LitGPT(), growing_loader([(4, 17)] * 4))
    assert forwards == [0, 1]  # the third batch never ran its forward
    assert str(error.value).startswith("lightmem: plan='auto' found no configuration that fits the ")
    assert callback.fit_session is None  # the fit ended cleanly: hooks and wrappers removed


def test_a_budget_no_plan_fits_stops_the_fit_before_the_first_forward_saying_why_and_what_fits():
    # Issue 37: LightMem(plan="auto", device_budget="16KiB") trained to the end, with nothing on.
    calls = []  # real forwards (the planner runs training_step on fake tensors)
    module = LitGPT()
    original = module.training_step
    module.training_step = lambda batch, *args: calls.extend(
        [] if isinstance(batch[0], FakeTensor) else [1]
    ) or original(batch, *args)
    callback = LightMem(plan="auto", device_budget="3.5MiB", offload_devices=["cpu"])
    with pytest.raises(PlanDoesNotFit) as error:
        cpu_trainer([callback], max_steps=2).fit(module, growing_loader([(8, 33)] * 2))
    assert calls == []
    chosen = plan(LitGPT(), _tokens(8, 33), "3.5MiB", device="cpu")
    closest = min(chosen.alternatives, key=lambda option: option.predicted_total_bytes)
    largest = max_batch_size(LitGPT(), _tokens(8, 33), "3.5MiB", device="cpu", plan=True, limit=7).planned
    assert largest == 4
    assert str(error.value) == (
        "lightmem: plan='auto' found no configuration that fits the 3.50 MiB device budget for batches of [8, 33]; "
        f"the closest, {closest.description}, needs {closest.predicted_total_bytes / 2**20:.2f} MiB (the allocator's "
        f"share and the 0 B overhead allowance included). Its peak is {chosen.dominant}. The largest batch a plan "
        f"fits is {largest} (this one: 8). Training stopped before this batch's forward: lower the batch size, or "
        "raise device_budget."
    )


def test_the_tiniest_budget_says_not_even_a_batch_of_one_fits():
    callback = LightMem(plan="auto", device_budget="16KiB", offload_devices=["cpu"])
    with pytest.raises(PlanDoesNotFit) as error:
        cpu_trainer([callback], max_steps=1).fit(LitGPT(), token_loader())
    chosen = plan(LitGPT(), _tokens(4, 33), "16KiB", device="cpu")
    assert str(error.value).startswith(
        "lightmem: plan='auto' found no configuration that fits the 16.00 KiB device budget for batches of [4, 33]: "
        f"{chosen.reason}"
    )
    assert chosen.reason.startswith("parameters (658.25 KiB), gradients (658.25 KiB) and optimizer state (")
    assert chosen.reason.endswith(", over the 16.00 KiB budget; no activation technique helps (see the advice)")
    assert ". Not even a batch of 1 fits. Training stopped before this batch's forward" in str(error.value)


def test_with_several_ranks_the_over_prediction_warning_names_its_rank():
    chosen = plan(LitGPT(), _tokens(4, 17), BUDGET, device="cpu")
    device = SimulatedDeviceMemory(CAPACITY)
    auto_plan = AutoPlan(BUDGET, device)
    auto_plan.take(chosen, batch_shapes(_tokens(4, 17)))
    auto_plan.batch_start()
    device.reserved_peak_bytes = 2 * chosen.predicted_reserved_bytes
    with pytest.warns(UserWarning) as caught:
        auto_plan.check(7, _tokens(4, 17), rank=1)
    assert str(caught[0].message).startswith("lightmem: at step 7 on rank 1 (batch shape [4, 17]) the device's peak")
    assert auto_plan.replan_reason.startswith("the reserved peak measured at step 7 on rank 1, ")


def test_peaks_reached_before_the_fit_or_in_validation_are_not_held_against_the_plan(tmp_path):
    # max_memory_allocated is a high of the whole process: an earlier fit reached 3x this plan's
    # prediction, validation 5x; only what the training batches raise it to is measured.
    memory = MemoryLogger()
    callback = LightMem(plan="auto", offload_devices=["cpu"], metrics=["lightmem"], log_every_n_steps=1)
    prediction = plan(LitGPT(), _tokens(4, 33), BUDGET, device="cpu").predicted_peak_bytes
    steps = []

    class DeviceRuns(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):  # the 4th step raises the high to 6x
            steps.append(trainer.global_step)
            if len(steps) == 4:
                device.peak_bytes = 6 * prediction

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            device.peak_bytes = max(device.peak_bytes, 5 * prediction)

    module = LitGPT()
    module.validation_step = lambda batch, batch_idx: None
    trainer = cpu_trainer(
        [callback, DeviceRuns()], max_steps=4, logger=[memory], val_check_interval=2, limit_val_batches=1
    )
    with simulated_device(CAPACITY, peak_bytes=3 * prediction) as device, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, token_loader(), token_loader(batches=1))
    measured = [m["lightmem/memory/plan/measured_peak_GiB"] for _, m in memory.metrics if "lightmem/memory/plan/measured_peak_GiB" in m]
    assert measured == [0.0, 0.0, 0.0, 6 * prediction / GiB]  # nothing seen until a training batch raised the high
    assert [str(w.message).split(" (batch")[0] for w in caught if "plan='auto' predicted" in str(w.message)] == [
        "lightmem: at step 3"
    ]
    assert callback.summary()["plan: worst measured / predicted reserved peak"] == "6.00"


BLOCKS = ("model.blocks.0", "model.blocks.1", "model.blocks.2")


def _timed_steps(auto_plan, module, tokens, steps):
    for step in range(steps):
        auto_plan.batch_start()
        module(tokens)
        auto_plan.forward_done()
        module(tokens)  # after the forward (as backward's re-runs of checkpointed blocks): not timed
        auto_plan.check(step, (tokens,))


def test_a_block_whose_forward_is_off_its_price_is_priced_as_measured_and_planned_again():
    # Issue 38 (as Capuchin does): each block's forward is timed with CUDA events in the first steps
    # of a plan; blocks off their price by more than 15% are priced as measured from then on. The
    # three blocks are twins: their median pace prices each of them.
    module, tokens = LitGPT(), _tokens(4, 17)[0]
    chosen = plan(module, (tokens,), BUDGET, device="cpu")
    priced = {name: chosen.estimate.blocks[name].forward_s for name in BLOCKS}
    measured = {BLOCKS[0]: 2.9 * priced[BLOCKS[0]], BLOCKS[1]: 3 * priced[BLOCKS[1]], BLOCKS[2]: 3.2 * priced[BLOCKS[2]]}
    device = SimulatedDeviceMemory(CAPACITY, gpu="h100", step_seconds=chosen.step_seconds, block_seconds=measured)
    auto_plan = AutoPlan(BUDGET, device, speeds=device.speeds())
    auto_plan.take(chosen, batch_shapes((tokens,)), module)
    _timed_steps(auto_plan, module, tokens, 1 + TIMED_STEPS)  # the first step of a plan is not timed
    assert auto_plan.block_times_s == {name: [seconds] * TIMED_STEPS for name, seconds in measured.items()}
    assert auto_plan.speeds.block_scale == pytest.approx(dict.fromkeys(BLOCKS, 3.0), rel=1e-12)
    assert auto_plan.replan_reason == (
        f"block {BLOCKS[2]}'s forward measured {format_seconds(measured[BLOCKS[2]])}, 3.20x its priced "
        f"{format_seconds(priced[BLOCKS[2]])} and 2 more off by more than 15%: planned again with each "
        "block's compute priced as measured"
    )
    # The next plan prices those blocks' forward, backward and re-run as measured.
    again = plan(module, (tokens,), BUDGET, device="cpu", gpu=auto_plan.speeds)
    backward = {name: chosen.estimate.blocks[name].backward_s for name in BLOCKS}
    added = sum(2 * (priced[name] + backward[name]) for name in BLOCKS)
    assert again.baseline_step_seconds == pytest.approx(chosen.baseline_step_seconds + added, rel=1e-9)
    # Timed again under it, the blocks are where they are priced: nothing to plan again; after
    # the timed steps the hooks come off.
    device.step_seconds = again.step_seconds
    auto_plan.take(again, batch_shapes((tokens,)), module)
    _timed_steps(auto_plan, module, tokens, 2 + TIMED_STEPS)
    assert auto_plan.replan_reason is None
    assert all(not module.get_submodule(name)._forward_hooks for name in BLOCKS)


def test_twins_are_priced_alike_the_untimed_ones_too_and_one_off_alone_is_noise():
    # The H100's third run: plan="auto" timed the blocks it kept (9-15), re-priced them alone and
    # moved its checkpointing from blocks 0-8 (87.1 ms a step) to them (105.0 ms). Blocks of one class
    # priced alike compute alike: the pace measured on some prices all, offloaded (untimed) ones too.
    module, tokens = LitGPT(), _tokens(4, 17)[0]
    chosen = plan(module, (tokens,), BUDGET, device="cpu")
    assert twins(chosen.estimate.blocks)[BLOCKS[0]] == BLOCKS
    assert twins(chosen.estimate.blocks)["model.lm_head"] == ("model.lm_head",)
    priced = {name: chosen.estimate.blocks[name].forward_s for name in BLOCKS}
    offloaded = dataclasses.replace(chosen, actions={BLOCKS[0]: "offload"})
    measured = {name: 0.5 * priced[name] for name in BLOCKS}  # the clock reports only the timed ones
    device = SimulatedDeviceMemory(CAPACITY, gpu="h100", step_seconds=chosen.step_seconds, block_seconds=measured)
    auto_plan = AutoPlan(BUDGET, device, speeds=device.speeds())
    auto_plan.take(offloaded, batch_shapes((tokens,)), module)
    _timed_steps(auto_plan, module, tokens, 1 + TIMED_STEPS)
    assert sorted(auto_plan.block_times_s) == [BLOCKS[1], BLOCKS[2]]
    assert auto_plan.speeds.block_scale == pytest.approx(dict.fromkeys(BLOCKS, 0.5), rel=1e-12)
    # Half their compute is less than the host's priced share of their interval (its launches less
    # the lead it had): the host launched them faster than priced too.
    assert auto_plan.replan_reason.endswith(
        " and 1 more off by more than 15%; 1 untimed twin(s) priced alike: planned again with each block's "
        "compute and the host's launches priced as measured (x0.86)"
    )
    # One twin off while the others are on their price is noise, not the blocks' pace.
    device.block_seconds = {BLOCKS[0]: 1.1 * priced[BLOCKS[0]], BLOCKS[1]: 3 * priced[BLOCKS[1]], BLOCKS[2]: 0.5 * priced[BLOCKS[2]]}
    quiet = AutoPlan(BUDGET, device, speeds=device.speeds())
    quiet.take(chosen, batch_shapes((tokens,)), module)
    _timed_steps(quiet, module, tokens, 1 + TIMED_STEPS)
    assert (quiet.replan_reason, quiet.speeds.block_scale) == (None, {})


def test_a_block_priced_at_the_clamp_and_measured_slower_still_plans_nothing_again():
    # Priced 5x its compute already (the most a measure may scale it), measured 10x: there is nothing
    # to price anew, and planning again would only time it again, at every plan.
    module, tokens = LitGPT(), _tokens(4, 17)[0]
    device = SimulatedDeviceMemory(CAPACITY, gpu="h100")
    clamped = device.speeds().with_block_scale(dict.fromkeys(BLOCKS, 5.0), "measured before")
    chosen = plan(module, (tokens,), BUDGET, device="cpu", gpu=clamped)
    device.block_seconds = {name: 10 * chosen.estimate.blocks[name].forward_s for name in BLOCKS}
    auto_plan = AutoPlan(BUDGET, device, speeds=clamped)
    auto_plan.take(chosen, batch_shapes((tokens,)), module)
    _timed_steps(auto_plan, module, tokens, 1 + TIMED_STEPS)
    assert sorted(auto_plan.block_times_s) == list(BLOCKS)
    assert (auto_plan.replan_reason, auto_plan.speeds) == (None, clamped)


def test_blocks_are_timed_only_where_hooks_cannot_change_the_model():
    # Offloaded blocks may wait for the link (priced apart); a compiled model would recompile
    # for hooks; a device without a block clock times nothing.
    module, tokens = LitGPT(), _tokens(4, 17)[0]
    chosen = plan(module, (tokens,), BUDGET, device="cpu")
    offloaded = dataclasses.replace(chosen, actions={BLOCKS[1]: "offload"})
    device = SimulatedDeviceMemory(CAPACITY, gpu="h100", block_seconds=dict.fromkeys(BLOCKS, 1.0))
    auto_plan = AutoPlan(BUDGET, device, speeds=device.speeds())
    auto_plan.take(offloaded, batch_shapes((tokens,)), module)
    _timed_steps(auto_plan, module, tokens, 2)
    assert sorted(auto_plan.block_times_s) == [BLOCKS[0], BLOCKS[2]]
    module.compile()
    auto_plan.take(chosen, batch_shapes((tokens,)), module)
    assert all(not module.get_submodule(name)._forward_hooks for name in BLOCKS)
    untimed = AutoPlan(BUDGET, SimulatedDeviceMemory(CAPACITY, gpu="h100"), speeds=device.speeds())
    untimed.take(chosen, batch_shapes((tokens,)), LitGPT())
    assert untimed._block_timer is None


def test_a_fit_whose_block_is_slower_than_priced_plans_again_once(monkeypatch, caplog):
    from lightmem.estimate import steps as configuration

    module = LitGPT()
    chosen = plan(module, _tokens(4, 33), BUDGET, device="cpu")
    slow = {BLOCKS[2]: 2 * chosen.estimate.blocks[BLOCKS[2]].forward_s}
    callback = LightMem(plan="auto", offload_devices=["cpu"], metrics=[])
    traced_at: list[int] = []  # the step at which each fake step ran
    run_step = configuration.run_step
    monkeypatch.setattr(configuration, "run_step", lambda *args: traced_at.append(step[0]) or run_step(*args))
    step = [0]

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step[0] = trainer.global_step

    with simulated_device(CAPACITY, gpu="h100", block_seconds=slow), caplog.at_level(logging.INFO):
        cpu_trainer([callback, Steps()], max_steps=3 + 2 * TIMED_STEPS).fit(module, token_loader())
    # Planned again for the same batches at new prices: no step traced again (verified steps and the
    # baseline are remembered; the baseline is priced again from its log).
    assert traced_at and set(traced_at) == {0}
    lines = [line for line in _lines(caplog) if line.startswith(("lightmem: re-planned", "lightmem: planned again"))]
    assert len(lines) == 1 and lines[0].startswith(
        f"lightmem: planned again for the same batches (block {BLOCKS[2]}'s forward measured "
        f"{format_seconds(slow[BLOCKS[2]])}, 2.00x its priced "
    )
    assert " at step 4: the choice stands, step " in lines[0]  # steps 1-3 timed (the first is not)
    assert callback.chosen_plan.speeds.block_scale == dict.fromkeys(BLOCKS, 2.0)  # its untimed twins too
    assert all(not module.get_submodule(name)._forward_hooks for name in BLOCKS)


def _host_bound_plan(module, tokens):
    """The tiny GPT priced on an H100: each block's forward launches 29 ops at 50 us (1.45 ms), where
    its compute takes 87 us. Its step waits on the host."""
    chosen = plan(module, (tokens,), 1 << 30, device="cuda", gpu="h100")
    intervals = forward_intervals(chosen.estimate.blocks, chosen.actions, chosen.costs)
    assert all(intervals[name].host_bound for name in BLOCKS) and chosen.estimate.host_wait() is not None
    return chosen, intervals


def test_a_block_whose_forward_waits_on_the_host_is_held_to_its_launches_not_its_compute():
    # A pair of CUDA events around a block the host launches slower than the device runs it times
    # the host's launches. Held against its compute (87 us), the GPT's blocks read 17x off and were
    # priced 5x slower: their backward and re-run too, where only the host is slow. Held against
    # the step's timeline, they are on their price: nothing to plan again.
    module, tokens = LitGPT(), _tokens(4, 17)[0]
    chosen, intervals = _host_bound_plan(module, tokens)
    measured = {name: 1.05 * intervals[name].seconds for name in BLOCKS}
    device = SimulatedDeviceMemory(1 << 32, gpu="h100", step_seconds=chosen.step_seconds, block_seconds=measured)
    auto_plan = AutoPlan(1 << 30, device, speeds=device.speeds())
    auto_plan.take(chosen, batch_shapes((tokens,)), module)
    _timed_steps(auto_plan, module, tokens, 1 + TIMED_STEPS)
    assert auto_plan.block_times_s == {name: [seconds] * TIMED_STEPS for name, seconds in measured.items()}
    assert (auto_plan.replan_reason, auto_plan.speeds) == (None, device.speeds())


def test_a_block_that_waits_on_a_slower_host_prices_the_host_as_measured():
    # Twice its launches: the host is slower than priced; its compute, hidden under the launches,
    # is not known to be off. The next plan prices the host's launches as measured, and its
    # blocks' forward intervals are then where they were measured.
    module, tokens = LitGPT(), _tokens(4, 17)[0]
    chosen, intervals = _host_bound_plan(module, tokens)
    measured = {name: factor * intervals[name].seconds for name, factor in zip(BLOCKS, (1.9, 2.0, 2.1))}
    device = SimulatedDeviceMemory(1 << 32, gpu="h100", step_seconds=chosen.step_seconds, block_seconds=measured)
    auto_plan = AutoPlan(1 << 30, device, speeds=device.speeds())
    auto_plan.take(chosen, batch_shapes((tokens,)), module)
    _timed_steps(auto_plan, module, tokens, 1 + TIMED_STEPS)
    assert auto_plan.speeds.block_scale == {}
    assert auto_plan.speeds.host_op_s == pytest.approx(2 * device.speeds().host_op_s, rel=1e-12)
    last = BLOCKS[2]
    assert auto_plan.replan_reason == (
        f"block {last}'s forward measured {format_seconds(measured[last])}, 2.10x its priced "
        f"{format_seconds(intervals[last].seconds)} and 2 more off by more than 15%: planned again with the "
        "host's launches priced as measured (x2.00)"
    )
    again = plan(module, (tokens,), 1 << 30, device="cuda", gpu=auto_plan.speeds)
    now = forward_intervals(again.estimate.blocks, again.actions, again.costs)
    assert [now[name].seconds for name in BLOCKS] == pytest.approx([2 * intervals[name].seconds for name in BLOCKS], rel=1e-9)


def test_a_host_bound_step_off_its_prediction_is_planned_again_at_the_pace_it_showed():
    # The step clock's pace prices the host's launches too: priced on the device alone, a step that
    # waits on the host would be predicted as before, however slow it measured.
    module, tokens = LitGPT(), _tokens(4, 17)[0]
    chosen, _ = _host_bound_plan(module, tokens)
    device = SimulatedDeviceMemory(1 << 32, gpu="h100", step_seconds=2 * chosen.step_seconds)
    auto_plan = AutoPlan(1 << 30, device, speeds=device.speeds())
    auto_plan.take(chosen, batch_shapes((tokens,)))
    for step in range(1 + TIMED_STEPS):
        auto_plan.batch_start()
        auto_plan.check(step, (tokens,))
    assert auto_plan.replan_reason.startswith(f"the measured step, {format_seconds(2 * chosen.step_seconds)}, is 2.00x")
    again = plan(module, (tokens,), 1 << 30, device="cuda", gpu=auto_plan.speeds)
    assert again.step_seconds == pytest.approx(2 * chosen.step_seconds, rel=1e-9)


def test_measuring_the_gpu_at_fit_start_does_not_hide_the_training_batches_peaks(caplog):
    # Issue 39 on an H200: the speed measure's products raised the allocator's high above anything a
    # small model's batches reach, so the measured peak stayed 0 and no ratio was summarised. lightmem
    # resets the peaks it raised itself, and says so; the batches are then measured.
    memory = MemoryLogger()
    callback = LightMem(plan="auto", offload_devices=["cpu"], metrics=["lightmem"], log_every_n_steps=1)
    prediction = plan(LitGPT(), _tokens(4, 33), BUDGET, device="cpu").predicted_peak_bytes
    batch_peaks = [prediction // 2, prediction // 2 + 1000, prediction // 2 + 1000]

    class DeviceRuns(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            device.peak_bytes = max(device.peak_bytes, batch_peaks[trainer.global_step])

    with simulated_device(CAPACITY, gpu="h100", measure_peak_bytes=8 * prediction) as device, caplog.at_level(logging.INFO):
        cpu_trainer([callback, DeviceRuns()], max_steps=3, logger=[memory]).fit(LitGPT(), token_loader())
    measured = [m["lightmem/memory/plan/measured_peak_GiB"] for _, m in memory.metrics if "lightmem/memory/plan/measured_peak_GiB" in m]
    assert measured == [p / GiB for p in batch_peaks]
    assert "lightmem: measuring the device raised the allocator's peak statistics above anything before the fit: " \
        "reset them (torch.cuda.reset_peak_memory_stats), so that the training batches' peaks can be measured " \
        "against the plan" in _lines(caplog)
    assert "plan: worst measured / predicted reserved peak" in callback.summary()


def test_the_summary_holds_the_last_plans_measured_step_against_its_prediction():
    memory = MemoryLogger()
    callback = LightMem(plan="auto", offload_devices=["cpu"], metrics=["lightmem"], log_every_n_steps=1)

    class DeviceRuns(pl.Callback):  # after LightMem's batch start: its plan is made
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            device.step_seconds = 1.1 * callback.chosen_plan.step_seconds

    with simulated_device(CAPACITY, gpu="h100") as device:
        cpu_trainer([callback, DeviceRuns()], max_steps=3, logger=[memory]).fit(LitGPT(), token_loader())
    assert callback.summary()["plan: measured / predicted step (last plan)"] == "1.10"
    assert memory.metrics[-1][1]["lightmem/summary/plan/step_ratio"] == pytest.approx(1.1, rel=1e-12)


def test_a_speed_measure_below_the_earlier_high_leaves_the_peaks_alone():
    device = SimulatedDeviceMemory(CAPACITY, peak_bytes=5000, gpu="h100", measure_peak_bytes=4000)
    speeds, reset = measured_speeds(device)
    assert speeds is not None and not reset and device.peak_allocated_bytes() == 5000
    device.measure_peak_bytes = 6000
    assert measured_speeds(device)[1] and device.peak_allocated_bytes() == 0


def test_a_replan_in_the_middle_of_gradient_accumulation_keeps_the_steps_traffic_exact(monkeypatch):
    # Each plan offloads every saved tensor, with a new offloader each time (its min_bytes, 0, 1
    # then 2, moves the same bytes here: no saved storage is smaller): the batches growing at the
    # second micro-batch of each step re-plan there, and the step's figures hold both micro-batches.
    offload = LightMem(offload_devices=["cpu"], offload_min_bytes=0).settings.offload
    real_plan = fit_session_module.plan
    plans = []

    def offloading(model, batch, budget, **kwargs):
        plans.append(tuple(batch[0].shape))
        settings = dataclasses.replace(offload, min_bytes=len(plans) - 1)
        return dataclasses.replace(real_plan(model, batch, budget, **kwargs), checkpoint=[], offload=settings)

    monkeypatch.setattr(fit_session_module, "plan", offloading)
    shapes = [(4, 9), (4, 17), (4, 17), (4, 33)]

    def logged(callback):
        memory = MemoryLogger()
        pl.seed_everything(0, verbose=False)
        trainer = cpu_trainer([callback], max_steps=2, logger=[memory], accumulate_grad_batches=2)
        trainer.fit(LitGPT(), growing_loader(shapes))
        return [m["lightmem/memory/offload/offloaded_GiB"] for _, m in memory.metrics if "lightmem/memory/offload/offloaded_GiB" in m]

    planned = LightMem(plan="auto", device_budget=BUDGET, offload_devices=["cpu"], metrics=["lightmem"], log_every_n_steps=1)
    from_the_start = LightMem(offload_devices=["cpu"], offload_min_bytes=0, metrics=["lightmem"], log_every_n_steps=1)
    assert logged(planned) == logged(from_the_start) != [0.0, 0.0]
    assert plans == [(4, 9), (4, 17), (4, 33)]  # the second and the fourth batch: mid-step
    assert planned.summary()["offloaded per step"] == from_the_start.summary()["offloaded per step"]


def test_cli_plan_without_budget_uses_the_same_rule_on_a_device(capsys):
    root = os.path.join(os.path.dirname(__file__), "..")
    argv = ["estimate", f"{root}/examples/estimate_factories.py:tiny_gpt", "--batch-size", "2", "--device", "cpu",
            "--plan", "--json"]  # fmt: skip
    with simulated_device(64 * 2**20, used_by_others_bytes=2**20):
        assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    expected = measure_device_budget(SimulatedDeviceMemory(64 * 2**20, used_by_others_bytes=2**20))
    assert data["measured_budget"] == {"budget_bytes": expected.budget_bytes, "how": expected.describe()}
    assert data["plan"]["budget_bytes"] == expected.budget_bytes == 62_757_274


def test_cli_plan_without_budget_on_cuda_does_not_set_the_cuda_context_aside_twice(capsys):
    root = os.path.join(os.path.dirname(__file__), "..")
    argv = ["estimate", f"{root}/examples/estimate_factories.py:tiny_gpt", "--batch-size", "2", "--plan", "--json"]
    with simulated_device(64 * 2**20, used_by_others_bytes=2**20):
        assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["overhead_bytes"] == data["estimate"]["overhead_bytes"] == 0
    assert data["plan"]["budget_bytes"] == 62_757_274


@pytest.mark.parametrize(("cuda_here", "why"), [(False, " (no CUDA device here)"), (True, "")])
def test_cli_plan_without_budget_names_the_device_given_when_it_cannot_measure_it(monkeypatch, capsys, cuda_here, why):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_here)
    root = os.path.join(os.path.dirname(__file__), "..")
    argv = ["estimate", f"{root}/examples/estimate_factories.py:tiny_gpt", "--batch-size", "2", "--device", "cpu", "--plan"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "lightmem estimate: error: --plan: without --budget, it plans for the memory the CUDA device can give this "
        f"process, and --device is 'cpu'{why}; pass the budget to plan for, e.g. --budget 24GiB\n"
    )


def test_expandable_segments_are_turned_on_for_plan_auto_unless_the_user_configured_the_allocator(monkeypatch):
    from lightmem import device_memory

    calls = []
    monkeypatch.setattr(device_memory, "_allocator_settings_setter", lambda: calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_memory, "_expandable_set_here", False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert not device_memory.expandable_segments_on()
    line = device_memory.use_expandable_segments()
    assert calls == ["expandable_segments:True"] and device_memory.expandable_segments_on()
    assert line == (
        "lightmem: plan='auto' turned on the CUDA allocator's expandable segments "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for this process; plans replay the allocator with them). "
        "Set PYTORCH_CUDA_ALLOC_CONF yourself to choose."
    )
    # The user's settings win: nothing is set, and the line says what holds.
    calls.clear()
    monkeypatch.setattr(device_memory, "_expandable_set_here", False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert device_memory.use_expandable_segments() == (
        "lightmem: the CUDA allocator is configured by PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512: lightmem leaves "
        "it as it is (expandable segments off; plans replay the allocator so)"
    )
    assert calls == [] and not device_memory.expandable_segments_on()


def test_plan_auto_on_a_cuda_device_says_at_fit_start_what_it_did_with_the_allocator(monkeypatch):
    from types import SimpleNamespace

    from lightmem.fit_session import FitSession

    monkeypatch.setattr(fit_session_module, "use_expandable_segments", lambda: "lightmem: the allocator line")
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), num_devices=1)
    assert FitSession(LightMem(plan="auto").settings, trainer)._allocator_note == "lightmem: the allocator line"
    # Without plan="auto", or training on the CPU, the allocator is left alone.
    assert FitSession(LightMem().settings, trainer)._allocator_note == ""
    on_cpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), num_devices=1)
    assert FitSession(LightMem(plan="auto", device_budget="1GiB").settings, on_cpu)._allocator_note == ""


def test_steps_far_off_their_prediction_plan_the_next_batch_again_at_the_measured_pace():
    chosen = plan(LitGPT(), _tokens(4, 17), BUDGET, device="cpu")
    device = SimulatedDeviceMemory(CAPACITY, gpu="h100", step_seconds=2 * chosen.step_seconds)
    auto_plan = AutoPlan(BUDGET, device, speeds=device.speeds())
    auto_plan.take(chosen, batch_shapes(_tokens(4, 17)))
    for step in range(1 + TIMED_STEPS):  # the first step of a plan is not counted
        assert auto_plan.replan_reason is None
        auto_plan.batch_start()
        auto_plan.check(step, _tokens(4, 17))
    assert auto_plan.measured_step_s() == 2 * chosen.step_seconds
    assert auto_plan.replan_reason == (
        f"the measured step, {format_seconds(2 * chosen.step_seconds)}, is 2.00x the predicted "
        f"{format_seconds(chosen.step_seconds)}: planned again with the device's compute and the host's launches "
        "priced at the measured pace"
    )
    assert auto_plan.needs_plan(_tokens(4, 17))
    # What the link adds is taken as priced; the device's compute is priced at the pace it showed.
    pace = chosen.step_seconds / (2 * chosen.step_seconds)
    assert auto_plan.speeds.matmul_rate("bf16") == pytest.approx(device.speeds().matmul_rate("bf16") * pace)
    assert auto_plan.speeds.host_op_s == pytest.approx(device.speeds().host_op_s / pace)
    assert auto_plan.speeds.link_bytes_per_s == device.speeds().link_bytes_per_s
    # Steps within 15% of the prediction change nothing.
    steady = AutoPlan(BUDGET, SimulatedDeviceMemory(CAPACITY, gpu="h100", step_seconds=1.1 * chosen.step_seconds),
                      speeds=device.speeds())  # fmt: skip
    steady.take(chosen, batch_shapes(_tokens(4, 17)))
    for step in range(1 + TIMED_STEPS):
        steady.batch_start()
        steady.check(step, _tokens(4, 17))
    assert steady.replan_reason is None and steady.speeds is device.speeds()
