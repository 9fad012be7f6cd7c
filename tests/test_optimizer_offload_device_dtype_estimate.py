"""The estimator, planner and CLI with offload_optimizer's device_dtype (bf16 parameters on the
device, fp32 masters on the host): the device weights, the gradients in flight and the model
state's bytes over the link are counted in bf16, from the one parsed OptimizerOffloadSettings the
engine reads, and equal what the engine measures."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from examples.estimate_factories import deep_convnet
from lightmem import LightMem, estimate_memory, max_batch_size, offload_optimizer, plan
from lightmem.cli import main
from lightmem.config import OptimizerOffloadSettings

ROOT = os.path.join(os.path.dirname(__file__), "..")
BF16 = OptimizerOffloadSettings.parse(devices=("cpu",), device_dtype="bf16")
MLP_PARAMETERS = 1633


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(32, 16, generator=generator), torch.randn(32, 1, generator=generator)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]).float(), batch[1])


def _engine(device_dtype: torch.dtype | None):
    """Two bf16-mixed steps with the engine on CPU, no accumulation: the model and the offloader."""
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = offload_optimizer(model, optimizer, devices=("cpu",), device_dtype=device_dtype)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, _batch())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, handle


@pytest.mark.parametrize(("option", "device_dtype", "width"), [(True, None, 4), (BF16, torch.bfloat16, 2)])
def test_device_weights_and_link_bytes_are_the_engines(option, device_dtype, width):
    estimate = estimate_memory(
        _mlp(), _batch(), _loss, optimizer="adamw", precision="bf16-mixed", device="cpu", offload_optimizer=option
    )
    offloaded = estimate.scenarios["offload_optimizer"]
    model, handle = _engine(device_dtype)
    stats = handle.stats
    # The device parameters after offload started, in bytes: fp32, or halved in bf16.
    assert offloaded.breakdown["parameters"] == sum(p.nbytes for p in model.parameters()) == MLP_PARAMETERS * width
    # Per step: each gradient out and each parameter back, in the device's dtype.
    assert offloaded.model_state_link_bytes == stats.grad_bytes_out + stats.param_bytes_in == 2 * MLP_PARAMETERS * width
    # Host: the masters (fp32) and with bf16 their bf16 copies, as many bytes again for the gradient
    # buffers, and the optimizer state in fp32 (the engine's arenas add 64-byte alignment on top).
    copies = MLP_PARAMETERS * 4 + (MLP_PARAMETERS * 2 if device_dtype is not None else 0)
    assert offloaded.host_bytes == 2 * copies + stats.host_state_bytes
    assert estimate.offload_optimizer_device_dtype == ("bf16" if device_dtype is not None else None)
    handle.close()


def test_gradients_in_flight_are_bf16():
    """Two 1024x1024 layers at batch 1: the peak is in backward, with the second layer's gradients
    made and waiting for their copy to host (within the 64 MiB bound); in bf16 those bytes halve."""
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    batch = torch.randn(1, 1024)
    breakdowns = [
        estimate_memory(
            model, batch, lambda m, x: m(x).float().mean(), device="cpu", precision="bf16-mixed",
            offload_optimizer=option,
        ).scenarios["offload_optimizer"].breakdown
        for option in (True, BF16)
    ]  # fmt: skip
    layer = 1024 * 1024 + 1024
    assert [b["parameters"] for b in breakdowns] == [2 * layer * 4, 2 * layer * 2]
    assert [b["gradients"] for b in breakdowns] == [layer * 4, layer * 2]


def test_the_report_says_so():
    estimate = estimate_memory(_mlp(), _batch(), _loss, precision="bf16-mixed", device="cpu", offload_optimizer=BF16)
    assert estimate.to_dict()["offload_optimizer_device_dtype"] == "bf16"
    assert estimate.to_dict()["scenarios"]["offload_optimizer"]["model_state_link_bytes"] == 4 * MLP_PARAMETERS
    text = estimate.to_text()
    assert text.splitlines()[0].endswith(
        "; with offload_optimizer: bf16 parameters and gradients on the device, fp32 masters on the host"
    )
    assert "model state over the link per step" in text


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "16-mixed"])
def test_other_precisions_are_refused_as_a_fit_refuses_them(precision):
    with pytest.raises(ValueError) as error:
        estimate_memory(_mlp(), _batch(), _loss, precision=precision, device="cpu", offload_optimizer=BF16)
    assert str(error.value) == (
        "offload_optimizer(device_dtype=...): needs precision='bf16-mixed' (the forward runs under bf16 "
        f"autocast on bf16 parameters); got precision={precision!r}"
    )


# -- the seed-002 conv net (206,538,153 parameters) on a card where only bf16 weights leave room --

PARAMETER_BYTES = 206_538_153 * 4
CARD = dict(optimizer="adamw", precision="bf16-mixed", overhead_bytes="400MiB")


@pytest.fixture(scope="module")
def seed_case():
    return deep_convnet(1)


def test_a_plan_fits_only_thanks_to_the_halved_weights(seed_case, monkeypatch):
    """1.2 GB with a 400 MiB allowance leaves 744 MiB: the fp32 parameters (788 MiB) alone exceed
    it; in bf16 (394 MiB) the step fits, as the allocator reserves it with expandable segments (which
    ``plan="auto"`` turns on). The settings are LightMem's, parsed once, as ``plan="auto"`` hands
    them to the planner."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    model, batch, loss_fn = seed_case
    settings = LightMem(plan="auto", offload_optimizer=True, offload_optimizer_device_dtype="bf16").settings
    fp32 = plan(model, batch, "1.2GB", loss_fn, offload_optimizer=True, **CARD)
    assert not fp32.fits and fp32.reason.startswith(
        "the parameters (787.88 MiB) and cuBLAS workspaces (16.25 MiB) alone take 804.13 MiB, over the 744.41 MiB "
        "the 1.12 GiB budget leaves"
    )
    found = plan(model, batch, "1.2GB", loss_fn, offload_optimizer=settings.optimizer_offload, **CARD)
    assert found.fits and found.offload_optimizer_device_dtype == "bf16"
    # The kwargs give back the flags it was verified with.
    assert found.lightmem_kwargs() == {
        "offload": False, "offload_optimizer": True, "offload_optimizer_device_dtype": "bf16"
    }  # fmt: skip
    assert found.settings["offload_optimizer_device_dtype"] == "bf16"
    # The link time: half of fp32's 2 x 826 MB, at the default 25 GB/s.
    assert found.exposed_transfer_s == PARAMETER_BYTES / 25e9
    assert found.parts() == ["offload_optimizer (gradients and optimizer state on the host, bf16 parameters on the device)"]
    estimate = estimate_memory(
        model, batch, loss_fn, budget="1.2GB", offload_optimizer=settings.optimizer_offload, **CARD
    )
    # The device weights: each bf16 parameter in its 512-byte allocator blocks.
    bf16_blocks = sum(-(-p.numel() * 2 // 512) * 512 for p in model.parameters())
    assert estimate.scenarios["offload_optimizer"].breakdown["parameters"] == bf16_blocks == 413_078_528
    assert estimate.static_bytes == bf16_blocks + estimate.scenarios["baseline"].breakdown["workspaces"]
    assert estimate.fits and found.predicted_peak_bytes == estimate.scenarios["offload_optimizer"].peak_bytes


def test_the_advice_without_it_names_it_first(seed_case):
    model, batch, loss_fn = seed_case
    estimate = estimate_memory(model, batch, loss_fn, budget="1.2GB", offload_optimizer=True, **CARD)
    (message,) = [item.message for item in estimate.advice if item.rule == "static-exceeds-budget"]
    assert "Options: bf16 parameters on the device with fp32 masters on the host (LightMem(offload_optimizer_device_dtype='bf16') under precision='bf16-mixed'), which halves them;" in message


def test_max_batch_size_plans_with_it(seed_case):
    model, batch, loss_fn = seed_case
    search = max_batch_size(
        model, batch, "1.2GB", loss_fn, offload_optimizer=BF16, plan=True, limit=64, **CARD
    )  # fmt: skip
    assert search.configured is not None and search.configured >= 1
    assert search.plan is not None and search.plan.lightmem_kwargs()["offload_optimizer_device_dtype"] == "bf16"


# -- the CLI ----------------------------------------------------------------------------------


def _cli(*flags: str) -> list[str]:
    return [
        "estimate", "examples.estimate_factories:deep_convnet", "--batch-size", "1", "--budget", "1.2GB",
        "--overhead", "400MiB", "--optimizer", "adamw", *flags,
    ]  # fmt: skip


def test_the_cli_flag(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    flags = ("--precision", "bf16-mixed", "--offload-optimizer", "--offload-optimizer-device-dtype", "bf16")
    status = main(_cli(*flags, "--plan", "--json"))
    output = json.loads(capsys.readouterr().out)
    assert status == 0
    estimate = output["estimate"]
    assert (estimate["offload_optimizer_device_dtype"], estimate["fits"]) == ("bf16", True)
    offloaded = estimate["scenarios"]["offload_optimizer"]
    assert offloaded["breakdown"]["parameters"] == 413_078_528
    assert offloaded["model_state_link_bytes"] == PARAMETER_BYTES  # 2 x the bf16 bytes
    assert output["plan"]["lightmem_kwargs"] == {
        "offload": False, "offload_optimizer": True, "offload_optimizer_device_dtype": "bf16"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--precision", "bf16-mixed", "--offload-optimizer-device-dtype", "bf16"),
            "--offload-optimizer-device-dtype: has no effect without --offload-optimizer; add --offload-optimizer "
            "or leave --offload-optimizer-device-dtype unset",
        ),
        (
            ("--precision", "bf16-mixed", "--offload-optimizer", "--offload-optimizer-device-dtype", "fp16"),
            "--offload-optimizer-device-dtype: expected None, 'bf16' or torch.bfloat16; got 'fp16'",
        ),
        (
            ("--offload-optimizer", "--offload-optimizer-device-dtype", "bf16"),
            "--offload-optimizer-device-dtype: needs precision='bf16-mixed' (the forward runs under bf16 "
            "autocast on bf16 parameters); got precision='32-true'",
        ),
    ],
)
def test_the_cli_flag_is_validated_before_any_tracing(capsys, monkeypatch, flags, message):
    monkeypatch.chdir(ROOT)
    assert main(_cli(*flags)) == 2
    assert capsys.readouterr().err == f"lightmem estimate: error: {message}\n"


# -- LightMem(plan="auto") ----------------------------------------------------------------------


def test_plan_auto_plans_with_the_bf16_device_weights(lightning_package):
    """A bf16-mixed fit with plan="auto": the planner gets the callback's parsed settings, so its
    plan counts the device weights and link bytes in bf16 and gives the flag back in its kwargs."""
    from lit_models import cpu_trainer
    from torch.utils.data import DataLoader, TensorDataset

    class LitMLP(lightning_package.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            return _loss(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    callback = LightMem(
        plan="auto", device_budget="1MiB", offload_devices=["cpu"], offload_optimizer=True,
        offload_optimizer_device_dtype="bf16", metrics=[],
    )  # fmt: skip
    inputs, targets = _batch()
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=32)
    cpu_trainer([callback], package=lightning_package, max_steps=2, precision="bf16-mixed").fit(LitMLP(), loader)
    chosen = callback.chosen_plan
    assert chosen.fits and chosen.lightmem_kwargs() == {
        "offload": False, "offload_optimizer": True, "offload_optimizer_device_dtype": "bf16"
    }  # fmt: skip
    offloaded = chosen.estimate.scenarios["offload_optimizer"]
    (stats,) = callback.optimizer_offload_stats
    assert offloaded.breakdown["parameters"] == MLP_PARAMETERS * 2
    assert offloaded.model_state_link_bytes == stats.grad_bytes_out + stats.param_bytes_in == 4 * MLP_PARAMETERS
    assert chosen.exposed_transfer_s == 4 * MLP_PARAMETERS / chosen.speeds.link_bytes_per_s
    # The engine had cast the device parameters to bf16 before the plan: the baseline (no lightmem)
    # still counts them in fp32, as a fit without lightmem holds them.
    assert chosen.estimate.scenarios["baseline"].breakdown["parameters"] == MLP_PARAMETERS * 4


def test_a_plan_names_the_bf16_parameters_when_even_they_exceed_the_budget(seed_case):
    model, batch, loss_fn = seed_case
    found = plan(model, batch, "800MB", loss_fn, offload_optimizer=BF16, **CARD)
    # 394 MiB of bf16 weights (allocator-rounded) and the 16.25 MiB cuBLAS workspace.
    assert not found.fits and found.reason.startswith(
        "the bf16 parameters (393.94 MiB) and cuBLAS workspaces (16.25 MiB) alone take 410.19 MiB, over the 362.94 MiB "
        "the 762.94 MiB budget leaves"
    )
