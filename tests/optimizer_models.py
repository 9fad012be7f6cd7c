"""Tiny models and a Lightning module for the optimizer-offload exactness tests."""

from __future__ import annotations

import functools
import types

import pytorch_lightning as pl
import torch
from exact import assert_same
from lit_models import cpu_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightmem import LightMem

OPTIMIZERS = {
    "sgd-momentum": lambda params, **kernel: torch.optim.SGD(params, lr=0.05, momentum=0.9, **kernel),
    "adam": lambda params, **kernel: torch.optim.Adam(params, lr=0.01, **kernel),
    "adamw-decay": lambda params, **kernel: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, **kernel),
    "adagrad": lambda params, **kernel: torch.optim.Adagrad(params, lr=0.05, **kernel),
}

HOST_KERNEL = {"fused": True}
"""What lightmem steps these optimizers with on the host when they leave foreach/fused unset: the
reference run without lightmem is constructed with it."""


def assert_given_back(model_a: nn.Module, model_b: nn.Module, opt_a, opt_b) -> None:
    """After offload ended: run ``b`` (constructed with foreach/fused unset, stepped by lightmem
    with the fused kernel) has bitwise the state of run ``a`` (constructed with ``fused=True``,
    without lightmem), and its param groups say ``fused=None`` again, as constructed."""
    assert_same(model_a.state_dict(), model_b.state_dict(), "state_dict")
    expected, actual = opt_a.state_dict(), opt_b.state_dict()
    assert {group["fused"] for group in expected["param_groups"]} == {True}
    assert {group["fused"] for group in actual["param_groups"]} == {None}
    for group in expected["param_groups"]:
        group["fused"] = None
    assert_same(expected, actual, "optimizer")


def tiny_net() -> nn.Module:
    """Linear, BatchNorm (running statistics: buffers), Dropout (RNG), Linear."""
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))


def regression_batches(count: int, width: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed (inputs, targets) batches of 4 rows for ``tiny_net``-shaped regressions."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, width, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(count)]


def regression_loader(batches: int = 8, batch_size: int = 4, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batches * batch_size, 8, generator=generator)
    targets = torch.randn(batches * batch_size, 1, generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch_size, shuffle=False)


class _LitTinyBody:
    """LitTiny's methods, on the LightningModule of either package (``lit_tiny_class``)."""

    def __init__(self, optimizer: str = "adamw-decay", manual: bool = False, kernel: dict | None = None):
        super().__init__()
        self.net = tiny_net()
        self.optimizer_name = optimizer
        self.kernel = kernel or {}
        self.manual = manual
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs).float(), targets.to(torch.float32))
        if self.manual:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            return None
        return loss

    def configure_optimizers(self):
        optimizer = OPTIMIZERS[self.optimizer_name](self.parameters(), **self.kernel)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class LitTiny(_LitTinyBody, pl.LightningModule):
    pass


@functools.cache
def lit_tiny_class(package: types.ModuleType) -> type:
    """LitTiny on ``package.LightningModule`` (``pytorch_lightning`` or ``lightning.pytorch``)."""
    return LitTiny if package is pl else type("LitTiny", (_LitTinyBody, package.LightningModule), {})


class SmallGPT(nn.Module):
    """Token embedding, two pre-norm transformer blocks, final norm, LM head: a GPT's shapes."""

    def __init__(self, vocab: int = 32, width: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        hidden = self.embedding(tokens)
        for block in self.blocks:
            hidden = block(hidden, is_causal=True, src_mask=nn.Transformer.generate_square_subsequent_mask(tokens.shape[1]))
        return self.head(self.norm(hidden))


def small_gpt_loss():
    """The loss of a fixed batch of tokens, as a function of a ``SmallGPT``."""
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(4))
    targets = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(5))
    return lambda model: nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def fit_tiny(callback, package=pl, module_class=None, **trainer_kwargs):
    """A fit of ``LitTiny`` (of ``package``) on ``regression_loader()``. Without a callback, the
    reference: its optimizer constructed with the kernel lightmem runs."""
    package.seed_everything(0, verbose=False)
    module_class = module_class or (LitTiny if package is pl else lit_tiny_class(package))
    module = module_class(optimizer=trainer_kwargs.pop("optimizer", "adamw-decay"), kernel=None if callback else HOST_KERNEL)
    trainer = cpu_trainer([callback] if callback else [], package, **trainer_kwargs)
    trainer.fit(module, regression_loader())
    return module, trainer, torch.get_rng_state()


def offloading_optimizer(**flags):
    """A LightMem with optimizer offload alone, on CPU."""
    return LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[], **flags)


def assert_same_fit(expected, actual):
    (module_a, trainer_a, rng_a), (module_b, trainer_b, rng_b) = expected, actual
    assert_given_back(module_a, module_b, trainer_a.optimizers[0], trainer_b.optimizers[0])
    schedulers = [[c.scheduler.state_dict() for c in t.lr_scheduler_configs] for t in (trainer_a, trainer_b)]
    assert_same(*schedulers, "LR schedulers")
    assert_same(rng_a, rng_b, "RNG state")


class SharedUnderReentrantCheckpoint(nn.Module):
    """One layer applied twice, each time in a reentrant checkpoint: its post-accumulate-grad hook
    fires once per nested backward, the first time with half its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.shared, self.last = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        hidden = self.first(x)
        for _ in range(2):
            hidden = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.shared(t)), hidden, use_reentrant=True)
        return self.last(hidden)


class LitSharedReentrant(LitTiny):
    """LitTiny on ``SharedUnderReentrantCheckpoint``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = SharedUnderReentrantCheckpoint()


class FailsInBackward(torch.autograd.Function):
    """Identity forward; its backward raises halfway through the model's backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("backward failed halfway")


def assert_no_hazards_then_close(transport) -> None:
    """A simulated GPU (or None: synchronous copies) saw no stale read, reuse hazard or unordered
    free; it is closed either way."""
    if transport is None:
        return
    hazards = (transport.stale_reads, transport.reuse_hazards, transport.unordered_source_frees)
    transport.close()
    assert hazards == (0, 0, 0)


def run_two_process_script(name: str, out) -> dict:
    """Launch ``tests/<name>`` (it starts its own 2 CPU processes on gloo) writing into ``out``;
    returns the ``report.json`` it wrote there."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}
    env.pop("MASTER_PORT", None)
    result = subprocess.run(
        [sys.executable, str(tests / name), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((Path(out) / "report.json").read_text())
