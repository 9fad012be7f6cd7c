"""The previous step's optimizer state is created by a shortcut (lightmem/estimate/trace/optimizers.py,
``create_state``): one update per kind of parameter, clones for the rest. It must leave exactly
what a full ``optimizer.step()`` leaves: same state bytes, roles, peak and every scenario."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightmem import estimate_memory
from lightmem.estimate.trace import optimizers as optimizer_state


class _Net(nn.Module):
    """Repeated layers (so most parameters are clones) plus odd shapes, a frozen and an unused one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(48, 64)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(3))
        self.out = nn.Linear(64, 10)
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(64, 64)

    def forward(self, x):
        x = self.frozen(self.inp(x))
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


class _TwoOptimizers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        first = torch.optim.Adam(
            [{"params": self.net.inp.parameters()}, {"params": self.net.layers.parameters(), "lr": 1e-4}]
        )
        second = torch.optim.SGD(list(self.net.out.parameters()) + list(self.net.unused.parameters()),
                                 lr=0.1, momentum=0.9)  # fmt: skip
        return [first, second]


def _full_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _summary(est) -> dict:
    return {
        name: (scenario.peak_bytes, dict(scenario.breakdown)) for name, scenario in est.scenarios.items()
    } | {"peak": est.peak_bytes, "breakdown": dict(est.breakdown), "blocks": repr(est.blocks)}


_BATCH = (torch.randn(8, 48), torch.randint(0, 10, (8,)))

_OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, amsgrad=True),
    "adamw": lambda params: torch.optim.AdamW(params),
    "rmsprop": lambda params: torch.optim.RMSprop(params, momentum=0.9, centered=True),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_state_shortcut_equals_full_step(monkeypatch, name, device):
    def loss_fn(out, batch):
        return F.cross_entropy(out, batch[1])

    def run():
        return estimate_memory(
            _Net(), _BATCH, lambda model, batch: loss_fn(model(batch[0]), batch),
            optimizer=_OPTIMIZERS[name], device=device, precision="bf16-mixed",
        )  # fmt: skip

    fast = run()
    monkeypatch.setattr(optimizer_state, "create_state", _full_step)
    full = run()
    assert fast.scenarios["baseline"].breakdown["optimizer_state"] > 0
    assert _summary(fast) == _summary(full)


def test_state_shortcut_equals_full_step_two_lightning_optimizers(monkeypatch):
    fast = estimate_memory(_TwoOptimizers(), _BATCH, device="cpu")
    monkeypatch.setattr(optimizer_state, "create_state", _full_step)
    full = estimate_memory(_TwoOptimizers(), _BATCH, device="cpu")
    assert fast.scenarios["baseline"].breakdown["optimizer_state"] > 0
    assert _summary(fast) == _summary(full)


def test_state_shortcut_leaves_full_step_state_layout():
    """Directly: same keys, shapes, strides, dtypes and order as a full fake step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def layout(optimizer):
        return [
            (id(p), {k: (tuple(v.shape), v.stride(), v.dtype) if torch.is_tensor(v) else v
                     for k, v in optimizer.state[p].items()})
            for p in optimizer.state
        ]  # fmt: skip

    for name, factory in _OPTIMIZERS.items():
        with FakeTensorMode(allow_non_fake_inputs=True):
            params = [nn.Parameter(torch.empty(s)) for s in [(4, 3), (3,), (4, 3), (3,), (5,), (4, 3)]]
            for p in params:
                p.grad = torch.empty_like(p)
            params[4].grad = None  # no gradient: no state
            full, fast = factory(params), factory(params)
            full.step()
            full_layout = layout(full)
            full.state.clear()
            optimizer_state.create_state(fast)
            assert layout(fast) == full_layout, name
            assert [p for g in fast.param_groups for p in g["params"]] == params
