"""One offload policy: the estimator's predicted offloaded bytes are what the engine moves.

The engine (``offload_activations``) and the estimator (``estimate_memory(offload=...)``) run the
same decision code (``lightmem.offload.policy``), the estimator on fake tensors; on real CPU runs
(``devices=("cpu",)``) the prediction must equal ``stats.offloaded_bytes`` to the byte.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from models import ConvNet, LSTMTagger, TinyGPT, gpt_loss
from torch import nn

from lightmem import estimate_memory, offload_activations


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(256, 1))


def _lstm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    # oneDNN has no bfloat16 LSTM on every CPU; the native kernel runs it under autocast.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.backends.mkldnn.flags(enabled=False):
            return F.cross_entropy(model(tokens).reshape(-1, 8), (tokens % 8).reshape(-1))


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_implementation="eager"
    )
    return transformers.GPT2LMHeadModel(config)


# name -> (model factory, batch factory, loss_fn(model, batch), a module pattern for include/exclude)
MODELS = {
    "tiny_gpt": (TinyGPT, lambda g: torch.randint(0, 128, (4, 33), generator=g), gpt_loss, "blocks.1"),
    "convnet": (
        ConvNet, lambda g: torch.randn(8, 3, 16, 16, generator=g), lambda m, b: m(b).logsumexp(1).mean(),
        "features.0",
    ),
    "lstm": (LSTMTagger, lambda g: torch.randint(0, 100, (4, 20), generator=g), _lstm_loss, "lstm"),
    "mlp": (_mlp, lambda g: torch.randn(64, 256, generator=g), lambda m, b: m(b).mean(), "2"),
    "gpt2": (
        _gpt2, lambda g: torch.randint(0, 128, (2, 32), generator=g),
        lambda m, b: m(input_ids=b, labels=b).loss, "transformer.h.0",
    ),
}  # fmt: skip


def _engine_offloaded_bytes(model, batch, loss_fn, bf16: bool, settings: dict) -> int:
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    off = offload_activations(model, devices=("cpu",), **settings)
    # The estimator predicts a steady-state step: the second one, after the host pool has merged
    # the slabs it grew during the first (near a tight budget their slack can keep one storage
    # on the device in the first step only).
    for _ in range(2):
        torch.manual_seed(0)
        with amp, off:
            loss = loss_fn(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return off.stats.offloaded_bytes


def _predicted_offloaded_bytes(model, batch, loss_fn, bf16: bool, settings: dict) -> int:
    estimate = estimate_memory(
        model, batch, loss_fn, device="cpu", precision="bf16-mixed" if bf16 else "32-true", offload=settings
    )
    return estimate.scenarios["offload"].offloaded_bytes


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_offloaded_bytes_equal_the_engines(name, bf16):
    make_model, make_batch, loss_fn, pattern = MODELS[name]
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(torch.Generator().manual_seed(0))
    variants = [
        {"min_bytes": 0},
        {"min_bytes": 4096},
        {},  # the default, min_bytes="1MiB"
        {"min_bytes": 0, "exclude" if bf16 else "include": [pattern]},
    ]
    moved_something = False
    for settings in variants:
        engine = _engine_offloaded_bytes(model, batch, loss_fn, bf16, settings)
        predicted = _predicted_offloaded_bytes(model, batch, loss_fn, bf16, settings)
        assert predicted == engine, settings
        moved_something |= engine > 0
    assert moved_something


def test_autocast_copies_of_weights_are_neither_moved_nor_predicted():
    """In bf16-mixed a Linear saves the bf16 copy of its weight: a parameter, never moved."""
    torch.manual_seed(0)
    model = nn.Linear(512, 512, bias=False)  # 1 MiB of weights, a 512 KiB bf16 copy
    batch = torch.randn(4, 512)
    loss_fn = lambda m, b: m(b).sum()  # noqa: E731
    settings = {"min_bytes": 0}
    # Saved: the bf16 copy of the input (4 KiB) and of the weight (kept: a parameter copy).
    assert _engine_offloaded_bytes(model, batch, loss_fn, True, settings) == 4 * 512 * 2
    assert _predicted_offloaded_bytes(model, batch, loss_fn, True, settings) == 4 * 512 * 2


@pytest.mark.filterwarnings("ignore:lightmem. host memory for offload is exhausted")
def test_host_budget_is_the_same_rule_in_both():
    """Past the host budget the engine keeps storages on the device; the estimate keeps the same ones."""
    torch.manual_seed(0)
    model = _mlp()
    batch = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))  # 64 KiB activations
    loss_fn = lambda m, b: m(b).mean()  # noqa: E731
    settings = {"min_bytes": "64KiB", "host_budget": 3 * 65536}
    engine = _engine_offloaded_bytes(model, batch, loss_fn, False, settings)
    assert engine == 3 * 65536
    assert _predicted_offloaded_bytes(model, batch, loss_fn, False, settings) == engine
