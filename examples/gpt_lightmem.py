"""The main example: a GPT-like model trained with LightMem and TensorBoard panels.

    python examples/gpt_lightmem.py
    tensorboard --logdir runs          # then open the "Custom Scalars" tab

On a GPU, saved activations of at least 1 MiB go to pinned host memory and every second block is
recomputed in backward. On a CPU-only machine the same path runs with host-to-host copies
(``offload_devices=["cpu"]``), so the metrics and panels can be seen anywhere.
"""

from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

sys.path.insert(0, os.path.dirname(__file__))
from gpt_model import GPT, CountingData

from lightmem import LightMem


def main() -> None:
    pl.seed_everything(0)
    on_gpu = torch.cuda.is_available()
    lightmem = LightMem(
        offload_min_bytes="1MiB",
        offload_exclude=["lm_head"],
        offload_devices=["cuda"] if on_gpu else ["cpu"],
        host_budget="8GiB",
        checkpoint=["Block"],
        checkpoint_every=2,
        log_every_n_steps=5,
    )
    trainer = pl.Trainer(
        max_steps=int(os.environ.get("LIGHTMEM_EXAMPLE_STEPS", "40")),
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        precision="bf16-mixed" if on_gpu else "32-true",
        callbacks=[lightmem],
        logger=TensorBoardLogger("runs", name="gpt_lightmem"),
        log_every_n_steps=5,
        val_check_interval=20,
        limit_val_batches=4,
        enable_model_summary=False,
    )
    trainer.fit(GPT(dim=192, depth=6, seq=64), CountingData(seq=64))
    print(f"TensorBoard logs: {trainer.logger.log_dir}  (tensorboard --logdir runs, tab 'Custom Scalars')")


if __name__ == "__main__":
    main()
