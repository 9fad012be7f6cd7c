"""Mixture-of-experts with data-dependent routing, estimated under stated assumptions and planned
within the worst case (issue 57, part 2).

The sizes a routing gives (``torch.where(mask)`` per expert, the experts hit, ``bincount``) are stood
in for: balanced routing for the prediction, the worst case for a bound on the transient peak, both
reported; a plan keeps the bound inside the budget. The models (``moe_models``): LitGPT's
``LLaMAMoE``, Hugging Face's Mixtral and Qwen2-MoE on their eager experts path, a top-k MoE by hand.
"""

from __future__ import annotations

import json

import moe_models
import pytest
import torch
from models import TinyGPT, gpt_loss

from lightmem import estimate_memory, frontier, max_batch_size, plan
from lightmem.estimate.device import run as step_module
from lightmem.estimate.frontier import ROUTED_TOTALS
from lightmem.estimate.report import ROUTING_NOTE
from lightmem.estimate.trace.values import BALANCED, WORST, Routing

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROWS = moe_models.BATCH * moe_models.SEQ


def _estimate(family: str, **kwargs):
    model = moe_models.build(family)
    return estimate_memory(model, moe_models.batch_of(family, moe_models.balanced_ids()), moe_models.loss_fn(family), device="cpu", **kwargs)


# -- the assumption -------------------------------------------------------------------------------


def test_balanced_routing_gives_each_expert_rows_times_top_k_over_experts():
    routing = Routing(categories=4, picks=2, rows=9, mode=BALANCED)
    assert [routing.slice_count() for _ in range(4)] == [5, 5, 4, 4]
    assert routing.category_counts() == [5, 5, 4, 4]


def test_worst_routing_sizes_each_mask_as_large_as_a_routing_can_and_counts_read_together_add_up():
    """A mask read on its own: every row for the first top-k experts, one for each other (so each
    expert runs); counts read together (a split by them) sum to rows x top-k exactly."""
    routing = Routing(categories=4, picks=2, rows=9, mode=WORST)
    assert [routing.slice_count() for _ in range(4)] == [9, 9, 1, 1]
    assert routing.category_counts() == [9, 7, 1, 1]


# -- following the routing through each family's code ---------------------------------------------


@pytest.mark.parametrize("family", moe_models.FAMILIES)
def test_each_family_routes_by_its_experts_masks_and_says_so(family):
    est = _estimate(family)
    where = {
        # The user's statement that ran LitGPT (whose frames are library code, as Hugging Face's are).
        "litgpt": f"moe_models.py:{moe_models._next_token_loss.__code__.co_firstlineno + 1}",
        "by_hand": f"moe_models.py:{moe_models.TopKMoE.forward.__code__.co_firstlineno + 5}",
    }.get(family, f"moe_models.py:{moe_models._hf_loss.__code__.co_firstlineno + 1}")  # inside transformers
    # Nothing else stood in for: Hugging Face's one_hot over experts + 1 classes, the experts hit, each
    # one read back and compared with the padding class are all followed (not read as 0 or False).
    stood_in = (
        f"the rows a top-2 routing of {ROWS} rows sends to one of 4 experts (nonzero) at {where} read as "
        f"{ROWS * 2 // 4} (balanced routing) (x{moe_models.LAYERS * moe_models.EXPERTS})"
    )
    assert est.stand_ins == [stood_in]


SPLITS: list[list[int]] = []


