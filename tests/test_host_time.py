"""The host's timeline in the step-time model: a block ends on the device no sooner than the host
has launched it, and a checkpointed block's re-run costs the host its launches and checkpointing's
bookkeeping, not its device seconds (``lightmem.estimate.pricing.timeline``, ``devices.checkpoint_host_seconds``).

The pins: GPT-2 from its default config (bf16 autocast, AdamW, 1024 tokens) on the H100 of
2026-11-27 (docs/gpu-runs/2026-11-27-h100-run3-frontier.txt), a host-bound step: batch 3 without
lightmem 49.9 ms; batch 4 with blocks 0-6 under ``save_matmuls`` 90.9 ms; batch 6 with blocks 0-10
checkpointed 78.2 ms; batch 7 with all 12 checkpointed and their inputs and ``lm_head`` offloaded
93.9 ms. Batches 3, 4 and 6 calibrated ``HOST_OP_S`` and the two shares; batch 7 did not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightmem import DeviceSpeeds, estimate_memory
from lightmem.devices import CHECKPOINT_HOST_SHARE, POLICY_HOST_SHARE, checkpoint_host_seconds
from lightmem.estimate.trace.blocks import BlockMemory
from lightmem.estimate.words import format_seconds
from lightmem.estimate.pricing.costs import CHECKPOINT, Costs
from lightmem.estimate.pricing.timeline import compute_s, forward_intervals, step_time

ROOT = Path(__file__).resolve().parent.parent
MS = 1e-3
HOST_OP = 50e-6
WITHIN = 0.15


def _block(name: str, forward_ms: float, backward_ms: float, forward_ops: int, backward_ops: int, **kw) -> BlockMemory:
    return BlockMemory(
        name, 1 << 20, 0.0, 0, [1 << 20], kind="Layer", repeated=True, forward_s=forward_ms * MS,
        backward_s=backward_ms * MS, forward_ops=forward_ops, backward_ops=backward_ops, **kw,
    )  # fmt: skip


def _costs(blocks: dict[str, BlockMemory], host_op_s: float = HOST_OP, optimizer_ops: int = 0) -> Costs:
    ops = sum(block.forward_ops + block.backward_ops for block in blocks.values()) + optimizer_ops
    return Costs(1e12, 50e9, 1 << 20, allow_offload=False, host_s=ops * HOST_OP, host_op_s=host_op_s)


def test_a_host_bound_forward_before_a_device_bound_backward_adds_up_where_the_maximum_would_not():
    # Forward: 40 ops (2 ms of host) over 1 ms of device; backward: 10 ops (0.5 ms) under 2 ms.
    blocks = {name: _block(name, 1.0, 2.0, 40, 10) for name in ("a", "b")}
    # Host 2, 4 ms launching the forwards; the device ends them at 2 and 4 ms, then 2 ms per backward.
    assert compute_s(blocks, _costs(blocks)) == pytest.approx(8 * MS, rel=1e-12)
    # The device's 6 ms and the host's 5 ms: neither alone is the step.
    assert compute_s(blocks, _costs(blocks, host_op_s=0.0)) == pytest.approx(6 * MS, rel=1e-12)


def test_a_blocks_forward_interval_is_what_bounds_it_the_host_after_its_lead_or_the_device():
    # What a pair of CUDA events around each forward times (plan="auto"'s block clock): a: 1 ms of
    # compute, 10 ops (0.5 ms) of launches: the host ends 0.5 ms ahead. b: 0.2 ms of compute, 30 ops
    # (1.5 ms): the host, 1.5 ms less its lead, binds. c, checkpointed under the full policy: its
    # launches alone (the full policy's bookkeeping and re-run fall in the backward).
    blocks = {"a": _block("a", 1.0, 2.0, 10, 10), "b": _block("b", 0.2, 0.4, 30, 30), "c": _block("c", 0.2, 0.4, 30, 30)}
    found = forward_intervals(blocks, {"c": CHECKPOINT}, _costs(blocks))
    assert [found[n].seconds / MS for n in "abc"] == pytest.approx([1.0, 1.0, 1.5], rel=1e-12)
    assert [found[n].host_bound for n in "abc"] == [False, True, True]
    assert (found["b"].host_s / MS, found["b"].launch_s / MS, found["b"].device_s / MS) == pytest.approx((1.0, 1.5, 0.2))
    assert checkpoint_host_seconds(HOST_OP, 30, 30, False)[0] == 0.0 and found["c"].launch_s == pytest.approx(30 * HOST_OP)
    # Without per-op host prices every interval is the block's compute.
    assert [found.seconds for found in forward_intervals(blocks, {}, _costs(blocks, host_op_s=0.0)).values()] == (
        pytest.approx([1.0 * MS, 0.2 * MS, 0.2 * MS], rel=1e-12)
    )


def test_a_device_bound_step_is_its_device_time_whatever_the_host_launches_under_it():
    blocks = {name: _block(name, 3.0, 6.0, 40, 60) for name in ("a", "b", "c")}
    assert compute_s(blocks, _costs(blocks)) == pytest.approx(27 * MS, rel=1e-12)
    priced = step_time(blocks, {"b": CHECKPOINT}, _costs(blocks))
    assert priced.recompute_s == pytest.approx(3 * MS, rel=1e-12)  # the device's re-run
    assert priced.exposed_transfer_s == 0.0


def test_a_checkpointed_block_of_a_host_bound_step_costs_the_host_its_launches_and_checkpointings_bookkeeping():
    blocks = {name: _block(name, 0.1, 0.2, 40, 60) for name in ("a", "b")}
    assert compute_s(blocks, _costs(blocks)) == pytest.approx(200 * HOST_OP, rel=1e-12)
    priced = step_time(blocks, {"b": CHECKPOINT}, _costs(blocks))
    assert priced.recompute_s == pytest.approx((40 + CHECKPOINT_HOST_SHARE * 40) * HOST_OP, rel=1e-12)
    assert priced.step_s == pytest.approx((200 + 40 + CHECKPOINT_HOST_SHARE * 40) * HOST_OP, rel=1e-12)


def test_an_op_policy_costs_the_host_its_python_for_every_op_in_both_passes_and_relaunches_only_what_it_runs_again():
    blocks = {
        "a": _block("a", 0.1, 0.2, 40, 60),
        "b": _block("b", 0.1, 0.2, 40, 60, recompute_s=0.05 * MS, recompute_ops=30),
    }
    priced = step_time(blocks, {"b": CHECKPOINT}, _costs(blocks))
    added = (30 + CHECKPOINT_HOST_SHARE * 40 + 2 * POLICY_HOST_SHARE * 40) * HOST_OP
    assert priced.recompute_s == pytest.approx(added, rel=1e-12)
    assert sum(checkpoint_host_seconds(HOST_OP, 40, 30, True)) == pytest.approx(added, rel=1e-12)
    assert checkpoint_host_seconds(HOST_OP, 40, 40, False) == (0.0, (40 + CHECKPOINT_HOST_SHARE * 40) * HOST_OP)


def test_without_per_block_host_prices_the_whole_steps_host_time_bounds_it_and_a_rerun_costs_its_device_time():
    blocks = {name: _block(name, 0.1, 0.2, 0, 0) for name in ("a", "b")}
    costs = Costs(1e12, 50e9, 1 << 20, allow_offload=False, host_s=5 * MS)
    assert compute_s(blocks, costs) == pytest.approx(5 * MS, rel=1e-12)
    assert step_time(blocks, {"b": CHECKPOINT}, costs).step_s == pytest.approx(5.1 * MS, rel=1e-12)


# -- GPT-2 on the H100 -------------------------------------------------------------------------


def _gpt2_loss(model, batch):
    logits = model(input_ids=batch).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _blocks(indices) -> list[str]:
    return [f"transformer.h.{index}" for index in indices]


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    speeds = DeviceSpeeds.from_dict(json.loads((ROOT / "docs/gpu-runs/2026-11-27-h100-speeds.json").read_text()))
    return model, speeds


@pytest.mark.parametrize(
    ("batch", "checkpoint", "policy", "offload", "measured_ms"),
    [
        (3, None, "full", None, 49.85),
        (4, _blocks(range(7)), "save_matmuls", None, 90.88),
        (6, _blocks(range(11)), "full", None, 78.16),
        (7, _blocks(range(12)), "full", {"min_bytes": 1 << 20, "include": [*_blocks(range(12)), "lm_head"]}, 93.92),
    ],
    ids=["batch3-nothing", "batch4-save_matmuls", "batch6-checkpoint11", "batch7-checkpoint12-offload"],
)
def test_gpt2s_host_bound_steps_on_the_h100_are_predicted_within_15_percent(gpt2, batch, checkpoint, policy, offload, measured_ms):
    model, speeds = gpt2
    estimate = estimate_memory(
        model, torch.zeros(batch, 1024, dtype=torch.long), _gpt2_loss, optimizer="adamw", precision="bf16-mixed",
        gpu=speeds, checkpoint=checkpoint, checkpoint_policy=policy, offload=offload,
    )  # fmt: skip
    assert estimate.step_seconds == pytest.approx(measured_ms * MS, rel=WITHIN)


@pytest.mark.parametrize(
    ("patched", "batch", "checkpoint", "policy", "measured_ms"),
    [
        ("checkpoint_host_seconds", 4, _blocks(range(7)), "save_matmuls", 90.88),
        ("_host_s", 6, _blocks(range(11)), "full", 78.16),
    ],
    ids=["no-host-share-of-the-policy", "no-host-timeline"],
)
def test_without_the_hosts_timeline_or_its_share_of_a_rerun_gpt2s_checkpointed_steps_are_predicted_far_too_fast(
    gpt2, monkeypatch, patched, batch, checkpoint, policy, measured_ms
):
    """The negative controls: a re-run that costs the host nothing more (batch 4, ``save_matmuls``),
    or only the whole step's host time as a bound (batch 6: the step as the maximum of the host's
    and the device's times), is predicted more than 15% under its measured step."""
    model, speeds = gpt2
    import lightmem.estimate.pricing.timeline as step_time_module

    if patched == "checkpoint_host_seconds":
        monkeypatch.setattr(step_time_module, patched, lambda *args: (0.0, 0.0))
    else:
        monkeypatch.setattr(step_time_module, patched, lambda blocks, *args: ([0.0] * len(blocks), [0.0] * len(blocks), 0.0))
    estimate = estimate_memory(
        model, torch.zeros(batch, 1024, dtype=torch.long), _gpt2_loss, optimizer="adamw", precision="bf16-mixed",
        gpu=speeds, checkpoint=checkpoint, checkpoint_policy=policy,
    )  # fmt: skip
    assert estimate.step_seconds < measured_ms * MS / (1 + WITHIN)


