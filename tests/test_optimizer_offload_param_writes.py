"""Writes to the device parameters made outside lightmem (WGAN's weight clipping after each step, a
layer re-initialised mid-training, ``param.data`` replaced) are taken into the host copies the
optimizer steps before its next step: the whole training state stays bitwise that of the same
loop without lightmem, instead of the next step writing over them."""

from __future__ import annotations

import pytest
import torch
from exact import assert_same
from lit_models import cpu_trainer
from optimizer_models import (
    HOST_KERNEL,
    LitTiny,
    assert_given_back,
    assert_no_hazards_then_close,
    regression_batches,
    regression_loader,
    tiny_net,
)
from torch import nn

from lightmem import LightMem, offload_optimizer
from lightmem.testing.simulated import SimulatedAsyncTransport

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning"
)


def _clamp_weights(model):
    with torch.no_grad():
        for param in model.parameters():
            param.clamp_(-0.05, 0.05)  # WGAN's weight clipping, after each step


def _reinit_last(model):
    model[-1].reset_parameters()


def _replace_first(model):
    model[0].weight.data = torch.full_like(model[0].weight, 0.01)


WRITES = {"clamp-after-each-step": _clamp_weights, "reinit-a-layer": _reinit_last, "replace-data": _replace_first}


def _train(write, offload=None, steps=4, transport=None, overlap_step=False):
    torch.manual_seed(0)
    model = tiny_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, **({} if offload else HOST_KERNEL))
    handle = (
        offload_optimizer(model, optimizer, devices=("cpu",), transport=transport, overlap_step=overlap_step)
        if offload
        else None
    )
    torch.manual_seed(2)  # dropout
    for step, (inputs, targets) in enumerate(regression_batches(steps)):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        if write is _clamp_weights or step == 1:
            write(model)
    return model, optimizer, handle


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("mode", ["sync", "simulated", "overlap"])
def test_a_write_to_the_device_parameters_is_kept(write, mode):
    transport = SimulatedAsyncTransport(seed=4, max_delay_s=0.001) if mode == "simulated" else None
    model_a, opt_a, _ = _train(WRITES[write])
    model_b, opt_b, handle = _train(WRITES[write], offload=True, transport=transport, overlap_step=mode == "overlap")
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert_no_hazards_then_close(transport)


def test_with_bf16_device_parameters_a_write_reaches_the_masters_and_the_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    handle = offload_optimizer(model, optimizer, devices=("cpu",), device_dtype=torch.bfloat16)
    with torch.no_grad():
        model[1].weight.fill_(0.25)  # exact in bf16
    assert torch.equal(model.state_dict()["1.weight"], torch.full((1, 4), 0.25))  # the fp32 master took it
    handle.close()
    assert torch.equal(model[1].weight, torch.full((1, 4), 0.25)) and model[1].weight.dtype == torch.float32


class _ClampsAfterEachBatch(LitTiny):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        _clamp_weights(self.net)


def _fit(callbacks):
    import pytorch_lightning as pl

    pl.seed_everything(0, verbose=False)
    module = _ClampsAfterEachBatch(kernel=None if callbacks else HOST_KERNEL)
    trainer = cpu_trainer(callbacks)
    trainer.fit(module, regression_loader())
    return module, trainer


@pytest.mark.parametrize("overlap", [False, "auto"])
def test_under_lightning_weights_clamped_after_each_batch_stay_clamped(overlap):
    module_a, trainer_a = _fit([])
    callback = LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[], offload_overlap_step=overlap)
    module_b, trainer_b = _fit([callback])
    assert_given_back(module_a, module_b, trainer_a.optimizers[0], trainer_b.optimizers[0])
    assert_same(
        [param.abs().max() <= 0.05 for param in module_b.parameters()], [torch.tensor(True)] * 6, "clamped weights"
    )


def test_with_the_overlap_a_write_to_a_parameter_without_a_gradient_waits_for_the_next_step():
    # Only parameters with a gradient are copied back after a step: a write to another one between
    # backward and the step is taken at the next backward, as without lightmem.
    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 1), nn.Linear(3, 3))  # the last one unused
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, **({} if offload else HOST_KERNEL))
        handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True) if offload else None
        for inputs, targets in regression_batches(3):
            nn.functional.mse_loss(model[1](model[0](inputs)), targets).backward()
            with torch.no_grad():
                model[2].weight.mul_(0.5)
            optimizer.step()
            optimizer.zero_grad()
        if handle is not None:
            handle.close()
        runs.append(model.state_dict())
    assert_same(*runs, "state_dict")
