"""Planning is visible and traces each configuration once (issue 50): ``plan="auto"`` says what it plans
before the fit waits for it and how long it took, and a configuration traced for one plan is not
traced again for the next plan of the same batches (new prices, another budget, the other checkpoint
policy)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

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


# -- what a first plan traces (issue 50, point 6) ----------------------------------------------------


def _gpt_at_twice_its_batch() -> tuple[Any, tuple[torch.Tensor], Any, dict[str, Any]]:
    """``benchmarks/plans_hold.py``'s 16-block GPT (meta device) at 22, twice the largest batch it
    trains without lightmem under 16 GiB, with plan="auto"'s settings, priced at the H200's speeds."""
    import plans_hold

    common = {"optimizer": plans_hold.fused_adamw, "precision": "bf16-mixed", "device": "cuda", "gpu": "h200"}
    return plans_hold._meta_model(), plans_hold._tokens(22), plans_hold.gpt_loss, common


def _counting_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any, Any]]:
    """Every fake step run from here on, as (checkpoint, offload, checkpoint policy)."""
    from lightmem.estimate import steps as configuration

    steps: list[tuple[Any, Any, Any]] = []
    run_step = configuration.run_step

    def counted(model: Any, batch: Any, request: Any) -> Any:
        steps.append((request.checkpoint, request.offload, request.checkpoint_policy))
        return run_step(model, batch, request)

    monkeypatch.setattr(configuration, "run_step", counted)
    return steps


def test_the_gpt_at_twice_its_batch_is_planned_with_one_baseline_and_two_configurations(monkeypatch):
    # Before: 8 fake steps (7.5 s on the 2-core VM): the baseline once per checkpoint policy, the
    # offload walk first (its cheapest candidate is offloading nothing), and two candidates of
    # "save_matmuls" predicted to save 6.8 GiB of the 9.5 GiB needed. Now: 3 (2.9 s there).
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as plan="auto" sets it
    model, batch, loss, common = _gpt_at_twice_its_batch()
    steps = _counting_steps(monkeypatch)
    found = plan(model, batch, "16GiB", loss, checkpoint_policy="auto", **common)
    assert found.fits and found.checkpoint == [f"blocks.{i}" for i in range(12)]
    assert found.offload is not None and found.offload.include == (*(f"blocks.{i}" for i in range(12)), "lm_head")
    assert [(checkpoint, offload is None) for checkpoint, offload, _ in steps] == [
        (None, True),  # the baseline, under "save_matmuls": one step for both policies
        (tuple(f"blocks.{i}" for i in range(12)), False),
        (tuple(f"blocks.{i}" for i in range(11)), False),
    ]
    assert found.evaluations == 2


def test_one_baseline_serves_both_policies_as_if_traced_under_each():
    from lightmem.estimate.settings import parse_settings
    from lightmem.estimate.steps import run_configuration
    from lightmem.estimate.trace.step import as_traced_in_full

    model, loss = TinyGPT(depth=3), lambda m, batch: gpt_loss(m, batch[0])
    traces = {}
    for policy in ("full", "save_matmuls"):
        settings = parse_settings(
            "plan", model, loss, optimizer="adamw", precision="bf16-mixed", device="cuda", gpu="h100",
            overhead_bytes=0, budget=None, zero_grad="after_forward", checkpoint_policy=policy,
        )  # fmt: skip
        traces[policy] = run_configuration(model, _tokens(4, 33), settings, priced=True)
    full, matmuls = traces["full"], as_traced_in_full(traces["save_matmuls"])
    assert any(usage.kept_bytes for usage in traces["save_matmuls"].blocks.values())  # what it takes away
    assert matmuls.blocks == full.blocks
    assert (matmuls.peak.bytes, matmuls.reserved_bytes, matmuls.priced_ops) == (full.peak.bytes, full.reserved_bytes, full.priced_ops)
    assert matmuls.op_seconds == full.op_seconds
    assert traces["save_matmuls"].blocks != full.blocks  # the policy's own trace is left as it was



def test_a_baseline_priced_again_from_its_log_is_the_one_a_trace_at_those_prices_gives():
    from lightmem.estimate.pricing.fold import priced_at as reprice
    from lightmem.estimate.settings import parse_settings
    from lightmem.estimate.steps import run_configuration

    model, loss = TinyGPT(depth=3), lambda m, batch: gpt_loss(m, batch[0])
    traces = {}
    for flops in (1e10, 4e10):
        settings = parse_settings(
            "plan", model, loss, optimizer="adamw", precision="32-true", device="cuda", gpu="h100", overhead_bytes=0, budget=None,
            zero_grad="after_forward", checkpoint_policy="save_matmuls", flops_per_s=flops,
        )  # fmt: skip
        traces[flops] = run_configuration(model, _tokens(4, 33), settings, priced=True)
    slow, fast = traces[1e10], traces[4e10]
    assert slow.blocks != fast.blocks and slow.op_seconds != fast.op_seconds  # the prices matter here
    again = reprice(slow, fast.priced_with)
    assert again.blocks == fast.blocks  # forward, backward and re-run seconds of every block, bitwise
    assert (again.op_seconds, again.optimizer_s, again.priced_ops) == (fast.op_seconds, fast.optimizer_s, fast.priced_ops)
    assert slow.blocks == traces[1e10].blocks and slow.priced_with != fast.priced_with  # the original is untouched


def _gpt_within_budget(policy: str) -> tuple[Any, Any, dict[str, Any], int]:
    """A 3-block GPT planned on an H100 under ``policy``: the model, its loss, the plan's flags, and a
    budget 60% of the way from its static bytes to its reserved peak (a plan checkpoints to fit it)."""
    model, loss = TinyGPT(depth=3), lambda m, batch: gpt_loss(m, batch[0])
    common = {"optimizer": "adamw", "device": "cuda", "gpu": "h100", "overhead_bytes": 0, "checkpoint_policy": policy}
    base = plan(model, _tokens(16, 33), "1GiB", loss, **common).estimate
    return model, loss, common, base.static_bytes + (base.reserved_bytes - base.static_bytes) * 6 // 10


def test_a_plan_made_again_at_new_prices_traces_no_step_and_prices_as_a_first_plan_would(monkeypatch):
    from lightmem.estimate.steps import STEPS

    model, loss, common, budget = _gpt_within_budget("auto")
    first = plan(model, _tokens(16, 33), budget, loss, **common)
    assert first.fits and first.checkpoint
    steps = _counting_steps(monkeypatch)
    again = plan(model, _tokens(16, 33), budget, loss, flops_per_s=1e10, **common)
    assert steps == [] and again.evaluations == 0
    STEPS.clear()
    fresh = plan(model, _tokens(16, 33), budget, loss, flops_per_s=1e10, **common)
    assert len(steps) > 0
    assert (again.checkpoint, again.step_seconds, again.predicted_total_bytes) == (
        fresh.checkpoint, fresh.step_seconds, fresh.predicted_total_bytes,
    )  # fmt: skip


def test_the_device_budget_never_reaches_a_fake_step(monkeypatch):
    # A step is the same at every budget: only the planning layer reads the budget (which configuration
    # fits), so a plan under another budget walks the same configurations and traces none of them again.
    model, loss, common, budget = _gpt_within_budget("full")
    first = plan(model, _tokens(16, 33), budget, loss, **common)
    assert first.fits and first.checkpoint and first.evaluations > 0
    steps = _counting_steps(monkeypatch)
    again = plan(model, _tokens(16, 33), budget + 1, loss, **common)
    assert steps == [] and again.evaluations == 0
    assert (again.checkpoint, again.offload, again.predicted_total_bytes, again.step_seconds) == (
        first.checkpoint, first.offload, first.predicted_total_bytes, first.step_seconds,
    )  # fmt: skip
    assert (again.budget_bytes, first.budget_bytes) == (budget + 1, budget)


def test_a_model_changed_where_its_parameters_do_not_show_is_traced_again(monkeypatch):
    # A block's forward wrapped by checkpointing, or a callable set on a module (the chunked loss sets
    # a causal LM's loss_function), changes the step with the same parameters: no step is reused.
    from lightmem import apply_checkpointing, estimate_memory

    model, loss = TinyGPT(depth=3), lambda m, batch: gpt_loss(m, batch[0])
    common = {"optimizer": "adamw", "device": "cuda", "gpu": "h100", "overhead_bytes": 0}
    plain = estimate_memory(model, _tokens(16, 33), loss, **common)
    steps = _counting_steps(monkeypatch)
    assert estimate_memory(model, _tokens(16, 33), loss, **common).peak_bytes == plain.peak_bytes and steps == []
    handle = apply_checkpointing(model, ["Block"])
    checkpointed = estimate_memory(model, _tokens(16, 33), loss, **common)
    handle.remove()
    assert len(steps) == 1 and checkpointed.peak_bytes < plain.peak_bytes
    model.blocks[0].describe = lambda: "set on the instance"
    estimate_memory(model, _tokens(16, 33), loss, **common)
    assert len(steps) == 2
