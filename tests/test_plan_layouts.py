"""The planner's whole space, for every model layout (issue 50).

Checkpointing alone, offload alone (block by block, the largest tensors of a block, or every saved
tensor anywhere) and both are searched whatever the layout: a stem ``nn.Sequential`` and the blocks
in another, a ``ModuleList`` named anything, stages nested in containers, blocks of two kinds. A
batch no configuration fits is refused with the closest configuration of each kind.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

from layout_models import StagedNet, TrunkNet, TwoKindsNet, UserResNet, classification_loss, image_batch, user_resnet50
from lightmem import estimate_memory, plan
from lightmem.config import format_bytes
from lightmem.estimate.planning.families import KINDS, Candidate
from lightmem.estimate.planning.space import PlanSpace, plan_space

LAYOUTS = {"stem, blocks, head": UserResNet, "trunk": TrunkNet, "nested stages": StagedNet, "two kinds": TwoKindsNet}
REPEATED = {
    "stem, blocks, head": {f"blocks.{i}": "Bottleneck" for i in range(4)},
    "trunk": {f"trunk.{i}": "Bottleneck" for i in range(4)},
    "nested stages": {f"stages.{s}.{i}": "Bottleneck" for s in range(2) for i in range(2)},
    "two kinds": {f"body.{i}": ("Bottleneck", "BasicBlock")[i % 2] for i in range(4)},
}
BATCH, RESOLUTION = 32, 96


def _batch(size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(size, 3, RESOLUTION, RESOLUTION, generator=generator), torch.arange(size) % 10


def _model(layout: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return LAYOUTS[layout]()


@functools.cache
def _resnet_space() -> PlanSpace:
    """The planner's space for the stem, blocks, head ResNet (built once: its verified steps are reused)."""
    return plan_space(
        _model("stem, blocks, head"), _batch(), classification_loss, device="cuda", overhead_bytes=0,
        optimizer="sgd", offload={"min_bytes": "64KiB"},
    )  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_repeated_blocks_are_found_where_users_put_them(layout):
    estimate = estimate_memory(_model(layout), _batch(2), classification_loss, device="cpu", optimizer="sgd")
    repeated = {name: block.kind for name, block in estimate.blocks.items() if block.repeated}
    assert repeated == REPEATED[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_kind_is_searched_and_a_refusal_names_the_closest_of_each(layout):
    space = plan_space(
        _model(layout), _batch(), classification_loss, device="cuda", overhead_bytes=0, optimizer="sgd",
        offload={"min_bytes": "64KiB"},
    )  # fmt: skip
    refused = space.plan(1)  # nothing fits: every walk runs to its end
    assert not refused.fits
    closest = {}
    for (candidate, _), verified in space.verified.items():
        reserved = space.reserved(verified)
        if candidate.kind not in closest or reserved < closest[candidate.kind][0]:
            closest[candidate.kind] = (reserved, space.describe(candidate))
    assert set(closest) == set(KINDS)
    assert [(option.predicted_total_bytes, option.description) for option in refused.alternatives] == [
        closest[kind] for kind in KINDS
    ]
    assert refused.reason.startswith(
        "no configuration in the planner's space fits: "
        + "; ".join(f"{closest[kind][1]}: {format_bytes(closest[kind][0])} reserved" for kind in KINDS)
    )
    # Whichever kind comes closest, a budget it meets is met by the plan.
    for kind in KINDS:
        budget = closest[kind][0]
        chosen = space.plan(budget)
        assert chosen.fits and chosen.predicted_total_bytes <= budget, (kind, chosen.describe())


def test_resnet50_written_the_usual_way_plans_batch_570_on_12_gib_by_offloading(monkeypatch):
    # Issue 50: the H100 trained ResNet-50 at batch 600 offloading every saved tensor of at least
    # 1 MiB under a 12 GiB cap (8.76 GiB allocated). Written with a stem, one Sequential of
    # bottlenecks and a head, it was refused at 570, the reason naming checkpointing only: offload
    # alone was verified, left out of the reason, and over the budget by the fixed 35% share the
    # allocator was given without expandable segments (12.19 GiB). Replayed, it needs 10.75 GiB.
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    chosen = plan(
        user_resnet50(), image_batch(570), "12GiB", classification_loss, optimizer="sgd", device="cuda", gpu="h100",
        overhead_bytes=0,
    )  # fmt: skip
    assert chosen.fits and chosen.predicted_total_bytes <= 12 << 30
    assert not chosen.checkpoint and chosen.offload is not None and chosen.recompute_s == 0
    assert chosen.describe().startswith(f"Fits 12.00 GiB at {format_bytes(chosen.predicted_total_bytes)}: offload ")


def test_the_space_holds_four_walks_and_offload_alone_ends_at_offload_everywhere():
    # The walks the module docstring of the planner names, each to its extreme: what completeness
    # is promised for (and what max_batch_size(plan=True) asks of each size's space). Offload
    # alone goes block by block, then to every saved tensor of at least min_bytes anywhere.
    space = _resnet_space()
    walks = [walk.name for walk in space.families]
    assert walks == ["checkpoint", "offload", "per block", "offload everywhere"]
    assert [space.describe(candidate) for candidate in space.extremes()] == [
        "checkpoint blocks.0-3 (Bottleneck)",
        "offload every saved tensor of at least 64.00 KiB",
        "checkpoint blocks.0-3 (Bottleneck) + offload blocks.0-3 (Bottleneck), stem.0-3",
        "checkpoint blocks.0-3 (Bottleneck) + offload every saved tensor of at least 64.00 KiB",
    ]


def test_at_the_budget_of_offloading_every_block_the_plan_offloads_them_and_checkpoints_nothing():
    # Offload everywhere fits this budget too, but moves the stem's and the head's tensors as well:
    # offload alone, block by block, is the faster plan, and only its walk holds it.
    space = _resnet_space()
    blocks = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    budget = space.reserved(space.verify(Candidate(offload=frozenset(blocks))))
    chosen = space.plan(budget)
    assert chosen.fits and chosen.predicted_total_bytes <= budget
    assert (chosen.family, chosen.checkpoint, chosen.offload.include, chosen.offload_everywhere) == (
        "offload", [], blocks, False
    )
    assert chosen.recompute_s == 0 and chosen.lightmem_kwargs()["offload_include"] == list(blocks)


def test_each_walk_searched_on_its_own_fits_the_budget_of_its_extreme_whatever_its_predictions():
    # Predictions only say where a walk starts looking; verified steps decide. Each walk alone fits
    # the budget of its extreme, and offload everywhere's walk the budget of its start (offload
    # alone), starting from its predictions or from its extreme (none predicted to save enough).
    # On this ResNet checkpointing on top of offload raises the peak (a re-run materialises a block
    # in backward), so from the extreme only the walk's fallback to its start finds the fit.
    space = _resnet_space()
    everywhere = space.families[-1]
    reserved = [space.reserved(space.verify(candidate)) for candidate in everywhere.candidates]
    assert min(reserved[1:]) > reserved[0]
    for walk in space.families:
        promised = [walk.candidates[-1]] + [walk.candidates[0]] * walk.starts_with_offload_alone
        for candidate in promised:
            budget = space.reserved(space.verify(candidate))
            for predicted in (walk.predicted_saved, [0] * len(walk.candidates)):
                alone = copy.copy(space)
                alone.families = [dataclasses.replace(walk, predicted_saved=predicted)]
                # Nothing verified before: a configuration verified for another budget is the
                # plan's last resort, and would answer for the walk.
                alone.verified = {}
                chosen = alone.plan(budget)
                searched = (walk.name, space.describe(candidate), predicted)
                assert chosen.fits and chosen.family == walk.name, searched
                assert chosen.predicted_total_bytes <= budget
