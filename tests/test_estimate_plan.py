"""max_batch_size and plan: answers verified by the estimator itself."""

from __future__ import annotations

import pytest
import torch
from models import TinyGPT, gpt_loss

from lightmem import estimate_memory, max_batch_size, plan
from lightmem.estimate.pricing.costs import BOTH, CHECKPOINT, OFFLOAD, Costs
from lightmem.estimate.planning.families import choose_actions, config_for
from lightmem.estimate.trace.blocks import BlockMemory
from lightmem.estimate.search import largest_fitting


def _tokens(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, 128, (batch, 33), generator=torch.Generator().manual_seed(0))


def test_largest_fitting_finds_the_exact_answer_of_an_affine_cost_in_few_evaluations():
    calls = []

    def total(size: int) -> int:
        calls.append(size)
        return 1000 + 37 * size

    answer, seen = largest_fitting(total, budget_bytes=1000 + 37 * 123 + 5, start=8, limit=10_000)
    assert answer == 123
    # Two sizes give the line, one step at its answer confirms it.
    assert calls == [8, 16, 123]
    assert dict(seen)[123] <= 1000 + 37 * 123 + 5 < 1000 + 37 * 124


def test_largest_fitting_brackets_the_answer_when_the_cost_is_not_affine():
    def total(size: int) -> int:
        return 1000 + 37 * size + (size * size) // 10

    budget = total(123) + 1
    answer, seen = largest_fitting(total, budget_bytes=budget, start=8, limit=10_000)
    assert answer == 123
    assert dict(seen)[123] <= budget < dict(seen)[124]


def test_largest_fitting_handles_nothing_fitting_and_the_limit():
    assert largest_fitting(lambda size: 100 + size, budget_bytes=50, start=4, limit=64)[0] == 0
    assert largest_fitting(lambda size: 100, budget_bytes=500, start=4, limit=64)[0] == 64


def test_largest_fitting_bisects_a_staircase_at_the_budget_instead_of_scanning_it():
    # Reserved bytes move in whole segments: over a range of sizes a step reserves exactly the
    # budget, and the line through two such sizes crosses the budget at the lower one. Nudging by
    # one size each time scanned the whole range (1,700 fake steps for a plain MLP under 256 MiB).
    calls = []

    def total(size: int) -> int:
        calls.append(size)
        return 1000 if size <= 5000 else 1000 + (size - 5000)

    assert largest_fitting(total, budget_bytes=1000, start=4, limit=10_000)[0] == 5000
    assert len(calls) < 60  # a bisection, where the scan took 4,996


def test_largest_fitting_is_never_below_a_size_known_to_fit():
    def total(size: int) -> int:
        return 10 * size + (400 if size > 59 else 0)

    assert largest_fitting(total, budget_bytes=595, start=60, limit=64, fits_at=59)[0] == 59
    assert largest_fitting(total, budget_bytes=595, start=60, limit=64, fits_at=70)[0] == 64  # the limit caps it


