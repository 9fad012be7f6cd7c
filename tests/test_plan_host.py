"""Host memory in the plan (issue 59): what a plan holds on the host (the offloaded activations' pool,
model state) is predicted and held against ``host_budget`` or this machine's RAM; a plan that needs
more is not taken, and where every one that fits the device needs more, the plan is refused with the
figures and the searches say the host, not the device, stopped them."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from models import TinyGPT, gpt_loss
from test_frontier import MLPStack, _batch, stack_loss

from lightmem import estimate_memory, frontier, max_batch_size, plan
from lightmem.config import format_bytes
from lightmem.estimate import host
from lightmem.transfer.pool import bound_bytes

COMMON = {"device": "cuda", "gpu": "default", "overhead_bytes": 0, "optimizer": "adamw", "tile": False}
OFFLOAD = {"min_bytes": "64KiB"}
FRONTIER = {"gpu": "h100", "overhead_bytes": 0}


@functools.cache
def _model() -> tuple[TinyGPT, torch.Tensor, int]:
    torch.manual_seed(0)
    model = TinyGPT(depth=4)
    tokens = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(0))
    reserved = estimate_memory(model, tokens, gpt_loss, device="cuda", gpu="default", overhead_bytes=0).reserved_bytes
    return model, tokens, reserved


def test_a_plan_that_offloads_holds_its_pools_bound_of_host_memory():
    model, tokens, reserved = _model()
    chosen = plan(model, tokens, reserved * 3 // 4, gpt_loss, offload=OFFLOAD, **COMMON)
    assert chosen.fits and chosen.offload is not None and chosen.host_bytes > 0
    assert chosen.host.activations == chosen.host_bytes  # what its offloaded blocks hold at once
    assert bound_bytes(chosen.host_bytes) < chosen.host.pool  # the pool's headroom and one block on top
    assert chosen.host_total_bytes == chosen.host.pool and chosen.to_dict()["host_total_bytes"] == chosen.host.pool
    assert f"holding {format_bytes(chosen.host.pool)} (the activations' pool {format_bytes(chosen.host.pool)})" in chosen.describe()


def test_a_host_budget_one_byte_short_takes_a_plan_that_holds_less():
    model, tokens, reserved = _model()
    roomy = plan(model, tokens, reserved * 3 // 4, gpt_loss, offload=OFFLOAD, **COMMON)
    tight = plan(model, tokens, reserved * 3 // 4, gpt_loss, offload=OFFLOAD, host_budget=roomy.host_total_bytes - 1, **COMMON)
    assert tight.fits and tight.host_total_bytes < roomy.host_total_bytes
    assert tight.checkpoint and not roomy.checkpoint  # it re-computes what it no longer moves


def test_where_every_plan_that_fits_the_device_holds_too_much_host_the_plan_is_refused_with_the_figures():
    model, tokens, reserved = _model()
    budget = reserved * 7 // 10
    roomy = plan(model, tokens, budget, gpt_loss, offload=OFFLOAD, **COMMON)
    limit = roomy.host_total_bytes - 1
    refused = plan(model, tokens, budget, gpt_loss, offload=OFFLOAD, host_budget=limit, **COMMON)
    assert (refused.fits, refused.limited_by) == (False, "host")
    found = re.fullmatch(
        r"every configuration verified to fit the device holds more host memory than the host allows: the least, "
        r"offload (.+), it holds ([\d.]+ MiB) \(the activations' pool \2\) of host memory, over the "
        + re.escape(format_bytes(limit)) + " of the host budget",
        refused.reason,
    )  # fmt: skip
    assert found is not None and float(found.group(2).split()[0]) * 2**20 > limit
    assert plan(model, tokens, budget, gpt_loss, offload=OFFLOAD, **COMMON).limited_by == ""


def test_model_state_on_the_host_counts_and_a_cpu_plan_is_held_to_this_machines_ram(monkeypatch):
    model, tokens, _ = _model()
    monkeypatch.setattr(host, "available_ram_bytes", lambda: 1 << 20)  # this machine: 1 MiB free
    static = estimate_memory(model, tokens, gpt_loss, device="cpu").static_bytes
    refused = plan(model, tokens, static, gpt_loss, device="cpu", offload_optimizer=True)
    assert (refused.fits, refused.limited_by, refused.offload_optimizer) == (False, "host", True)
    assert refused.reason.startswith("gradients and optimizer state go to the host, and it holds ")
    assert refused.reason.endswith(" of host memory, over the 1.00 MiB of this machine's available RAM")
    assert refused.host.model_state > (1 << 20) and refused.host.pool == 0


def test_the_searches_say_when_the_host_not_the_device_stopped_the_plans():
    # Four MLP blocks at 16,384 positions: with a 64 MiB host the plans stop at batch 17, where without a
    # host limit one that offloads 171 MiB reaches 19.
    model = MLPStack(depth=4)
    one, two = (estimate_memory(model, _batch(n), stack_loss, **FRONTIER) for n in (1, 2))
    budget = one.static_bytes + 8 * (two.reserved_bytes - one.reserved_bytes)
    free = max_batch_size(model, _batch(2), budget, stack_loss, plan=True, limit=64, **FRONTIER)
    held = max_batch_size(model, _batch(2), budget, stack_loss, plan=True, limit=64, host_budget="64MiB", **FRONTIER)
    assert (free.planned, free.limited_by, free.plan.host_total_bytes > 64 << 20) == (19, "device", True)
    assert (held.planned, held.limited_by, held.plan.host_total_bytes <= 64 << 20) == (17, "host", True)
    found = frontier(model, _batch(2), budget, stack_loss, multiples=(1,), host_budget="64MiB", limit=64, **FRONTIER)
    assert (found.largest_batch, found.limited_by) == (17, "host")
    assert found.to_text().splitlines()[0].endswith(
        "largest with a plan 17 (past it the host's memory, not the device's, sets the limit)"
    )


@pytest.mark.parametrize("value", ["lots", -1, True])
def test_a_bad_host_budget_names_the_flag(value):
    model, tokens, reserved = _model()
    with pytest.raises(ValueError, match=r"plan\(host_budget=...\)"):
        plan(model, tokens, reserved, gpt_loss, host_budget=value, **COMMON)
