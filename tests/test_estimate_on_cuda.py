"""The estimator, the planner and ``plan="auto"`` with the model and the batch on CUDA: on the
simulated CUDA device (``lightmem.testing.cuda_tensor``), where a GPU's same-device errors show on
the CPU (issue 49, items 2 and 4; the H200 of 2026-11-28 found the first two).

Each case is run twice: on the simulated CUDA device and on the CPU, both priced for CUDA
(``device="cuda"``). The dry run never reads where the real tensors live, so the answers are equal.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from lit_models import LitGPT, cpu_trainer, token_loader
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map_only
from torch.utils.data import DataLoader

from lightmem import LightMem, estimate_memory, frontier, max_batch_size, plan
from lightmem.estimate.trace.batch import inspect_batch
from lightmem.testing.cuda_tensor import CUDA_DEVICE, SimulatedCudaFit, simulated_cuda

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning"
)

CLASSES = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


class Net(nn.Module):
    """A small net for any of the batches below; ``temperature`` is a one-element buffer the loss
    divides by (the estimator reads its value: ``known_value``), and the forward builds a tensor
    on its input's device."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "images":
            self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten())
            width = 4 * 8 * 8
        elif kind == "tokens":
            self.features = nn.Embedding(64, 16)
            width = 16
        else:  # "dict" (features and a one-hot column of classes), "one-hot"
            self.features = nn.Identity()
            width = 128 + CLASSES if kind == "dict" else 256
        self.blocks = nn.Sequential(Block(width), Block(width))  # what plans checkpoint
        self.head = nn.Linear(width, CLASSES)
        self.register_buffer("temperature", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.features(x)
        keep = torch.ones(hidden.shape[-1], device=x.device)  # user code: a tensor on the input's device
        return self.head(self.blocks(hidden * keep)) / self.temperature


def inputs_of(kind: str, batch: Any) -> torch.Tensor:
    if kind == "dict":
        return torch.cat([batch["features"], batch["classes"]], dim=1)
    return batch[0]


def loss_of(kind: str, model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(inputs_of(kind, batch))
    if kind == "tokens":  # next token of each sequence, from its mean embedding
        return F.cross_entropy(logits.mean(dim=1), batch[0][:, -1] % CLASSES)
    return F.cross_entropy(logits, batch[1] if kind != "dict" else batch["labels"])


def make_batch(kind: str, size: int = 32, seed: int = 0) -> Any:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (size,), generator=generator)
    if kind == "images":
        return (torch.randn(size, 3, 8, 8, generator=generator), labels)
    if kind == "tokens":
        return (torch.randint(0, 64, (size, 12), generator=generator),)
    if kind == "dict":
        features = torch.randn(size, 128, generator=generator)
        return {"features": features, "classes": F.one_hot(labels, CLASSES).float(), "labels": labels}
    # one-hot: a sparse float input, what reaches the estimator's mostly-zeros check (_sparse_input)
    return (F.one_hot(torch.randint(0, 256, (size,), generator=generator), 256).float(), labels)


KINDS = ["images", "tokens", "dict", "one-hot"]


def _net(kind: str) -> Net:
    torch.manual_seed(0)
    return Net(kind)


def _loss(kind: str):
    return lambda model, batch: loss_of(kind, model, batch)


def _cuda(batch: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda tensor: tensor.to("cuda"), batch)


def _same_estimate(on_cuda: Any, on_cpu: Any) -> None:
    assert (on_cuda.peak_bytes, on_cuda.breakdown, on_cuda.total_bytes) == (
        on_cpu.peak_bytes, on_cpu.breakdown, on_cpu.total_bytes
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["images", "dict", "one-hot"])
def test_a_float_batch_on_cuda_is_checked_for_zeros_on_its_own_device(kind):
    # The H200: counts made on the CPU and added to counts of the CUDA batch (_sparse_input).
    batch = make_batch(kind)
    expected = inspect_batch(batch)
    with simulated_cuda():
        found = inspect_batch(_cuda(batch))
    assert found == expected
    assert [item.one_hot for item in found.sparse_inputs] == {"images": [], "dict": [], "one-hot": [True]}[kind]


def test_a_one_element_cuda_buffer_used_in_arithmetic_is_read_on_the_dry_runs_device():
    # _known_value (now dry_run_device.known_value) kept the CUDA buffer's device in its fake:
    # FakeTensorDeviceMismatchError.
    batch = make_batch("tokens")  # a token batch does not reach the zeros check
    expected = estimate_memory(_net("tokens"), batch, _loss("tokens"), device="cuda")
    with simulated_cuda():
        model = _net("tokens").cuda()
        assert model.temperature.device == CUDA_DEVICE
        found = estimate_memory(model, _cuda(batch), _loss("tokens"), device="cuda")
    _same_estimate(found, expected)
    assert model.temperature.item() == 2.0 and model.temperature.device == CUDA_DEVICE


class LitNet(pl.LightningModule):
    """``Net`` in a LightningModule whose training step builds a tensor on ``self.device``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = _net(kind)
        self.devices_seen: list[tuple[torch.device, ...]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        leaves = torch.utils._pytree.tree_leaves(batch)
        if not any(isinstance(leaf, FakeTensor) for leaf in leaves):  # a real step, not the estimator's
            self.devices_seen.append((self.device, self.net.head.weight.device, *(leaf.device for leaf in leaves)))
        logits = self.net(inputs_of(self.kind, batch)) + torch.zeros(CLASSES).to(self.device)  # a bias moved there
        weights = torch.full((logits.shape[0],), 0.5, device=self.device)  # e.g. per-sample loss weights
        if self.kind == "tokens":
            logits, labels = logits.mean(dim=1), batch[0][:, -1] % CLASSES
        else:
            labels = batch["labels"] if self.kind == "dict" else batch[1]
        per_sample = F.cross_entropy(logits, labels, reduction="none")
        return (per_sample * weights).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_training_step_that_builds_tensors_on_self_device_is_estimated_on_the_dry_runs_device():
    batch = make_batch("tokens")
    expected = estimate_memory(LitNet("tokens"), batch, device="cuda")
    with simulated_cuda():
        module = LitNet("tokens").to(CUDA_DEVICE)
        assert module.device == CUDA_DEVICE
        found = estimate_memory(module, _cuda(batch), device="cuda")
    _same_estimate(found, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_estimate_on_cuda_equals_the_estimate_on_the_cpu(kind):
    batch = make_batch(kind)
    expected = estimate_memory(LitNet(kind), batch, device="cuda")
    with simulated_cuda():
        found = estimate_memory(LitNet(kind).to(CUDA_DEVICE), _cuda(batch), device="cuda")
    _same_estimate(found, expected)


def _plan_args(budget: int) -> dict[str, Any]:
    return {"budget": budget, "device": "cuda", "gpu": "h100", "overhead_bytes": 0}


def test_plan_max_batch_size_and_frontier_on_cuda_answer_as_on_the_cpu():
    kind = "images"  # a float batch: what the planner's look at the batch (_sparse_input) reads
    batch = make_batch(kind, size=24)  # 4,608 values: enough for the look at zeros
    baseline = estimate_memory(_net(kind), batch, _loss(kind), device="cuda", gpu="h100", overhead_bytes=0)
    args = _plan_args(baseline.total_bytes * 3)

    def answers(model: nn.Module, batch: Any) -> tuple:
        planned = plan(model, batch, loss_fn=_loss(kind), **args)
        largest = max_batch_size(model, batch, loss_fn=_loss(kind), plan=True, limit=32, **args)
        table = frontier(model, batch, loss_fn=_loss(kind), multiples=(1, 2), limit=32, **args)
        return (
            planned.predicted_peak_bytes, planned.checkpoint, largest.baseline, largest.planned,
            [(row.batch_size, row.fits, row.plan, row.predicted_total_bytes, row.step_s) for row in table.rows],
        )  # fmt: skip

    expected = answers(_net(kind), batch)
    with simulated_cuda():
        assert answers(_net(kind).cuda(), _cuda(batch)) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_plan_auto_trains_a_model_and_batches_on_cuda_with_the_plan_the_planner_gives(kind):
    loader = DataLoader([make_batch(kind, seed=seed) for seed in range(3)], batch_size=None)
    budget = 3 * estimate_memory(LitNet(kind), make_batch(kind), device="cuda").total_bytes
    expected = plan(LitNet(kind), make_batch(kind), budget, device="cuda", offload=False, checkpoint_policy="auto")
    module = LitNet(kind)
    callback = LightMem(plan="auto", device_budget=budget, offload=False)
    with simulated_cuda():
        cpu_trainer([SimulatedCudaFit(), callback], max_steps=3).fit(module, loader)
    assert module.devices_seen == [(CUDA_DEVICE,) * (2 + len(torch.utils._pytree.tree_leaves(make_batch(kind))))] * 3
    chosen = callback.chosen_plan
    assert (chosen.predicted_peak_bytes, chosen.checkpoint) == (expected.predicted_peak_bytes, expected.checkpoint)


def test_plan_auto_checkpoints_blocks_of_a_model_on_cuda_that_build_their_masks_on_its_device():
    # TinyGPT's attention builds its causal mask on its input's device, in the forward and again in
    # the recompute of a checkpointed block.
    tokens = next(iter(token_loader(batches=1)))
    alone = estimate_memory(LitGPT(), tokens, device="cuda", overhead_bytes=0, checkpoint=["Block"])
    reserved = {name: step.reserved for name, step in alone.scenarios.items()}
    assert reserved["checkpoint"] < reserved["baseline"]  # what the allocator reserves, in 2 MiB pages
    budget = (reserved["checkpoint"] + reserved["baseline"]) // 2 + (1 << 30)  # the planner's CUDA allowance
    expected = plan(LitGPT(), tokens, budget, device="cuda", offload=False, checkpoint_policy="full")
    assert expected.checkpoint  # the case: blocks are checkpointed
    callback = LightMem(plan="auto", device_budget=budget, offload=False, checkpoint_policy="full")
    module = LitGPT()
    with simulated_cuda():
        cpu_trainer([SimulatedCudaFit(), callback], max_steps=1).fit(module, token_loader(batches=1))
    chosen = callback.chosen_plan
    assert (chosen.predicted_peak_bytes, chosen.checkpoint) == (expected.predicted_peak_bytes, expected.checkpoint)
    assert module.trainer.global_step == 1


class CachesItsMask(pl.LightningModule):
    """Keeps what its training step builds in a plain attribute (not a buffer): a cache that holds
    None until the first step fills it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)
        self.mask: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        length = tokens.shape[1]
        if self.mask is None or self.mask.shape[0] != length:  # a running mean over the positions so far
            self.mask = torch.ones(length, length, device=tokens.device).tril() / torch.arange(
                1, length + 1, device=tokens.device
            ).unsqueeze(1)
        hidden = self.mask @ self.embed(tokens)
        return F.cross_entropy(self.head(hidden).flatten(0, 1), tokens.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_cache_that_held_none_before_the_dry_run_holds_none_after_it():
    module = CachesItsMask()
    estimate_memory(module, (torch.randint(0, 64, (4, 12)),), device="cuda")
    assert module.mask is None  # the dry run's fake is gone, and the attribute is not


def test_plan_auto_plans_again_for_a_module_that_cached_a_cuda_tensor_in_its_first_step():
    # The second, larger batch is planned again after a real step left a CUDA tensor in the module:
    # it enters the dry run as a CPU tensor there would, as a fake on the dry run's device.
    batches = [(torch.randint(0, 64, (size, 12), generator=torch.Generator().manual_seed(size)),) for size in (4, 8)]
    expected_module = CachesItsMask()
    expected_module.training_step(batches[0], 0)  # the cache a real step leaves, on the CPU
    expected = plan(expected_module, batches[1], "2GiB", device="cuda", offload=False, checkpoint_policy="auto")
    module = CachesItsMask()
    callback = LightMem(plan="auto", device_budget="2GiB", offload=False)
    with simulated_cuda():
        cpu_trainer([SimulatedCudaFit(), callback], max_steps=2).fit(module, DataLoader(batches, batch_size=None))
    chosen = callback.chosen_plan
    assert chosen.estimate.batch_size == 8 and module.trainer.global_step == 2
    assert chosen.predicted_peak_bytes == expected.predicted_peak_bytes
    assert chosen.estimate.breakdown == expected.estimate.breakdown
