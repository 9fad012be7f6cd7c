"""One fake step per lightmem configuration, and the report built from them (no advice).

Shared by ``estimate_memory``, ``max_batch_size`` and ``plan``: the arguments are validated once
(``parse_settings``), each configuration runs as one fake step (``run_configuration``), and
``build_report`` puts the baseline and the requested configurations side by side.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightmem.config import (
    OffloadSettings,
    OptimizerOffloadSettings,
    TileSettings,
)
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.device.run import run_step
from lightmem.estimate.pricing.fold import reprice
from lightmem.estimate.settings import EstimateSettings
from lightmem.estimate.trace.batch import BatchInfo, inspect_batch
from lightmem.estimate.trace.logits import pricing_chunked
from lightmem.estimate.trace.optimizers import MASTER_DTYPE
from lightmem.estimate.trace.step import StepRequest, StepTrace


def run_configuration(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    *,
    offload: OffloadSettings | None = None,
    checkpoint: tuple[Any, ...] | None = None,
    batch_size: int | None = None,
    info: BatchInfo | None = None,
    offload_optimizer: bool | None = None,
    priced: bool = False,
    tile: TileSettings | None = None,
) -> StepTrace:
    """One fake step of ``model`` with one lightmem configuration (the building block of the API).
    ``offload_optimizer`` defaults to the settings' choice; ``priced``: every op priced at the
    settings' speeds (the baseline's, which every configuration's time is built from); ``tile``:
    position-wise modules run in sequence shards."""
    info = info or inspect_batch(batch)
    if offload_optimizer is None:
        offload_optimizer = settings.offload_optimizer
    # The planner may turn model-state offload on by itself: then under the engine's defaults.
    model_state = settings.optimizer_offload or OptimizerOffloadSettings.parse()
    # With device_dtype asked for, the trainable parameters are fp32 (the engine refuses others;
    # under plan="auto" the engine has already cast them) and bf16 on the device only in the steps
    # that offload model state: the baseline keeps them fp32, as it runs without lightmem.
    device_dtype = settings.optimizer_offload.device_dtype if settings.optimizer_offload is not None else None
    trainable_dtype = None if device_dtype is None else device_dtype if offload_optimizer else MASTER_DTYPE
    request = StepRequest(
        device=settings.device,
        precision=settings.precision,
        optimizer=settings.optimizer,
        loss_fn=settings.loss_fn,
        offload=offload,
        checkpoint=checkpoint,
        checkpoint_policy=settings.checkpoint_policy,
        tile=tile,
        batch_size=batch_size,
        original_batch_size=info.batch_size,
        zero_grad=settings.zero_grad,
        gpu=settings.gpu,
        optimizer_offload=model_state if offload_optimizer else None,
        trainable_dtype=trainable_dtype,
        speeds=settings.speeds if priced else None,
        expandable_segments=settings.expandable_segments,
    )
    return run_step(model, batch, request)


def _model_signature(model: nn.Module) -> tuple[Any, ...]:
    """What a step's memory depends on in the model: its modules' classes and train/eval modes, the
    callables set on them (a ``forward`` wrapped by checkpointing, a ``loss_function`` replaced by the
    chunked loss: ``plan="auto"`` plans with its own checkpoint wrappers taken off, so its plans
    agree), and its parameters' and buffers' names, shapes, dtypes and whether they train (a model
    changed otherwise misses). Not hooks: lightmem's offload scopes and block clocks come and go."""
    return (
        tuple(
            (
                type(module).__name__, module.training,
                tuple(
                    (name, id(value)) for name, value in vars(module).items()
                    if callable(value) and not isinstance(value, (nn.Module, torch.Tensor))
                ),
            )
            for module in model.modules()
        ),  # fmt: skip
        tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()),
        tuple((name, tuple(b.shape), b.dtype) for name, b in model.named_buffers()),
    )


def _batch_signature(batch: Any) -> tuple[Any, ...]:
    return tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in tree_leaves(batch))


_BASELINES: weakref.WeakKeyDictionary[nn.Module, collections.OrderedDict[tuple[Any, ...], StepTrace]] = (
    weakref.WeakKeyDictionary()
)
"""Priced baseline steps by model, the most recent ``BASELINES_KEPT`` of each: a plan made again for
the same batches (``plan="auto"`` once blocks or steps are measured, ``max_batch_size(plan=True)``'s
plan at the size it found, the frontier's rows) traces no baseline again; at new prices it is priced
again from its log (``reprice``)."""
BASELINES_KEPT = 8


def step_memory_key(model: nn.Module, batch: Any, settings: EstimateSettings, batch_size: int | None) -> tuple[Any, ...]:
    """What decides a fake step's memory but the lightmem configuration and the prices: the model, the
    batch (at ``batch_size``) and every setting a step reads (a step priced as chunked is another step)."""
    return (
        _model_signature(model), _batch_signature(batch), batch_size, settings.device, settings.precision.name,
        settings.optimizer.name, settings.optimizer.factory, settings.loss_fn, settings.zero_grad, settings.gpu,
        settings.expandable_segments, repr(settings.optimizer_offload), pricing_chunked(),
    )  # fmt: skip


def baseline_key(
    model: nn.Module, batch: Any, settings: EstimateSettings, info: BatchInfo, batch_size: int | None
) -> tuple[Any, ...]:
    """What decides a baseline step but its prices: ``step_memory_key``, the batch size it is scaled
    from and the checkpoint policy (its per-op counts)."""
    return (*step_memory_key(model, batch, settings, batch_size), info.batch_size, settings.checkpoint_policy)


def remembered_baseline(model: nn.Module, key: tuple[Any, ...], speeds: DeviceSpeeds) -> StepTrace | None:
    kept = _BASELINES.get(model)
    found = kept.get(key) if kept is not None else None
    if found is None:
        return None
    kept.move_to_end(key)  # type: ignore[union-attr]
    return found if found.priced_with == speeds else reprice(found, speeds)


def remember_baseline(model: nn.Module, key: tuple[Any, ...], trace: StepTrace) -> None:
    kept = _BASELINES.setdefault(model, collections.OrderedDict())
    kept[key] = trace
    while len(kept) > BASELINES_KEPT:
        kept.popitem(last=False)