# -- what the estimate says ----------------------------------------------------------------------


def test_the_estimate_says_when_its_step_waits_on_the_host_and_not_when_the_device_bounds_it():
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from estimate_factories import tiny_gpt

    model, tokens, loss_fn = tiny_gpt(16)
    small = estimate_memory(model, tokens, loss_fn, optimizer="adamw", gpu="h100")
    ops = sum(calls for _, calls in small.op_seconds.values())
    device = sum(seconds for seconds, _ in small.op_seconds.values())
    assert ops == 286 and device < small.speeds.host_seconds(ops)
    sentence = (
        f"The step waits on the host: it launches 286 ops at 50.0 us each, 14.3 ms, where the device's work "
        f"takes {format_seconds(device)}. A larger batch costs little more per step, and a checkpointed "
        "block's re-run costs the host its launches."
    )
    assert small.host_wait() == sentence
    assert sentence in small.to_text(width=1000)
    # On the CPU the host runs the ops itself: there is no device to wait for.
    assert estimate_memory(model, tokens, loss_fn, optimizer="adamw", device="cpu").host_wait() is None
    # A device-bound step (the same model at 16 times the batch on a slower device) says nothing.
    model, tokens, loss_fn = tiny_gpt(256)
    large = estimate_memory(model, tokens, loss_fn, optimizer="adamw", gpu="t4")
    large_ops = sum(calls for _, calls in large.op_seconds.values())
    assert sum(seconds for seconds, _ in large.op_seconds.values()) > large.speeds.host_seconds(large_ops)
    assert large.host_wait() is None
