"""Run by tests/test_optimizer_offload_lightning.py: DDP with 2 CPU processes (gloo), the same fit
(AdamW, accumulation 2, clipping by norm, StepLR) without lightmem and with offload_optimizer."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from optimizer_models import HOST_KERNEL, LitTiny, assert_given_back, regression_loader
from process_group import leave

from lightmem import LightMem


def fit(callbacks):
    pl.seed_everything(0, verbose=False)
    module = LitTiny() if callbacks else LitTiny(kernel=HOST_KERNEL)  # the kernel lightmem runs on the host
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=2, gradient_clip_val=0.5,
    )  # fmt: skip
    trainer.fit(module, regression_loader(batches=16))
    return module, trainer


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    baseline, baseline_trainer = fit([])
    callback = LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])
    module, trainer = fit([callback])
    try:
        assert_given_back(baseline, module, baseline_trainer.optimizers[0], trainer.optimizers[0])
        equal = True
    except AssertionError as error:
        equal = str(error)
    # Each rank averaged the other's gradients: the ranks end with the same weights.
    weights = [None, None]
    torch.distributed.all_gather_object(weights, {k: v.tolist() for k, v in module.named_parameters()})
    results = [None, None]
    torch.distributed.all_gather_object(results, [equal, callback.optimizer_offload_stats[0].steps])
    if trainer.is_global_zero:
        report = {"equal_per_rank": [r[0] for r in results], "steps_per_rank": [r[1] for r in results],
                  "ranks_agree": weights[0] == weights[1]}  # fmt: skip
        (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    leave()
