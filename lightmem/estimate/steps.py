"""One fake step per lightmem configuration, and the one memo of the steps traced.

``run_configuration`` turns the settings and one configuration into the device's request
(``device.run``) and, for the baseline every configuration's time is built from, prices its ops at
the settings' speeds (``pricing.fold``). ``STEPS`` remembers across calls what steps measured, by
one key (``step_key``: the model, the batch and every setting a step reads, then the configuration):
the priced baselines (a plan made again for the same batches traces no baseline again; at new
prices it is priced again from its log) and the planner's verified configurations.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightmem.config import OffloadSettings, OptimizerOffloadSettings, TileSettings
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.device.run import run_step
from lightmem.estimate.pricing.fold import priced_at
from lightmem.estimate.settings import EstimateSettings
from lightmem.estimate.trace.batch import BatchInfo, inspect_batch
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
    sequence: tuple[int, int, int] | None = None,
) -> StepTrace:
    """One fake step of ``model`` with one lightmem configuration (the building block of the API).
    ``offload_optimizer`` defaults to the settings' choice; ``priced``: every op priced at the
    settings' speeds (the baseline's, which every configuration's time is built from); ``tile``:
    position-wise modules run in sequence shards; ``sequence``: the batch's sequence at another
    length (``StepRequest.sequence``). With ``settings.loss_as_chunked`` the step is priced
    as if its loss were chunked; a priced step where the loss's logits dominate comes with what it
    gives priced so (``StepTrace.as_chunked``: the baseline of the what-if)."""
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
        sequence=sequence,
        zero_grad=settings.zero_grad,
        gpu=settings.gpu,
        optimizer_offload=model_state if offload_optimizer else None,
        trainable_dtype=trainable_dtype,
        priced=priced,
        expandable_segments=settings.expandable_segments,
        loss_as_chunked=settings.loss_as_chunked,
        chunked_too=priced,
    )
    trace = run_step(model, batch, request)
    if priced:
        assert settings.speeds is not None
        trace = priced_at(trace, settings.speeds)
    return trace


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



def step_key(
    model: nn.Module, batch: Any, settings: EstimateSettings, batch_size: int | None,
    sequence: tuple[int, int, int] | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    """What decides a fake step's memory but the lightmem configuration and the prices: the model, the
    batch (at ``batch_size`` and ``sequence``) and every setting a step reads (a step priced as chunked
    is another step)."""
    return (
        _model_signature(model), _batch_signature(batch), batch_size, sequence, settings.device, settings.precision.name,
        settings.optimizer.name, settings.optimizer.factory, settings.loss_fn, settings.zero_grad, settings.gpu,
        settings.expandable_segments, repr(settings.optimizer_offload), settings.loss_as_chunked,
    )  # fmt: skip


def baseline_key(
    model: nn.Module, batch: Any, settings: EstimateSettings, info: BatchInfo, batch_size: int | None,
    sequence: tuple[int, int, int] | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    """What decides a baseline step but its prices: ``step_key``, the batch size it is scaled from and
    the checkpoint policy (its per-op counts)."""
    return (*step_key(model, batch, settings, batch_size, sequence), info.batch_size, settings.checkpoint_policy)


@dataclass
class _Remembered:
    baselines: collections.OrderedDict[tuple[Any, ...], StepTrace] = field(default_factory=collections.OrderedDict)
    verified: dict[tuple[Any, ...], Any] = field(default_factory=dict)


class StepMemo:
    """Steps already traced, by model (held weakly) and ``step_key``: priced baselines, the most
    recent ``baselines_kept`` of each model (a trace holds every op's log), and the planner's verified
    configurations (what each measured: small). A re-plan of ``LightMem(plan="auto")`` for the same
    batches at new prices, the second checkpoint policy of ``checkpoint_policy="auto"`` (for the
    configurations that re-run nothing), ``max_batch_size(plan=True)``'s plan at the size it found and
    the frontier's rows trace nothing twice."""

    def __init__(self, baselines_kept: int = 8) -> None:
        self.baselines_kept = baselines_kept
        self._models: weakref.WeakKeyDictionary[nn.Module, _Remembered] = weakref.WeakKeyDictionary()

    def baseline(self, model: nn.Module, key: tuple[Any, ...], speeds: DeviceSpeeds) -> StepTrace | None:
        """The baseline remembered under ``key``, priced at ``speeds`` (again from its log if need be)."""
        kept = self._models.get(model)
        found = kept.baselines.get(key) if kept is not None else None
        if found is None:
            return None
        kept.baselines.move_to_end(key)  # type: ignore[union-attr]
        return found if found.priced_with == speeds else priced_at(found, speeds)

    def holds_baseline(self, model: nn.Module, key: tuple[Any, ...], trace: StepTrace) -> bool:
        """Whether ``trace`` itself is the baseline remembered under ``key`` (nothing priced again)."""
        kept = self._models.get(model)
        return kept is not None and kept.baselines.get(key) is trace

    def remember_baseline(self, model: nn.Module, key: tuple[Any, ...], trace: StepTrace) -> None:
        kept = self._models.setdefault(model, _Remembered()).baselines
        kept[key] = trace
        while len(kept) > self.baselines_kept:
            kept.popitem(last=False)

    def verified(self, model: nn.Module, key: tuple[Any, ...]) -> Any:
        """What a configuration's step measured, remembered under ``key`` (None: not traced yet)."""
        kept = self._models.get(model)
        return kept.verified.get(key) if kept is not None else None

    def remember_verified(self, model: nn.Module, key: tuple[Any, ...], found: Any) -> None:
        self._models.setdefault(model, _Remembered()).verified[key] = found

    def clear(self) -> None:
        """Forget every step (a benchmark's first plan, made again)."""
        self._models.clear()


STEPS = StepMemo()
"""The one memo of the steps traced in this process."""
