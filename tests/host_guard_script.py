"""Run by tests/test_host_guard_cgroup.py inside a fresh memory cgroup: a fit whose host memory grows.

    python tests/host_guard_script.py CGROUP_DIR {plain,lightmem} WORKERS ROOT_DIR HEADROOM_MIB GROW_MIB

Joins the cgroup first (so everything it allocates is charged), sets the limit to its usage after
the imports plus HEADROOM_MIB, then trains until the limit: each training step (WORKERS=0) or each
item a DataLoader worker loads (WORKERS>0) keeps GROW_MIB more. Prints one ``RESULT {json}`` line
per finished fit; a run killed by the OOM killer prints none.
"""

from __future__ import annotations

import json
import os
import sys

cgroup, mode, workers, root_dir, headroom_mib, grow_mib = sys.argv[1:]
workers, headroom_mib, grow_mib = int(workers), int(headroom_mib), int(grow_mib)
with open(os.path.join(cgroup, "cgroup.procs"), "w") as file:
    file.write(str(os.getpid()))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

from lightmem import LightMem  # noqa: E402

v2 = os.path.exists(os.path.join(cgroup, "memory.max"))
with open(os.path.join(cgroup, "memory.current" if v2 else "memory.usage_in_bytes")) as file:
    baseline = int(file.read())
with open(os.path.join(cgroup, "memory.max" if v2 else "memory.limit_in_bytes"), "w") as file:
    file.write(str(baseline + headroom_mib * 2**20))


class Hoarder(pl.LightningModule):
    def __init__(self, grow_mib: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 1)
        self.grow_mib = grow_mib
        self.hoard: list[torch.Tensor] = []
        self.first_step = None
        self.weight_at_start = None

    def on_train_start(self) -> None:
        self.first_step = self.trainer.global_step
        self.weight_at_start = self.layer.weight.detach().clone()

    def training_step(self, batch, batch_idx):
        if self.grow_mib:
            self.hoard.append(torch.ones(self.grow_mib * 2**18))  # float32: GROW_MIB MiB, touched
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class GrowingData(torch.utils.data.Dataset):
    def __init__(self, grow_mib: int) -> None:
        self.grow_mib = grow_mib
        self.cache: list[torch.Tensor] = []

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.grow_mib:
            self.cache.append(torch.ones(self.grow_mib * 2**18))  # kept in the worker process
        return torch.full((16,), float(index % 7))


def fit(grow: int, max_steps: int, ckpt_path: str | None = None) -> tuple[pl.Trainer, Hoarder]:
    model = Hoarder(0 if workers else grow)
    loader = torch.utils.data.DataLoader(GrowingData(grow if workers else 0), batch_size=1, num_workers=workers)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root_dir,
        callbacks=[LightMem()] if mode == "lightmem" else [],
    )  # fmt: skip
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer, model


trainer, model = fit(grow_mib, max_steps=100_000)
stopped_step = trainer.global_step
model.hoard.clear()
del trainer, model
ckpt = os.path.join(root_dir, "lightmem-host-stop.ckpt")
print("RESULT", json.dumps({"fit": "stopped", "global_step": stopped_step, "ckpt_exists": os.path.exists(ckpt)}), flush=True)
saved_weight = torch.load(ckpt, weights_only=False)["state_dict"]["layer.weight"]
trainer, model = fit(0, max_steps=stopped_step + 3, ckpt_path=ckpt)
print(
    "RESULT",
    json.dumps(
        {
            "fit": "resumed", "first_step": model.first_step, "global_step": trainer.global_step,
            "weights_from_checkpoint": bool(torch.equal(model.weight_at_start, saved_weight)),
        }
    ),
    flush=True,
)  # fmt: skip
