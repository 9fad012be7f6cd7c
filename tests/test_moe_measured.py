"""Mixture-of-experts estimates against real CPU steps measured by torch's MemTracker (issue 57).

Four families (``moe_models``: LitGPT's ``LLaMAMoE``, Hugging Face's Mixtral and Qwen2-MoE on their
eager experts path, a top-k MoE by hand), each with a balanced router (every expert gets tokens x
top-k / experts) and a skewed one (every token to experts 0 and 1), without lightmem and with every
layer checkpointed. The balanced prediction is held against the balanced step and the worst-case
bound against both. A skewed step is measured after a balanced one, as in training: every expert
has its gradients and optimizer state. Measured in a child process (this file run as a script),
as in test_estimate_accuracy.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import moe_models
import pytest

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

CONFIGURATIONS = ("baseline", "checkpoint")
ROUTERS = ("balanced", "skewed")
CASES = [(family, configuration) for family in moe_models.FAMILIES for configuration in CONFIGURATIONS]


@pytest.fixture(scope="module")
def steps() -> dict[str, dict]:
    done = subprocess.run(
        [sys.executable, __file__, "--measure"], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_router_sends_the_tokens_where_it_was_built_to(steps):
    rows = moe_models.BATCH * moe_models.SEQ
    for family in moe_models.FAMILIES:
        counts = steps[family]["routed"]
        assert counts["balanced"] == [[rows * 2 // 4] * 4] * moe_models.LAYERS, family
        assert counts["skewed"] == [[rows, rows, 0, 0]] * moe_models.LAYERS, family


@pytest.mark.parametrize(("family", "configuration"), CASES)
def test_the_balanced_prediction_is_within_five_percent_of_the_balanced_step(steps, family, configuration):
    case = steps[family][configuration]
    measured = case["measured"]["balanced"]
    assert abs(case["predicted"] - measured) <= 0.05 * measured, case


@pytest.mark.parametrize("family", moe_models.FAMILIES)
def test_without_lightmem_the_balanced_prediction_is_the_balanced_step_to_the_byte(steps, family):
    case = steps[family]["baseline"]
    assert case["predicted"] == case["measured"]["balanced"]


@pytest.mark.parametrize("family", moe_models.FAMILIES)
def test_without_lightmem_every_router_peaks_between_the_balanced_prediction_and_the_bound(steps, family):
    """The peak is at the loss, where the activations saved by every expert are alive: their sum
    does not depend on the routing, so the skewed step peaks where the balanced one does."""
    case = steps[family]["baseline"]
    for router in ROUTERS:
        assert case["predicted"] <= case["measured"][router] <= case["bound"], (router, case)
    assert case["measured"]["skewed"] == case["measured"]["balanced"]


@pytest.mark.parametrize("family", moe_models.FAMILIES)
def test_checkpointed_the_bound_holds_for_every_router(steps, family):
    case = steps[family]["checkpoint"]
    for router in ROUTERS:
        assert case["measured"][router] <= case["bound"], (router, case)


@pytest.mark.parametrize("family", ["litgpt", "by_hand"])
def test_checkpointed_a_skewed_router_peaks_above_the_balanced_prediction_at_the_bound(steps, family):
    """Re-run in backward, two experts each take every token: the transient the bound is for. The
    worst case is that step, to the byte."""
    case = steps[family]["checkpoint"]
    assert case["predicted"] < case["measured"]["skewed"] == case["bound"]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_checkpointed_hugging_face_peaks_lower_when_fewer_experts_run(steps, family):
    """Hugging Face's experts keep one weight tensor for all of them: in backward each expert that
    runs makes a gradient the size of the whole tensor (``select_backward``), summed with the others'
    while the experts before it still hold their re-computed rows. Two experts do that fewer times
    than four, so the skewed step peaks under the balanced one; the bound, which runs every expert,
    holds both."""
    case = steps[family]["checkpoint"]
    assert case["measured"]["skewed"] < case["measured"]["balanced"] < case["bound"]


def _measure_child() -> None:
    import torch

    from lightmem import apply_checkpointing, estimate_memory
    from lightmem.testing.measure import measure_cpu_step

    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for family in moe_models.FAMILIES:
        loss_fn = moe_models.loss_fn(family)
        batches = {
            "balanced": moe_models.batch_of(family, moe_models.balanced_ids()),
            "skewed": moe_models.batch_of(family, moe_models.skewed_ids()),
        }
        model = moe_models.build(family)
        routed = {}
        for router, batch in batches.items():
            counts = moe_models.RoutingCounts(model)
            with torch.no_grad():
                loss_fn(model, batch)
            counts.remove()
            routed[router] = counts.counts
        results[family] = {"routed": routed}
        for configuration in CONFIGURATIONS:
            checkpoint = [moe_models.BLOCKS[family]] if configuration == "checkpoint" else None
            estimate = estimate_memory(moe_models.build(family), batches["balanced"], loss_fn, device="cpu", checkpoint=checkpoint)
            measured = {}
            for router, batch in batches.items():
                model = moe_models.build(family)
                if checkpoint:
                    apply_checkpointing(model, checkpoint)
                measured[router] = measure_cpu_step(model, batch, loss_fn, first_batch=batches["balanced"]).peak_bytes
            results[family][configuration] = {
                "predicted": estimate.peak_bytes, "bound": estimate.routing_bound_bytes, "measured": measured,
            }  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__" and sys.argv[1:] == ["--measure"]:
    import warnings

    warnings.simplefilter("ignore")
    _measure_child()
