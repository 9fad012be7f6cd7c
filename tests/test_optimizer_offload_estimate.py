"""The estimator, planner, batch search and CLI with offload_optimizer, on the seed-002 case: a
206,538,153-parameter conv net (a user's Keras model, in PyTorch) at batch 1 and 16x16 on a 2 GB
card with about 1.8 GB usable and a 400 MiB CUDA overhead allowance."""

from __future__ import annotations

import json
import os

import pytest

from examples.estimate_factories import deep_convnet
from lightmem import estimate_memory, max_batch_size, plan
from lightmem.cli import main

ROOT = os.path.join(os.path.dirname(__file__), "..")
CARD = dict(device="cuda", budget="1.8GB", overhead_bytes="400MiB")
PARAMETER_BYTES = 206_538_153 * 4
PARAMETER_TENSORS = 56  # 26 convolutions and 2 linear layers, weight and bias each


@pytest.fixture(scope="module")
def seed_case():
    model, batch, loss_fn = deep_convnet(1)
    assert sum(p.numel() for p in model.parameters()) == 206_538_153
    return model, batch, loss_fn


@pytest.mark.parametrize(("optimizer", "state_bytes"), [("sgd", 0), ("adamw", 2 * PARAMETER_BYTES + PARAMETER_TENSORS * 4)])
def test_seed_002_does_not_fit_without_the_option_and_fits_with_it(seed_case, optimizer, state_bytes):
    model, batch, loss_fn = seed_case
    without = estimate_memory(model, batch, loss_fn, optimizer=optimizer, **CARD)
    with_it = estimate_memory(model, batch, loss_fn, optimizer=optimizer, offload_optimizer=True, **CARD)
    assert (without.fits, with_it.fits) == (False, True)
    assert list(with_it.scenarios) == ["baseline", "offload_optimizer"]
    offloaded = with_it.scenarios["offload_optimizer"]
    assert offloaded.breakdown["optimizer_state"] == 0
    # Gradients wait on the device only within the 64 MiB in-flight bound (plus the one being made).
    assert offloaded.breakdown["gradients"] <= 64 * 2**20 + 1024 * 1024 * 9 * 4
    # On the host: a copy of every parameter, its gradient, the optimizer state (fp32 step counters).
    assert offloaded.host_bytes == 2 * PARAMETER_BYTES + state_bytes


def test_seed_002_advice_names_the_flag(seed_case):
    model, batch, loss_fn = seed_case
    estimate = estimate_memory(model, batch, loss_fn, optimizer="sgd", **CARD)
    (message,) = [item.message for item in estimate.advice if item.rule == "static-exceeds-budget"]
    assert "Options: LightMem(offload_optimizer=True) (lightmem.offload_optimizer in plain PyTorch) keeps only the parameters (787.88 MiB) on the device" in message


def test_plan_turns_the_option_on_when_model_state_exceeds_the_budget(seed_case):
    model, batch, loss_fn = seed_case
    found = plan(model, batch, "1.8GB", loss_fn, optimizer="adamw", overhead_bytes="400MiB")
    assert found.fits and found.offload_optimizer
    assert found.lightmem_kwargs() == {"offload": False, "offload_optimizer": True}
    # The link time: 826 MB of gradients out and of parameters back at the default 25 GB/s (the
    # tensors' bytes, as the engine's grad_bytes_out and param_bytes_in count them: no allocator rounding).
    assert found.exposed_transfer_s == 2 * PARAMETER_BYTES / 25e9
    # 887.45 MiB allocated: the parameters, the gradients waiting for their copy, and the 16.25 MiB
    # cuBLAS workspace; 910 MiB reserved (the step replayed through the caching allocator, without
    # expandable segments), 1.28 GiB with the 400 MiB allowance.
    assert found.predicted_peak_bytes == 930_567_680 and found.predicted_total_bytes == 954_204_160 + (400 << 20)
    assert found.describe() == (
        "Fits 1.68 GiB at 1.28 GiB: offload_optimizer (gradients and optimizer state on the host), holding 3.08 GiB "
        "(model state 3.08 GiB) of host memory; predicted step 70.1 ms, 4.95x the 14.2 ms without lightmem (about 0 s re-computation and 66.1 ms exposed transfer; "
        f"{found.speeds.describe()}): the only configuration verified to fit."
    )


