"""The estimator and planner know the checkpoint policy: what an op-level checkpointed block keeps,
what it re-runs, the predicted peak, and the plan's flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from models import TinyGPT, gpt_loss

from lightmem import LightMem, estimate_memory
from lightmem.estimate.pricing.costs import CHECKPOINT, Costs, recompute_s, saves_bytes
from lightmem.estimate.planning.families import choose_actions
from lightmem.estimate.planner import plan
from lightmem.estimate.trace.blocks import BlockMemory

# TinyGPT(dim=64, heads=4), batch 4, sequence 32, float32: the outputs save_matmuls keeps per block
# are qkv (4x32x192), q@k^T (4x4x32x32), attn@v (4x4x32x16), proj (4x32x64), fc1 (4x32x256) and
# fc2 (4x32x64).
KEPT_PER_BLOCK = 4 * 4 * (32 * 192 + 4 * 32 * 32 + 4 * 32 * 16 + 32 * 64 + 32 * 256 + 32 * 64)


def _tokens(batch=4):
    return torch.randint(0, 128, (batch, 33), generator=torch.Generator().manual_seed(0))


def _estimate(policy, checkpoint=("Block",)):
    torch.manual_seed(0)
    return estimate_memory(
        TinyGPT(depth=4), _tokens(), gpt_loss, device="cpu", checkpoint=list(checkpoint) or None,
        checkpoint_policy=policy,
    )  # fmt: skip


def test_blocks_report_exactly_the_bytes_save_matmuls_keeps_and_no_recomputed_flops():
    blocks = _estimate("save_matmuls").blocks
    for name in ("blocks.0", "blocks.3"):
        assert blocks[name].kept_bytes == KEPT_PER_BLOCK
        assert blocks[name].recompute_flops == 0.0  # every FLOP-counted op is a kept matmul
        assert blocks[name].forward_flops > 0
    full = _estimate("full").blocks["blocks.0"]
    assert (full.kept_bytes, full.recompute_flops) == (0, None)


def test_predicted_peak_with_save_matmuls_lies_between_none_and_full():
    matmuls, full = _estimate("save_matmuls"), _estimate("full")
    none = matmuls.scenarios["baseline"].peak_bytes
    assert full.scenarios["checkpoint"].peak_bytes < matmuls.scenarios["checkpoint"].peak_bytes < none


def test_a_callable_policy_is_priced_by_the_ops_it_keeps():
    def keep_mlp_input(ctx, op, *args, **kwargs):
        return op.overloadpacket is torch.ops.aten.addmm and args[1].shape[-1] == 64 and args[2].shape[-1] == 256

    block = _estimate(keep_mlp_input).blocks["blocks.0"]
    assert block.kept_bytes == 4 * 4 * 32 * 256  # fc1's output only
    assert 0 < block.recompute_flops < block.forward_flops


def test_planner_prices_checkpointing_by_the_policy():
    costs = Costs(flops_per_s=1e9, link_bytes_per_s=1e9, min_bytes=0, allow_offload=False)
    full = BlockMemory("b", saved_bytes=1000, forward_flops=4e6, input_bytes=100, repeated=True)
    matmuls = BlockMemory(
        "b", saved_bytes=1000, forward_flops=4e6, input_bytes=100, repeated=True, kept_bytes=600, recompute_flops=1e6
    )
    assert saves_bytes(full, CHECKPOINT, costs) == 900 and recompute_s(full, costs) == 4e-3
    assert saves_bytes(matmuls, CHECKPOINT, costs) == 300 and recompute_s(matmuls, costs) == 1e-3
    assert choose_actions({"b": matmuls}, 300, costs) == {"b": CHECKPOINT}


def test_plan_with_save_matmuls_verifies_its_choice_and_hands_the_policy_to_lightmem():
    torch.manual_seed(0)
    model = TinyGPT(depth=4)
    baseline = estimate_memory(model, _tokens(), gpt_loss, device="cpu").peak_bytes
    chosen = plan(model, _tokens(), baseline - 200_000, gpt_loss, device="cpu", checkpoint_policy="save_matmuls")
    assert chosen.fits and chosen.checkpoint
    assert chosen.checkpoint_policy == "save_matmuls"
    # The re-run repeats only the cheap ops between the kept matmuls: their memory time, no FLOP.
    blocks = chosen.estimate.blocks
    assert chosen.recompute_s == pytest.approx(sum(blocks[name].recompute_s for name in chosen.checkpoint))
    assert 0 < chosen.recompute_s < sum(blocks[name].forward_s for name in chosen.checkpoint)
    assert all(blocks[name].recompute_flops == 0.0 for name in chosen.checkpoint)
    assert chosen.lightmem_kwargs() == {"offload": False, "checkpoint": chosen.checkpoint, "checkpoint_policy": "save_matmuls"}
    assert chosen.to_dict()["checkpoint_policy"] == "save_matmuls"
    assert "(policy save_matmuls)" in chosen.describe()
    LightMem(**chosen.lightmem_kwargs())  # the flags are valid as they are
    verified = estimate_memory(
        model, _tokens(), gpt_loss, device="cpu", checkpoint=chosen.checkpoint, checkpoint_policy="save_matmuls"
    )
    assert verified.peak_bytes == chosen.predicted_peak_bytes


def test_bad_policy_names_the_estimators_flag():
    with pytest.raises(ValueError, match=r"^estimate_memory\(checkpoint_policy=\.\.\.\): expected 'full'"):
        estimate_memory(TinyGPT(depth=1), _tokens(), gpt_loss, device="cpu", checkpoint=["Block"], checkpoint_policy="some")


# -- against a real CPU step (MemTracker, in a child process as in test_estimate_accuracy.py) ----

_MEASURE = """
import copy, json, sys
import torch
sys.path.insert(0, {tests!r})
from models import TinyGPT, gpt_loss
from lightmem import apply_checkpointing, estimate_memory
from lightmem.testing.measure import measure_cpu_step
torch.manual_seed(0)
model = TinyGPT(depth=4)
tokens = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(0))
results = {{}}
for policy in ("save_matmuls", "full"):
    est = estimate_memory(model, tokens, gpt_loss, device="cpu", checkpoint=["Block"], checkpoint_policy=policy)
    results.setdefault("none", [est.scenarios["baseline"].peak_bytes])
    results[policy] = [est.scenarios["checkpoint"].peak_bytes]
