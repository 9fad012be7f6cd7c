"""A plan space that can pay: a block's largest tensors offloaded alone (what its own compute hides)
and the checkpoint policy chosen by the planner, each picked where it is predicted cheaper than
whole-block actions; the engine and the estimator share the per-module threshold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import TinyGPT, gpt_loss

from lightmem import LightMem, estimate_memory, offload_activations, plan
from lightmem.estimate.pricing.costs import PARTIAL, Costs
from lightmem.estimate.planning.families import choose_actions
from lightmem.estimate.trace.blocks import BlockMemory
from lightmem.estimate.pricing.costs import partial_offload
from lightmem.estimate.pricing.timeline import step_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt_model import GPT  # noqa: E402

MiB = 2**20


def test_a_modules_own_threshold_moves_only_its_larger_tensors_in_the_engine_and_the_estimate():
    torch.manual_seed(0)
    model = TinyGPT(depth=2)
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    include = {"blocks.0": "64KiB", "blocks.1": 0}  # blocks.0: its tensors of 64 KiB and more only
    offloader = offload_activations(model, min_bytes="16KiB", devices=("cpu",), include=include)
    with offloader:
        loss = gpt_loss(model, tokens)
    loss.backward()
    moved = offloader.stats.offloaded_bytes
    predicted = estimate_memory(
        model, tokens, gpt_loss, device="cpu", offload={"min_bytes": "16KiB", "include": include}
    ).scenarios["offload"]
    assert predicted.offloaded_bytes == moved
    whole = offload_activations(model, min_bytes="16KiB", devices=("cpu",), include=["blocks.0", "blocks.1"])
    with whole:
        loss = gpt_loss(model, tokens)
    loss.backward()
    assert 0 < moved < whole.stats.offloaded_bytes
    assert LightMem(offload_include=include).settings.offload.include_min_bytes == (64 * 1024, 0)


def test_the_greedy_offloads_a_blocks_largest_tensors_first_when_only_their_copy_hides():
    # One block of 100 ms forward on a 1 GB/s link hides 100 MB of copies: its largest tensor
    # (60 MB) moves; with both 40 MB ones (every tensor of a size moves, or none) it would be 140 MB.
    block = BlockMemory("b", 141_000_000, 0.0, 1_000_000, [60_000_000, 40_000_000, 40_000_000, 1_000_000],
                        repeated=True, forward_s=0.1, backward_s=0.2)  # fmt: skip
    costs = Costs(1e12, 1e9, 1, allow_offload=True)
    assert partial_offload(block, costs) == (60_000_000, 60_000_000)
    with_partial = Costs(1e12, 1e9, 1, allow_offload=True, partial={"b": (60_000_000, 60_000_000)})
    assert choose_actions({"b": block}, 50_000_000, with_partial) == {"b": PARTIAL}
    # On the step's timeline (a block of half its compute runs after it): the partial offload is free,
    # offloading the whole block exposes what its copy takes beyond the compute after it.
    blocks = {"b": block, "c": BlockMemory("c", 0, 0.0, 0, [], repeated=True, forward_s=0.05, backward_s=0.1)}
    partial = step_time(blocks, {"b": PARTIAL}, with_partial)
    whole = step_time(blocks, {"b": "offload"}, with_partial)
    assert partial.exposed_transfer_s == 0.0 < whole.exposed_transfer_s


@pytest.fixture(scope="module")
def fp32_gpt():
    """A 4-block GPT in fp32 on an H100: its blocks compute long enough to hide their largest
    tensors' copies, not all of them."""
    with torch.device("meta"):
        model = GPT(vocab=8192, dim=1024, depth=4, heads=16, seq=1024, dropout=0.0)

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    tokens = torch.zeros(8, 1025, dtype=torch.long)
    return model, tokens, loss_fn


def test_the_plan_picks_a_partial_offload_where_it_is_predicted_cheaper_than_whole_blocks(fp32_gpt, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as plan="auto" sets
    model, tokens, loss_fn = fp32_gpt
    baseline = estimate_memory(model, tokens, loss_fn, optimizer="adamw", gpu="h100")
    chosen = plan(model, tokens, int(baseline.total_bytes * 0.9), loss_fn, optimizer="adamw", gpu="h100")
    assert chosen.fits and chosen.offload is not None and chosen.offload.include_min_bytes is not None
    thresholds = dict(zip(chosen.offload.include, chosen.offload.include_min_bytes))
    partial = {name: size for name, size in thresholds.items() if size}
    assert partial and all(size > chosen.offload.min_bytes for size in partial.values())
    assert chosen.lightmem_kwargs()["offload_include"] == thresholds
    assert "offload the saved tensors of at least " in chosen.describe()
    # The same blocks offloaded whole would cost more: their transfer sticks out of the compute.
    whole = estimate_memory(
        model, tokens, loss_fn, optimizer="adamw", gpu="h100",
        offload=chosen.offload.to_dict() | {"include": list(thresholds)},
    ).scenarios["offload"]  # fmt: skip
    assert chosen.step_seconds < whole.step_seconds
    # The threshold is the engine's: the estimate of the plan's own settings moves what it verified.
    mine = estimate_memory(model, tokens, loss_fn, optimizer="adamw", gpu="h100", offload=chosen.offload)
    assert mine.scenarios["offload"].peak_bytes == chosen.predicted_peak_bytes


def test_plan_auto_policy_picks_save_matmuls_where_its_plan_is_faster():
    torch.manual_seed(0)
    model = TinyGPT(depth=4)
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    budget = estimate_memory(model, tokens, gpt_loss, device="cpu").peak_bytes - 200_000
    full = plan(model, tokens, budget, gpt_loss, device="cpu", checkpoint_policy="full")
    matmuls = plan(model, tokens, budget, gpt_loss, device="cpu", checkpoint_policy="save_matmuls")
    chosen = plan(model, tokens, budget, gpt_loss, device="cpu", checkpoint_policy="auto")
    assert full.fits and matmuls.fits and matmuls.step_seconds < full.step_seconds
    assert chosen.checkpoint_policy == "save_matmuls" and chosen.step_seconds == matmuls.step_seconds
    assert chosen.lightmem_kwargs()["checkpoint_policy"] == "save_matmuls"
    assert chosen.alternatives[0].description == "checkpoint with checkpoint_policy='full': checkpoint blocks.0 (Block)"
    # A budget the "full" plan meets without checkpointing asks nothing of the policy.
    roomy = plan(model, tokens, "1GiB", gpt_loss, device="cpu", checkpoint_policy="auto")
    assert roomy.fits and roomy.checkpoint == [] and roomy.checkpoint_policy == "full"
