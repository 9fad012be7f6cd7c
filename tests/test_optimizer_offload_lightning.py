"""LightMem(offload_optimizer=True) in a real Trainer on CPU: the whole training state is bitwise
what the same fit gives without lightmem (weights, buffers, optimizer state, RNG), checkpoints
cross over both ways, and what cannot work is refused by name."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from exact import assert_same, assert_state_equal
from optimizer_models import LitTiny, regression_loader

import lightmem.offload.optimizer as optimizer_offload
from lightmem import LightMem
from lightmem.testing.simulated import SimulatedAsyncTransport

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")


def _trainer(callbacks=(), **kwargs):
    defaults = dict(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    defaults.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **defaults)


def _fit(offload: bool, module_kwargs=None, ckpt_path=None, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    module = LitTiny(**(module_kwargs or {}))
    callbacks = [LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])] if offload else []
    trainer = _trainer(callbacks, **trainer_kwargs)
    trainer.fit(module, regression_loader(), ckpt_path=ckpt_path)
    return module, trainer, torch.get_rng_state()


def _assert_same_run(expected, actual):
    (module_a, trainer_a, rng_a), (module_b, trainer_b, rng_b) = expected, actual
    assert_state_equal(module_a, module_b, trainer_a.optimizers[0], trainer_b.optimizers[0])
    assert_same([s.state_dict() for s in trainer_a.lr_scheduler_configs and [c.scheduler for c in trainer_a.lr_scheduler_configs]],
                [s.state_dict() for s in trainer_b.lr_scheduler_configs and [c.scheduler for c in trainer_b.lr_scheduler_configs]], "schedulers")
    assert_same(rng_a, rng_b, "RNG state")


@pytest.fixture(params=["sync", "simulated"])
def transport(request, monkeypatch):
    if request.param == "simulated":
        simulated = SimulatedAsyncTransport(seed=1, max_delay_s=0.001)
        monkeypatch.setattr(optimizer_offload, "default_transport", lambda devices: simulated)
        yield simulated
        assert (simulated.stale_reads, simulated.reuse_hazards) == (0, 0)
        simulated.close()
    else:
        yield None


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw-decay"])
def test_fit_with_accumulation_clipping_and_scheduler_is_bitwise_equal_without_lightmem(optimizer, transport):
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
    expected = _fit(False, {"optimizer": optimizer}, **settings)
    actual = _fit(True, {"optimizer": optimizer}, **settings)
    _assert_same_run(expected, actual)