for policy in ("none", "save_matmuls", "full"):
    real = copy.deepcopy(model)
    if policy != "none":
        apply_checkpointing(real, "Block", policy=policy)
    results[policy].append(measure_cpu_step(real, tokens, gpt_loss).peak_bytes)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def measured():
    script = _MEASURE.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_real_and_predicted_peaks_order_none_save_matmuls_full(measured):
    for index in (0, 1):  # predicted, measured
        assert measured["none"][index] > measured["save_matmuls"][index] > measured["full"][index], measured
    predicted, real = measured["none"]
    assert abs(predicted - real) <= 0.01 * real


@pytest.mark.parametrize("policy", ["save_matmuls", "full"])
def test_checkpointed_peak_matches_the_real_step_within_one_percent(measured, policy):
    predicted, real = measured[policy]
    assert abs(predicted - real) <= 0.01 * real


# -- an exception the step raises and handles holds no tensors in the trace -----------------------


class _Wide(torch.nn.Module):
    def __init__(self, raises: bool) -> None:
        super().__init__()
        self.raises = raises

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.repeat(1, 64)  # 64 times x's bytes, dead once forward leaves
        if self.raises:
            raise LookupError(wide.shape)
        return wide


class _Catches(torch.nn.Module):
    def __init__(self, raises: bool) -> None:
        super().__init__()
        self.wide = _Wide(raises)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self.wide(x)
        except LookupError:
            pass
        return self.out(x.repeat(1, 32).view(-1, 32, 16).sum(1))


def test_a_handled_exception_does_not_keep_its_frames_tensors_alive_in_the_trace():
    # Checkpoint's early stop raises inside every re-run block: the estimator's failure bookkeeping
    # once held that exception, its traceback's frames, and so the block's recomputed tensors,
    # until the next exception. A real step frees them when the exception is handled.
    def peak(raises):
        torch.manual_seed(0)
        batch = (torch.randn(8, 16),)
        return estimate_memory(_Catches(raises), batch, lambda m, b: m(b[0]).sum(), device="cpu").peak_bytes

    assert peak(raises=True) == peak(raises=False)
