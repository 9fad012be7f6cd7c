"""Run by tests/test_callback_metrics.py: DDP with 2 CPU processes (gloo), with and without LightMem."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from exact import assert_state_equal
from lit_models import LitGPT, token_loader
from process_group import leave
from pytorch_lightning.loggers import Logger

from lightmem import LightMem
from lightmem.metrics.names import key


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
    local_rss = [None, None]
    torch.distributed.all_gather_object(local_rss, callback.last_local_metrics[key("host/rss_GiB")])
    if trainer.is_global_zero:
        rows = [(s, m) for s, m in logger.rows if key("host/rss_GiB") in m]
        report = {
            "weights_equal": equal,
            "logged_steps": [s for s, _ in rows],
            "logged_rss_GiB": rows[-1][1][key("host/rss_GiB")],
            "local_rss_GiB": local_rss,
        }
        (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    leave()
