"""The planner's whole space, for every model layout (issue 50).

Checkpointing alone, offload alone (block by block, the largest tensors of a block, or every saved
tensor anywhere) and both are searched whatever the layout: a stem ``nn.Sequential`` and the blocks
in another, a ``ModuleList`` named anything, stages nested in containers, blocks of two kinds. A
batch no configuration fits is refused with the closest configuration of each kind.
"""

from __future__ import annotations

import pytest
import torch

from layout_models import StagedNet, TrunkNet, TwoKindsNet, UserResNet, classification_loss, image_batch, user_resnet50
from lightmem import estimate_memory, plan
from lightmem.config import format_bytes
from lightmem.estimate.planner import KINDS, plan_space

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