class SortedMoE(torch.nn.Module):
    """Rows sorted by expert and split by each expert's count, read as Python ints (``tolist``): the
    dispatch of DeepSeek-style and torchtitan's MoEs. Counts by ``bincount``, or by ``one_hot`` over
    the experts and one class more, summed (Hugging Face's eager experts count that way)."""

    def __init__(self, counts_by: str) -> None:
        super().__init__()
        self.counts_by = counts_by
        self.gate = torch.nn.Linear(16, 4, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x).softmax(dim=-1).topk(2, dim=-1)
        flat = chosen.flatten()
        order = flat.argsort()
        if self.counts_by == "bincount":
            counts = torch.bincount(flat, minlength=4)
        else:
            counts = torch.nn.functional.one_hot(chosen, num_classes=5).sum(dim=(0, 1))[:4]
        sizes = counts.tolist()
        SPLITS.append(sizes)  # a global: the dry run runs a stand-in whose own state it drops
        pieces = torch.split(x[order // 2], sizes)
        outs = torch.cat([expert(piece) for expert, piece in zip(self.experts, pieces)])
        return torch.zeros_like(x).index_add_(0, order // 2, outs * weights.flatten()[order, None])


@pytest.mark.parametrize("counts_by", ["bincount", "one_hot"])
def test_rows_split_by_counts_read_as_ints_add_up_under_both_assumptions(counts_by):
    SPLITS.clear()
    est = estimate_memory(SortedMoE(counts_by), torch.randn(9, 16), lambda model, x: model(x).sum(), device="cpu")
    assert est.stand_ins == []  # the counts are the routing's: nothing read as 0
    # 9 rows, top-2 of 4: balanced, then the worst case (the first experts take all they can, each
    # other keeps one row); both add up to the 18 rows sorted, or the split would fail.
    assert SPLITS == [[5, 5, 4, 4], [9, 7, 1, 1]]
    assert est.routing_bound_bytes is not None


class SkipsIdleExperts(moe_models.TopKMoE):
    """Runs only the experts some row is routed to (``if not len(token): continue``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x).softmax(dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            if not len(token):
                continue
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def test_under_the_worst_case_every_expert_runs_so_its_gradient_and_state_are_counted():
    est = estimate_memory(SkipsIdleExperts(16, 32, 4, 2), torch.randn(9, 16), lambda model, x: model(x).sum(), device="cpu")
    bound = est.routing_bound.peak.breakdown
    assert (bound["gradients"], bound["optimizer_state"]) == (est.breakdown["gradients"], est.breakdown["optimizer_state"])
    assert est.routing_bound_bytes > est.peak_bytes


def test_a_model_that_routes_nothing_is_traced_once_and_reports_no_bound(monkeypatch):
    traced = []
    run_once = step_module._run_once
    monkeypatch.setattr(step_module, "_run_once", lambda *args: traced.append(args[2].routing) or run_once(*args))
    est = estimate_memory(TinyGPT(), torch.randint(0, 128, (4, 33)), gpt_loss, device="cpu", budget="1GiB")
    assert traced == [BALANCED]
    assert est.routing_bound_bytes is None and est.routing_assumptions is None
    data = est.to_dict()
    assert (data["routing_bound_bytes"], data["routing_assumptions"]) == (None, None)
    assert "worst-case" not in est.to_text()
    traced.clear()
    _estimate("by_hand")
    assert traced == [BALANCED, WORST]


# -- reported -------------------------------------------------------------------------------------


def test_the_estimate_reports_the_balanced_prediction_and_the_worst_case_bound_with_what_each_assumes():
    est = _estimate("by_hand", checkpoint=["MoEBlock"])
    chosen, baseline = est.scenarios["checkpoint"], est.scenarios["baseline"]
    assert est.peak_bytes == chosen.peak_bytes < est.routing_bound_bytes == chosen.routing_bound_bytes
    assert baseline.peak_bytes < baseline.routing_bound_bytes
    assert est.routing_assumptions == ROUTING_NOTE
    data = json.loads(json.dumps(est.to_dict()))
    assert data["routing_bound_bytes"] == est.routing_bound_bytes
    assert data["routing_assumptions"] == ROUTING_NOTE
    assert data["scenarios"]["checkpoint"]["peak_bytes"] == est.peak_bytes
    assert data["scenarios"]["checkpoint"]["routing_bound_bytes"] == est.routing_bound_bytes
    text = " ".join(est.to_text().split())
    assert ROUTING_NOTE in text
    assert "total, worst-case routing" in text


def test_a_budget_between_the_balanced_peak_and_the_bound_does_not_fit():
    est = _estimate("by_hand")
    budget = (est.peak_bytes + est.routing_bound_bytes) // 2
    within = _estimate("by_hand", budget=budget)
    assert within.total_bytes <= budget < within.routing_bound_reserved_bytes
    assert within.fits is False and within.baseline_fits is False
    assert _estimate("by_hand", budget=est.routing_bound_bytes).fits is True


# -- planned within the bound ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def by_hand_estimate():
    return _estimate("by_hand")


def _plan(budget: int, family: str = "by_hand"):
    model = moe_models.build(family)
    return plan(model, moe_models.batch_of(family, moe_models.balanced_ids()), budget, moe_models.loss_fn(family), device="cpu")


def test_a_plan_for_a_routed_model_keeps_the_worst_case_bound_within_the_budget(by_hand_estimate):
    est = by_hand_estimate
    budget = (est.peak_bytes + est.routing_bound_bytes) // 2  # the balanced step fits, its bound does not
    chosen = _plan(budget)
    assert chosen.fits and chosen.checkpoint == ["blocks.0"]
    assert chosen.predicted_reserved_bytes < chosen.routing_bound_bytes == chosen.predicted_total_bytes <= budget
    balanced = chosen.predicted_reserved_bytes
    assert chosen.describe().startswith(
        f"Fits {_mib(budget)} at {_mib(chosen.routing_bound_bytes)} under the worst-case routing of its experts "
        f"({_mib(balanced)} under balanced routing, which the step time assumes): checkpoint blocks.0 (MoEBlock);"
    )
    assert chosen.reason == (
        f"verified peak {_mib(chosen.predicted_peak_bytes)} allocated, {_mib(balanced)} reserved + overhead 0 B; under "
        f"the worst-case routing of its experts {_mib(chosen.routing_bound_bytes)} allocated, "
        f"{_mib(chosen.routing_bound_bytes)} reserved"
    )
    assert chosen.to_dict()["routing_bound_bytes"] == chosen.routing_bound_bytes


def test_a_configuration_whose_balanced_step_fits_and_whose_bound_does_not_is_not_taken():
    one = _estimate("by_hand", checkpoint=["blocks.0"])
    budget = (one.peak_bytes + one.routing_bound_bytes) // 2
    chosen = _plan(budget)
    assert chosen.fits and chosen.checkpoint == ["blocks.0", "blocks.1"]
    assert chosen.predicted_total_bytes <= budget


def test_a_plan_whose_baseline_bound_fits_says_so(by_hand_estimate):
    chosen = _plan(by_hand_estimate.routing_bound_bytes)
    assert chosen.fits and not chosen.checkpoint
    assert chosen.reason == "the baseline step already fits under the worst-case routing of its experts"


def test_the_largest_batch_is_the_largest_whose_worst_case_bound_fits(by_hand_estimate):
    budget = by_hand_estimate.peak_bytes  # the balanced step at this batch fits exactly; its bound does not
    model, batch = moe_models.build("by_hand"), moe_models.batch_of("by_hand", moe_models.balanced_ids())
    found = max_batch_size(model, batch, budget, moe_models.loss_fn("by_hand"), device="cpu", limit=8)
    assert found.baseline == moe_models.BATCH - 1
    at = _estimate("by_hand", budget=budget)
    assert at.total_bytes == budget and not at.fits


def _mib(nbytes: int) -> str:
    from lightmem.config import format_bytes

    return format_bytes(nbytes)


def test_the_frontier_holds_every_row_to_the_worst_case_bound(by_hand_estimate):
    budget = by_hand_estimate.peak_bytes  # a batch of 2 fits balanced, not under its bound
    model, batch = moe_models.build("by_hand"), moe_models.batch_of("by_hand", moe_models.balanced_ids())
    found = frontier(model, batch, budget, moe_models.loss_fn("by_hand"), device="cpu", multiples=(2,), limit=4)
    assert found.reference_batch == moe_models.BATCH - 1
    rows = {row.batch_size: row for row in found.rows}
    assert rows[2].fits and rows[2].plan == "checkpoint blocks.0 (MoEBlock)"
    for size, row in rows.items():
        assert row.predicted_total_bytes == found.plans[size].routing_bound_bytes <= budget
    assert ROUTED_TOTALS in " ".join(found.to_text().split())
