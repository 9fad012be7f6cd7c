"""lightmem on a machine without a GPU: the three fits a newcomer tries, each set to do its job there.

    pip install transformers          # the model: a 2-layer GPT-2 built from its config, nothing downloaded
    python examples/newcomer_cpu.py

A CPU has no GPU memory to save, so by default both offloads are off there and the line at fit start
says why. ``offload_devices=["cpu"]`` runs them anyway (host-to-host copies: to see them work, not to
save memory); ``plan="auto"`` has no GPU to measure, so it plans checkpointing for the
``device_budget`` you give, with a CPU's step prices. Each fit then prints what it did.
"""

from __future__ import annotations

import os

import pytorch_lightning as pl
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from lightmem import LightMem, estimate_memory
from lightmem.config import format_bytes

STEPS = int(os.environ.get("LIGHTMEM_EXAMPLE_STEPS", "4"))
BATCH, SEQUENCE, VOCABULARY = 8, 64, 1000


class TinyGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCABULARY, n_positions=SEQUENCE)
        config.bos_token_id = config.eos_token_id = 0
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens() -> DataLoader:
    data = torch.randint(0, VOCABULARY, (BATCH * STEPS, SEQUENCE), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=BATCH)


def fit(callback: LightMem) -> TinyGPT2:
    pl.seed_everything(0, verbose=False)
    module = TinyGPT2()
    trainer = pl.Trainer(
        callbacks=[callback], accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, tokens())
    return module


def main() -> None:
    transformers.logging.set_verbosity_error()

    print("\n== 1. LightMem(offload_devices=['cpu']): activation offload, run on the CPU")
    activations = LightMem(offload_devices=["cpu"])
    fit(activations)
    moved = activations.summary()["offloaded per step"]
    print(f"activation offload: {moved} of saved activations went to host buffers and back, per step")

    print("\n== 2. LightMem(plan='auto', device_budget=...): a plan for a budget the step does not fit")
    module = TinyGPT2()
    batch = next(iter(tokens()))
    without = estimate_memory(module, batch, device="cpu")
    budget = int(without.peak_bytes * 0.9)  # 10% under the step's predicted peak
    planned = LightMem(plan="auto", device_budget=budget)
    fit(planned)
    chosen = planned.chosen_plan
    print(
        f"plan applied: checkpoint {chosen.checkpoint}; predicted peak {format_bytes(chosen.predicted_peak_bytes)} "
        f"against {format_bytes(without.peak_bytes)} without lightmem, for a {format_bytes(budget)} budget"
    )

    print("\n== 3. LightMem(offload_optimizer=True, offload_devices=['cpu']): the optimizer steps on the host")
    optimizer = LightMem(offload_optimizer=True, offload_devices=["cpu"])
    fit(optimizer)
    (stats,) = optimizer.optimizer_offload_stats
    print(
        f"optimizer offload: {stats.steps} optimizer steps ran on the host ({stats.host_kernel} kernel), holding "
        f"{format_bytes(stats.host_bytes)} there; the last step moved {format_bytes(stats.grad_bytes_out)} of "
        f"gradients out and {format_bytes(stats.param_bytes_in)} of parameters back"
    )


if __name__ == "__main__":
    main()