def test_max_batch_size_with_a_plan_is_never_below_without_lightmem_for_a_model_without_blocks():
    # A plain MLP under 256 MiB: without lightmem 59392; "with the best plan" said 57497, whose plan
    # was "fits without lightmem".
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    batch = (torch.randn(4, 64), torch.randint(0, 10, (4,)))

    def loss(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(module(batch[0]), batch[1])

    search = max_batch_size(model, batch, "256MiB", loss, device="cuda", gpu="h100", plan=True, overhead_bytes=0)
    assert search.baseline == 59392
    assert search.planned == search.baseline and search.plan is not None and search.plan.fits


def test_an_answer_at_the_search_limit_is_said_to_be_one():
    from lightmem import frontier

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    batch = (torch.randn(4, 64), torch.randint(0, 10, (4,)))

    def loss(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(module(batch[0]), batch[1])

    common = {"device": "cuda", "gpu": "h100", "overhead_bytes": 0, "limit": 4096}
    search = max_batch_size(model, batch, "2GiB", loss, plan=True, **common)
    assert (search.baseline, search.planned, search.limit) == (4096, 4096, 4096)
    assert "without lightmem    4096 (the limit searched: larger may fit)" in search.to_text()
    assert search.to_dict()["limit"] == 4096
    title = frontier(model, batch, "2GiB", loss, **common).to_text().splitlines()[0]
    assert title == (
        "Frontier on 2.00 GiB: reference batch 4096 (the limit searched: larger batches may fit without lightmem "
        "too), largest with a plan 4096"
    )
    below = max_batch_size(model, batch, "256MiB", loss, **{**common, "limit": 1 << 16})
    assert below.baseline == 59392 and "(the limit searched" not in below.to_text()


def test_max_batch_size_answer_fits_and_the_next_size_does_not():
    budget = 12 * 2**20
    search = max_batch_size(TinyGPT(), _tokens(4), budget, gpt_loss, device="cpu", checkpoint=["Block"])
    assert search.baseline >= 1 and search.configured > search.baseline
    for size in (search.baseline, search.baseline + 1):
        est = estimate_memory(TinyGPT(), _tokens(size), gpt_loss, device="cpu")
        assert (est.total_bytes <= budget) == (size == search.baseline)
    assert len(search.evaluations["baseline"]) <= 3


def test_plan_fits_when_the_budget_allows_and_its_flags_verify():
    base = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cuda", overhead_bytes=0)
    budget = base.static_bytes + (base.reserved_bytes - base.static_bytes) * 6 // 10
    result = plan(TinyGPT(), _tokens(16), budget, gpt_loss, device="cuda", overhead_bytes=0)
    assert result.fits and result.predicted_total_bytes <= budget
    kwargs = result.lightmem_kwargs()
    expected_keys = (
        {"offload"}
        | ({"checkpoint"} if result.checkpoint else set())
        | ({"offload_min_bytes"} if result.offload else set())
        | ({"offload_include"} if result.offload and result.offload.include else set())
        | ({"prefetch_bytes", "offload_max_inflight_bytes"} if result.offload else set())
    )
    assert set(kwargs) == expected_keys
    from lightmem import LightMem

    LightMem(**kwargs)  # the plan's flags are valid LightMem flags
    check = estimate_memory(
        TinyGPT(), _tokens(16), gpt_loss, device="cuda", overhead_bytes=0,
        checkpoint=result.checkpoint or None, offload=result.offload,
    )  # fmt: skip
    assert check.total_bytes == result.predicted_total_bytes <= budget


def test_plan_with_offload_off_checkpoints_only_and_verifies():
    # LightMem(plan="auto", offload=False) asks for this plan on a GPU.
    base = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cuda", overhead_bytes=0)
    budget = base.static_bytes + (base.reserved_bytes - base.static_bytes) * 6 // 10
    result = plan(TinyGPT(), _tokens(16), budget, gpt_loss, device="cuda", overhead_bytes=0, offload=False)
    assert result.fits and result.checkpoint and result.offload is None
    assert set(result.lightmem_kwargs()) == {"offload", "checkpoint"}
    assert result.lightmem_kwargs()["offload"] is False
    check = estimate_memory(
        TinyGPT(), _tokens(16), gpt_loss, device="cuda", overhead_bytes=0, checkpoint=result.checkpoint
    )  # fmt: skip
    assert check.total_bytes == result.predicted_total_bytes <= budget


def test_plan_is_empty_when_the_baseline_fits():
    result = plan(TinyGPT(), _tokens(), "1GiB", gpt_loss, device="cpu")
    assert result.fits and result.checkpoint == [] and result.offload is None
    assert result.lightmem_kwargs() == {"offload": False}  # LightMem(checkpoint=[]) would be refused


def test_plan_says_it_cannot_when_static_memory_exceeds_the_budget():
    result = plan(TinyGPT(), _tokens(), "2MiB", gpt_loss, device="cpu")
    assert not result.fits
    assert result.reason == (
        "parameters (853.50 KiB), gradients (853.50 KiB) and optimizer state (1.67 MiB) alone take 3.33 MiB, over the "
        "2.00 MiB budget; no activation technique helps (see the advice)"
    )
    assert result.checkpoint == [] and result.offload is None


def test_plan_rejects_a_bad_bandwidth():
    with pytest.raises(ValueError, match=r"plan\(link_bytes_per_s=...\)"):
        plan(TinyGPT(), _tokens(), "1GiB", gpt_loss, link_bytes_per_s="fast")


def _block(name: str, saved: int, flops: float, sizes: list[int]) -> BlockMemory:
    return BlockMemory(name, saved, flops, input_bytes=sizes[0], saved_sizes=sizes)


def test_choose_actions_prefers_offload_while_compute_hides_the_transfer():
    costs = Costs(flops_per_s=1e12, link_bytes_per_s=1e9, min_bytes=1, allow_offload=True)
    blocks = {
        # 10 MB at 1 GB/s is 10 ms; 1e11 FLOP at 1e12 FLOP/s is 100 ms: the transfer hides.
        "heavy": _block("heavy", 10_000_000, 1e11, [1_000_000] * 10),
        # Same bytes, 1 ms of compute: offloading all would stall, re-running costs 1 ms, and the
        # 1 MB input checkpoint keeps moves in 1 ms, hidden by the re-run: checkpoint + offload.
        "light": _block("light", 10_000_000, 1e9, [1_000_000] * 10),
    }
    actions = choose_actions(blocks, 15_000_000, costs)
    assert actions == {"heavy": OFFLOAD, "light": BOTH}
    assert config_for(actions, 1) == (["light"], {"min_bytes": 1, "include": ["heavy", "light"]})
    assert choose_actions(blocks, 15_000_000, Costs(1e12, 1e9, 1, allow_offload=False)) == {
        "light": CHECKPOINT,
        "heavy": CHECKPOINT,
    }
