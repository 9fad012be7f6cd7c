"""The planning functions' answers agree with each other and read as what they are: the largest batch
does not depend on the batch a search starts from, every figure of a message is its breakdown's, a
budget smaller than the overhead allowance is said to be, and results print as short tables."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models import TinyGPT, gpt_loss
from torch import nn

from lightmem import frontier, max_batch_size, plan
from lightmem.config import format_bytes
from lightmem.estimate.planning.space import plan_space


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """Four repeated layers of 1024 features: a sample saves 4 KiB per tensor, so no saved tensor
    reaches offload's 1 MiB threshold below a batch of 256. Quick to trace."""

    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(32, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _mlp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


MLP_ARGS = {"gpu": "h100", "overhead_bytes": 0, "optimizer": "sgd"}


def test_max_batch_size_with_plan_is_the_same_from_any_starting_batch():
    # At a batch of 2 the planner's space offloads nothing (no tensor reaches 1 MiB): a search that
    # took its extreme configurations there answered 1372 (checkpointing only), from 2000 it answered
    # 2247 with a plan that did not fit 2247's own search.
    assert all(not candidate.offloads for candidate in plan_space(MLP(), torch.randn(2, 32), _mlp_loss, **MLP_ARGS).extremes())
    searches = [
        max_batch_size(MLP(), torch.randn(start, 32), "140MiB", _mlp_loss, plan=True, **MLP_ARGS)
        for start in (2, 64, 2000)
    ]
    assert len({(search.baseline, search.planned) for search in searches}) == 1
    search = searches[0]
    assert search.planned > search.baseline > 0
    assert search.plan.fits and search.plan.estimate.batch_size == search.planned and search.plan.offload is not None
    for name, evaluations in search.evaluations.items():  # no extreme of the next size's space fits it
        if name.startswith("plan: "):
            assert all(total > 140 * 2**20 for size, total in evaluations if size > search.planned)
    # Where the plans start to matter: each search asks the planner from the first size that does
    # not fit without lightmem, never at or below it, whatever batch it was given (2 and 64 lie below).
    for search in searches:
        asked = [found for name, found in search.evaluations.items() if name.startswith("plan: ")]
        planned = [size for found in asked for size, _ in found]
        assert min(planned) == search.baseline + 1, sorted(planned)[:4]


def _tokens(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, 128, (batch, 33), generator=torch.Generator().manual_seed(0))


def test_a_plan_that_cannot_fit_names_each_static_part_as_its_breakdown_gives_it():
    chosen = plan(TinyGPT(), _tokens(), "68MiB", gpt_loss, gpu="h100", overhead_bytes="4MiB")
    parts = chosen.estimate.scenarios["baseline"].breakdown
    assert not chosen.fits and parts["workspaces"] == 64 * 2**20  # an H100's cuBLAS workspaces
    named = (
        f"parameters ({format_bytes(parts['parameters'])}), gradients ({format_bytes(parts['gradients'])}), "
        f"optimizer state ({format_bytes(parts['optimizer_state'])}) and cuBLAS workspaces (64.00 MiB)"
    )
    static = parts["parameters"] + parts["gradients"] + parts["optimizer_state"] + parts["workspaces"]
    assert chosen.reason == (
        f"{named} alone take {format_bytes(static)}, over the 64.00 MiB the 68.00 MiB budget leaves after the 4.00 MiB "
        "overhead allowance; no activation technique helps (see the advice)"
    )
    (advice,) = [item.message for item in chosen.estimate.advice if item.rule == "static-exceeds-budget"]
    assert advice.startswith(f"{named} alone take {format_bytes(static)}; with the 4.00 MiB overhead allowance")


SHORTFALL = (
    "the 64.00 MiB budget is no larger than the 1.00 GiB overhead allowance it must also hold (the CUDA context "
    "and what the caching allocator does not count), so nothing is left for the step: give a budget above "
    "1.00 GiB, or a smaller allowance (overhead_bytes=..., --overhead)"
)


def test_a_budget_under_the_overhead_allowance_is_said_to_be_and_gives_no_flags():
    chosen = plan(TinyGPT(), _tokens(), "64MiB", gpt_loss, gpu="h100")
    assert not chosen.fits and chosen.reason == SHORTFALL
    assert [(item.rule, item.message) for item in chosen.estimate.advice][:1] == [
        ("budget-below-overhead", f"T{SHORTFALL[1:]}.")
    ]
    assert chosen.describe() == f"No lightmem configuration fits 64.00 MiB: {SHORTFALL}"
    assert repr(chosen) == f"Plan(does not fit 64.00 MiB: {SHORTFALL[:97].rstrip()}...)"
    with pytest.raises(ValueError) as raised:
        chosen.lightmem_kwargs()
    assert str(raised.value) == (
        f"Plan.lightmem_kwargs(): this plan does not fit its 64.00 MiB budget, so no LightMem flags would make the "
        f"step fit: {SHORTFALL}"
    )
    assert chosen.to_dict()["lightmem_kwargs"] is None


def test_a_frontier_on_a_budget_nothing_fits_has_no_rows_and_says_why():
    found = frontier(TinyGPT(), _tokens(), "64MiB", gpt_loss, gpu="h100")
    assert (found.reference_batch, found.largest_batch, found.rows, found.reason) == (0, 0, [], SHORTFALL)
    assert found.to_text() == (
        f"Frontier on 64.00 MiB: no batch fits, not even 1 with a plan: {SHORTFALL}\n"
        f"Priced at {found.speeds.describe()}.\n"
    )
    assert repr(found) == (
        "Frontier(budget 64.00 MiB, reference batch 0, largest with a plan 0, 0 rows; print() for the table)"
    )


def test_results_print_as_short_tables_and_have_short_reprs(capsys):
    search = max_batch_size(MLP(), torch.randn(2, 32), "140MiB", _mlp_loss, plan=True, **MLP_ARGS)
    print(search)
    search.print()
    printed = capsys.readouterr().out
    table = (
        "Largest batch that fits 140.00 MiB\n"
        "configuration       largest batch\n"
        "------------------  -------------\n"
        f"without lightmem    {search.baseline:>13}\n"
        f"with the best plan  {search.planned:>13}\n"
        f"The best plan at batch {search.planned}: {search.plan.describe()}\n"
    )
    assert printed == table + "\n" + table
    assert repr(search) == (
        f"BatchSearch(baseline={search.baseline}, configured=None, planned={search.planned}, budget 140.00 MiB; "
        "print() for the table)"
    )
    chosen = search.plan
    assert str(chosen) == chosen.describe()
    assert repr(chosen) == (
        f"Plan(fits 140.00 MiB at {format_bytes(chosen.predicted_total_bytes)}: {'; '.join(chosen.parts())}; step "
        f"{chosen.describe().split('predicted step ')[1].split(',')[0]}, {chosen.slowdown:.2f}x)"
    )
    assert len(repr(chosen.estimate)) < 120 and repr(chosen.estimate).startswith("MemoryEstimate(peak ")


def test_the_frontier_wraps_its_plan_column():
    found = frontier(MLP(), torch.randn(2, 32), "140MiB", _mlp_loss, multiples=(1, 2, 3), **MLP_ARGS)
    # A plan in many words, as a deep model's offload of named modules reads (over 200 characters).
    long_plan = "offload " + ", ".join(f"layers.{index} (Layer)" for index in range(12))
    found.rows[-1] = dataclasses.replace(found.rows[-1], plan=long_plan)
    lines = found.to_text().splitlines()
    assert lines[0] == (
        f"Frontier on 140.00 MiB: reference batch {found.reference_batch} (the largest without lightmem), largest "
        f"with a plan {found.largest_batch}"
    )
    plan_column = lines[1].index("plan")
    rows = lines[3:-1]
    assert max(len(line[plan_column:].split("  ")[0]) for line in rows) <= 60
    assert [line for line in rows if not line[:plan_column].strip()]  # a plan in words went on to a line of its own
    assert str(found) == found.to_text() and repr(found).startswith("Frontier(budget 140.00 MiB, reference batch ")