def test_max_batch_size_with_the_option(seed_case):
    model, batch, loss_fn = seed_case
    search = max_batch_size(model, batch, "1.8GB", loss_fn, optimizer="sgd", overhead_bytes="400MiB", offload_optimizer=True)
    # Without the option not even one image fits; with it, the largest batch is 192 (what the
    # allocator reserves for it, replayed without expandable segments).
    assert (search.baseline, search.configured) == (0, 192)


def test_the_cli_flag(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    status = main([
        "estimate", "examples.estimate_factories:deep_convnet", "--batch-size", "1", "--budget", "1.8GB",
        "--overhead", "400MiB", "--optimizer", "sgd", "--offload-optimizer", "--plan", "--json",
    ])  # fmt: skip
    output = json.loads(capsys.readouterr().out)
    assert status == 0
    estimate = output["estimate"]
    assert (estimate["offload_optimizer"], estimate["fits"], list(estimate["scenarios"])) == (
        True, True, ["baseline", "offload_optimizer"]
    )
    assert output["plan"]["lightmem_kwargs"] == {"offload": False, "offload_optimizer": True}
    assert output["plan"]["settings"]["offload_optimizer"] is True


def test_the_option_takes_only_a_bool(seed_case):
    model, batch, loss_fn = seed_case
    with pytest.raises(ValueError) as error:
        estimate_memory(model, batch, loss_fn, offload_optimizer="yes")
    assert str(error.value) == "estimate_memory(offload_optimizer=...): expected True or False; got 'yes'"


def test_plan_walks_its_space_with_model_state_on_the_host():
    """At batch 256 the model-state baseline (1.34 GiB with SGD) still leaves activations over the
    budget: the planner's walks run with offload_optimizer and plan activations on top of it."""
    model, batch, loss_fn = deep_convnet(256)
    found = plan(model, batch, "1.8GB", loss_fn, optimizer="sgd", overhead_bytes="400MiB", offload_optimizer=True)
    assert (found.fits, found.offload_optimizer, found.family) == (True, True, "offload")
    offloaded = [str(n) for n in (2, *range(5, 16))]
    assert found.lightmem_kwargs() == {
        "offload": True, "offload_min_bytes": 1 << 20, "offload_include": offloaded, "offload_optimizer": True,
        "prefetch_bytes": 16 << 20, "offload_max_inflight_bytes": 16 << 20,
    }  # fmt: skip
    assert found.parts()[0] == "offload_optimizer (gradients and optimizer state on the host)"
    # The verified peak is the chosen configuration's step with model-state offload.
    estimate = estimate_memory(
        model, batch, loss_fn, optimizer="sgd", offload=found.offload, checkpoint=found.checkpoint or None,
        offload_optimizer=True, **CARD,
    )  # fmt: skip
    assert found.predicted_peak_bytes == estimate.scenarios["offload+offload_optimizer"].peak_bytes == 1_272_632_320
    # The per-block offload's transfer hides behind compute; the model state's link time does not.
    model_state_s = 2 * PARAMETER_BYTES / 25e9  # the parameters' bytes out and back, as the engine moves them
    assert found.exposed_transfer_s == pytest.approx(model_state_s, rel=1e-12)


def test_max_batch_size_plans_with_the_option(seed_case):
    model, batch, loss_fn = seed_case
    search = max_batch_size(
        model, batch, "2.5GB", loss_fn, optimizer="sgd", overhead_bytes="400MiB", offload_optimizer=True, plan=True,
        limit=4096,
    )  # fmt: skip
    # Each size is asked of the planner's space at that size, and where none of its extremes fits,
    # of its plan: offloading every saved tensor holds more in flight than offloading most.
    assert (search.baseline, search.configured, search.planned) == (160, 512, 1264)
    assert search.plan is not None and search.plan.fits
    assert search.plan.lightmem_kwargs() == {
        "offload": True, "offload_min_bytes": 1 << 20, "offload_include": [str(n) for n in (2, *range(4, 26))],
        "offload_optimizer": True, "prefetch_bytes": 80 << 20, "offload_max_inflight_bytes": 80 << 20,
    }  # fmt: skip
