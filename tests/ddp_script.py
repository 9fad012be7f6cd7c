"""Run by tests/test_callback_metrics.py: DDP with 2 CPU processes (gloo), without LightMem, with it,
and with ``LightMem(plan="auto")`` (a given device_budget, on a simulated device so the plan's
peaks are logged too)."""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import lightning_utilities.core.rank_zero
import pytorch_lightning as pl
import torch
from exact import assert_state_equal
from lit_models import LitGPT, token_loader
from process_group import leave
from pytorch_lightning.loggers import Logger

from lightmem import LightMem
from lightmem.metrics.names import key
from lightmem.testing.device import simulated_device

BUDGET = 4_496_356  # as in test_callback_auto_plan.py: a 4 x 33 batch needs one checkpointed block


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows = []

    name = "memory"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


class Lines(logging.Handler):
    """The lines LightMem writes through Lightning's rank-zero logging, on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.lines = []

    def emit(self, record):
        if record.getMessage().startswith("lightmem: "):
            self.lines.append(record.getMessage())


def fit(callbacks, logger):
    pl.seed_everything(0, verbose=False)
    module = LitGPT()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=logger, callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, token_loader(batches=8))
    return module, trainer


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    baseline, baseline_trainer = fit([], False)
    logger = MemoryLogger()
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"], log_every_n_steps=1)
    module, trainer = fit([callback], logger)
    try:  # the whole state_dict and the optimizer state
        assert_state_equal(baseline, module, baseline_trainer.optimizers[0], trainer.optimizers[0])
        equal = True
    except AssertionError:
        equal = False
    planned_logger, lines = MemoryLogger(), Lines()
    # rank_zero_info's logger: set by the Lightning package imported last (lightning.pytorch here)
    rank_zero_log = lightning_utilities.core.rank_zero.log
    rank_zero_log.addHandler(lines)
    rank_zero_log.setLevel(logging.INFO)
    planned = LightMem(plan="auto", device_budget=BUDGET, offload_devices=["cpu"], log_every_n_steps=1)
    with simulated_device(2 * BUDGET):
        planned_module, planned_trainer = fit([planned], planned_logger)
    final = LightMem(**planned.chosen_plan.lightmem_kwargs(), offload_devices=["cpu"])
    final_module, final_trainer = fit([final], False)
    try:
        assert_state_equal(final_module, planned_module, final_trainer.optimizers[0], planned_trainer.optimizers[0])
        planned_equal = True
    except AssertionError:
        planned_equal = False
    ranks = [None, None]
    plan_lines = [line for line in lines.lines if line.startswith("lightmem: plan for")]
    torch.distributed.all_gather_object(ranks, {"checkpoint": planned.chosen_plan.checkpoint, "plan_lines": plan_lines})
    local_rss = [None, None]
    torch.distributed.all_gather_object(local_rss, callback.last_local_metrics[key("host/rss_GiB")])
    if trainer.is_global_zero:
        rows = [(s, m) for s, m in logger.rows if key("host/rss_GiB") in m]
        report = {
            "weights_equal": equal,
            "logged_steps": [s for s, _ in rows],
            "logged_rss_GiB": rows[-1][1][key("host/rss_GiB")],
            "local_rss_GiB": local_rss,
            "planned": ranks,
            "planned_equal": planned_equal,
            "planned_logged": {
                name: [m[key(name)] for _, m in planned_logger.rows if key(name) in m]
                for name in ("offload/offloaded_GiB", "plan/predicted_peak_GiB", "plan/measured_peak_GiB")
            },
        }
        (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    leave()
