"""LightMem in the corners of Lightning that its own test suite exercises: no logging at all
(``log_every_n_steps=0``, ``barebones=True``), and steps numbered as Lightning numbers them."""

from __future__ import annotations

import logging
from csv import DictReader
from pathlib import Path

import pytest
import torch
from exact import assert_state_equal
from lit_models import lit_gpt_class, token_loader

from lightmem import LightMem
from lightmem.checkpoint import is_checkpointed
from lightmem.lightning_packages import lightning_logs_this_step
from lightmem.metrics.recorder import SUMMARY_TITLE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::Warning")


def _cpu_lightmem(**kwargs):
    return LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"], **kwargs)


def _fit(package, callbacks, max_steps=5, **trainer_kwargs):
    package.seed_everything(0, verbose=False)
    module = lit_gpt_class(package)()
    trainer_kwargs.setdefault("enable_progress_bar", False)
    trainer = package.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, token_loader())
    return module, trainer


def _csv_steps(logger, key_prefix):
    """The step column of the CSV rows holding a column that starts with ``key_prefix``."""
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = list(DictReader(file))
    return [int(row["step"]) for row in rows if any(k.startswith(key_prefix) and row[k] != "" for k in row)]


@pytest.mark.parametrize(
    ("trainer_kwargs", "lightning_steps"),
    [
        ({"log_every_n_steps": 2}, [1, 3]),
        ({"log_every_n_steps": 1}, [0, 1, 2, 3, 4]),
        ({"log_every_n_steps": 1, "accumulate_grad_batches": 2}, [0, 1]),
    ],
    ids=["every-2", "every-1", "accumulation"],
)
def test_metrics_are_logged_at_lightnings_steps_on_the_steps_it_logs(
    tmp_path, lightning_package, trainer_kwargs, lightning_steps
):
    csv = lightning_package.loggers.CSVLogger(tmp_path, name="csv")
    max_steps = 2 if "accumulate_grad_batches" in trainer_kwargs else 5
    _fit(lightning_package, [_cpu_lightmem()], max_steps=max_steps, logger=csv, **trainer_kwargs)
    assert _csv_steps(csv, "loss") == lightning_steps  # the LightningModule's self.log("loss", ...)
    assert _csv_steps(csv, "lightmem/memory/") == lightning_steps


def test_lightmems_own_interval_logs_from_the_first_step_at_lightnings_step_values(tmp_path, lightning_package):
    csv = lightning_package.loggers.CSVLogger(tmp_path, name="csv")
    _fit(lightning_package, [_cpu_lightmem(log_every_n_steps=2)], logger=csv, log_every_n_steps=1)
    assert _csv_steps(csv, "loss") == [0, 1, 2, 3, 4]
    assert _csv_steps(csv, "lightmem/memory/") == [0, 2, 4]  # optimizer steps 1, 3 and 5


def test_trainer_log_every_n_steps_0_logs_no_step_metrics_and_trains_exactly(tmp_path, lightning_package):
    expected = _fit(lightning_package, [], logger=False, log_every_n_steps=0)
    csv = lightning_package.loggers.CSVLogger(tmp_path, name="csv")
    callback = _cpu_lightmem()
    actual = _fit(lightning_package, [callback], logger=csv, log_every_n_steps=0)
    assert _csv_steps(csv, "lightmem/memory/") == []
    assert _csv_steps(csv, "lightmem/summary/") == [5]  # once, at the end, as Lightning's epoch-end metrics
    assert callback.summary()["blocks checkpointed"] == "3"
    assert_state_equal(expected[0], actual[0], expected[1].optimizers[0], actual[1].optimizers[0])


def test_barebones_trainer_keeps_offload_and_checkpointing_and_reports_nothing(lightning_package, caplog):
    expected = _fit(lightning_package, [], barebones=True, enable_progress_bar=None)
    callback = _cpu_lightmem()
    seen = {}

    class Spy(lightning_package.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["checkpointed"] = [is_checkpointed(block) for block in pl_module.model.blocks]
            seen["offloaded_bytes"] = callback.fit_session.offloader.stats.offloaded_bytes

    with caplog.at_level(logging.INFO):
        actual = _fit(lightning_package, [callback, Spy()], barebones=True, enable_progress_bar=None)
    assert seen["checkpointed"] == [True, True, True] and seen["offloaded_bytes"] > 0
    assert callback.summary() == {} and callback.last_metrics == {}
    messages = [record.getMessage() for record in caplog.records]
    assert not [message for message in messages if message.startswith(SUMMARY_TITLE)]
    assert [message for message in messages if message.startswith("lightmem:")] == [
        "lightmem: on: activation offload (tensors from 0 B); checkpointing 3 blocks (model.blocks.0, "
        "model.blocks.1, model.blocks.2). Off: gpu, device, host and lightmem metrics (Trainer(barebones=True))."
    ]
    assert_state_equal(expected[0], actual[0], expected[1].optimizers[0], actual[1].optimizers[0])
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_whether_a_step_is_logged_never_depends_on_the_trainer_stopping(lightning_package):
    # Lightning's logger connector also logs the step a Trainer stops at, but one rank may set
    # should_stop alone (the host guard, a user's callback): a rank that logged then would wait in the
    # all-reduce of the max over ranks for ranks that did not. Every rank decides alike.
    trainer = lightning_package.Trainer(accelerator="cpu", devices=1, log_every_n_steps=2, logger=False)
    trainer.training = True  # the fit loop is the active loop, as in on_train_batch_end
    decisions = {}
    for batches_that_stepped in range(4):
        trainer.fit_loop.epoch_loop._batches_that_stepped = batches_that_stepped
        for stopping in (False, True):
            trainer.should_stop = stopping
            decisions[batches_that_stepped, stopping] = lightning_logs_this_step(trainer)
    assert decisions == {(k, stopping): k % 2 == 1 for k in range(4) for stopping in (False, True)}
    fast = lightning_package.Trainer(accelerator="cpu", devices=1, fast_dev_run=2, logger=False, log_every_n_steps=0)
    fast.training = True
    assert lightning_logs_this_step(fast) is True  # fast_dev_run logs every step, as Lightning does
    never = lightning_package.Trainer(accelerator="cpu", devices=1, log_every_n_steps=0, logger=False)
    never.training, never.should_stop = True, True
    assert lightning_logs_this_step(never) is False
