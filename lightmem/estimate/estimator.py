"""``estimate_memory``: the peak of a training step and where it goes, before the first real step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, Spelling, TileSettings
from lightmem.config.estimator import parse_checkpoint, parse_offload
from lightmem.estimate.advice import advise
from lightmem.estimate.assemble import build_report
from lightmem.estimate.chunked_loss import ChunkedLossReach, dominant_logits
from lightmem.estimate.planning.space import PlanSpace
from lightmem.estimate.report import MemoryEstimate
from lightmem.estimate.search import largest_batches
from lightmem.estimate.settings import EstimateSettings, LossFn, parse_settings
from lightmem.estimate.trace.batch import BatchInfo, inspect_batch, scalable_batch
from lightmem.offload.scope import ModuleScope

ESTIMATE_MEMORY = Spelling("estimate_memory", (("modules", "tile"),))


def estimate_memory(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    offload: bool | Mapping[str, Any] | OffloadSettings | None = None,
    checkpoint: Iterable[str | type] | str | None = None,
    budget: int | str | None = None,
    overhead_bytes: int | str | None = None,
    zero_grad: str = "after_forward",
    checkpoint_policy: CheckpointPolicyArg = "full",
    gpu: str = "default",
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    tile: Iterable[str | type] | str | None = None,
    tile_tokens: int | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of one steady-state training step, without allocating it.

    One training step (forward, backward, optimizer step) runs on fake tensors on the CPU: no
    tensor memory is allocated, so a step needing tens of GB on a GPU is estimated on a laptop
    in seconds. The peak is that of a step after the first: the previous step's gradients and
    the optimizer state are alive during forward, gradients are set to None before backward
    (as Lightning does). The model is left untouched: fake parameters are swapped in and out.

    Args:
        model: an ``nn.Module`` (with ``loss_fn``, or returning a scalar loss / an output with
            ``.loss``) or a ``LightningModule`` (its ``training_step`` and, unless ``optimizer``
            is given, its ``configure_optimizers``). It may live on the meta device.
        batch: one batch as the model takes it (a tensor, or a dict/tuple/list of them). Values
            are read once, for advice; the step itself only uses shapes and dtypes. A plain
            module is called as ``model(batch)``, ``model(**batch)`` or ``model(*batch)``.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        optimizer: a ``torch.optim`` name ("adamw", "adam", "sgd", ...) or a callable
            ``params -> Optimizer``. Default: ``configure_optimizers`` for a LightningModule,
            "adamw" otherwise.
        precision: Lightning's precision flag: "32-true", "16-mixed", "bf16-mixed", "16-true",
            "bf16-true", "64-true" (or 32, 16, "bf16", 64).
        device: "cuda" (what ``torch.cuda.max_memory_allocated`` counts: the caching
            allocator's block sizes, cuBLAS workspaces, foreach optimizers, CUDA's autocast
            policy, fused dropout) or "cpu" (matches a real CPU run).
        gpu: the GPU of a CUDA estimate, which sets the cuBLAS workspace size: "h100", "h200",
            "gh200" or "hopper" (32 MiB each), "default" or another name such as "a100"
            (8 MiB + 128 KiB each). One workspace for the forward, one for the backward.
        offload: lightmem's activation offload to simulate: True for its defaults, a dict with
            any of ``min_bytes``, ``include``, ``exclude``, ``prefetch``, ``max_inflight_bytes``,
            ``host_budget`` (parsed as ``offload_activations`` parses them), or an
            ``OffloadSettings`` (``LightMem(...).settings.offload``).
        checkpoint: targets for ``lightmem.checkpoint.apply_checkpointing`` (class names,
            qualified-name globs, classes), applied for the estimate and removed afterwards.
        checkpoint_policy: what those blocks keep, as ``apply_checkpointing(policy=...)``:
            ``"full"``, ``"save_matmuls"`` or a per-op callable (also what the advice's plan
            prices checkpointing with).
        budget: device memory to compare against ("24GiB", bytes); enables budget advice.
        overhead_bytes: allowance for what the caching allocator does not count (the CUDA
            context, NCCL buffers): default "1GiB" on CUDA, 0 on CPU. Reported apart from the
            breakdown.
        zero_grad: "after_forward" (Lightning's order, the default: the previous step's
            gradients are alive during forward) or "before_forward" (a plain PyTorch loop that
            calls ``optimizer.zero_grad()`` before the forward).
        offload_optimizer: simulate model-state offload (``LightMem(offload_optimizer=True)``):
            each gradient leaves the device once final (at most 64 MiB waiting for its copy),
            optimizer state and step are on the host. Adds an "offload_optimizer" scenario; the
            other requested scenarios include it. Host bytes are in each scenario's ``host_bytes``.
            ``OptimizerOffloadSettings`` (already parsed: ``LightMem(...).settings.optimizer_offload``
            or ``lightmem.config.OptimizerOffloadSettings.parse(device_dtype="bf16")``) set the
            gradient bytes waiting instead, and with ``device_dtype`` the trainable parameters are bf16 on the device in
            that scenario: its parameters, gradients in flight and ``model_state_link_bytes`` (the
            bytes over the link per step) are bf16 bytes, fp32 masters and state on the host
            (``precision="bf16-mixed"`` only, as under Lightning).
        tile: position-wise modules to run in sequence shards, as ``apply_tiling`` takes them
            (``lightmem.tiling``), applied for the estimate and removed afterwards. Adds a "tile"
            scenario; the other requested scenarios (all but the baseline) tile too. Their
            ``step_seconds`` does not count the tiled modules' second forward in backward yet.
        tile_tokens: positions per shard (default: as many as the tiled module's input is wide).

    Returns:
        A :class:`MemoryEstimate` for the requested configuration, with "baseline" (no lightmem)
        and each requested flag alone in ``scenarios``. Values the step reads are stood in for
        (``stand_ins`` says where); a mixture of experts is predicted under balanced routing and
        bounded under the worst case (``routing_bound_bytes``, ``routing_assumptions``), and with a
        budget ``fits`` holds the bound to it.

    Raises:
        ValueError: an argument is invalid (the message names it and lists what is accepted),
            or the loss is not a scalar.
        EstimateError: the step cannot run on fake tensors (it reads tensor values, or a
            LightningModule hook needs a Trainer); the message says what to change.

    Example::

        >>> import torch
        >>> from lightmem import estimate_memory
        >>> model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1))
        >>> est = estimate_memory(model, torch.randn(64, 1024), lambda m, x: m(x).mean(), device="cpu")
        >>> list(est.breakdown)
        ['parameters', 'gradients', 'optimizer_state', 'activations', 'temporaries', 'workspaces']
        >>> est.breakdown["workspaces"]  # cuBLAS workspaces: CUDA only
        0
    """
    started = time.perf_counter()
    settings = parse_settings(
        "estimate_memory", model, loss_fn, optimizer=optimizer, precision=precision, device=device,
        overhead_bytes=overhead_bytes, budget=budget, zero_grad=zero_grad, checkpoint_policy=checkpoint_policy,
        gpu=gpu, offload_optimizer=offload_optimizer,
    )  # fmt: skip
    offload_config = parse_offload(offload, flag="estimate_memory(offload=...)")
    if offload_config is not None:
        # Patterns are checked against the model now, so a typo fails before any tracing.
        ModuleScope(
            model, offload_config.include, offload_config.exclude,
            include_flag=offload_config.flag("include"), exclude_flag=offload_config.flag("exclude"),
            include_min_bytes=offload_config.include_min_bytes,
        )  # fmt: skip
    targets = parse_checkpoint(checkpoint, flag="estimate_memory(checkpoint=...)")
    tiles = TileSettings.parse(tile, tile_tokens=tile_tokens, spelling=ESTIMATE_MEMORY)
    info = inspect_batch(batch)

    return build_estimate(model, batch, settings, info, offload_config, targets, started=started, tile=tiles)


def build_estimate(
    model: nn.Module,
    batch: Any,
    settings: EstimateSettings,
    info: BatchInfo,
    offload: OffloadSettings | None,
    checkpoint: tuple[Any, ...] | None,
    *,
    started: float | None = None,
    tile: TileSettings | None = None,
) -> MemoryEstimate:
    """The report with its advice. Over a budget that activations can be brought under, the
    advice is the verified plan of the planner's own space for these settings (``PlanSpace``: what
    ``plan`` searches), so the two never disagree. With a budget, where the loss's logits dominate
    the step, the largest batch without lightmem is searched as the loss is written and with it
    priced as chunked (``MemoryEstimate.chunked_loss``)."""
    started = time.perf_counter() if started is None else started
    estimate, baseline = build_report(model, batch, settings, info, offload, checkpoint, tile=tile)
    verified = None
    budget = estimate.budget_bytes
    if budget is not None and not estimate.baseline_fits and not estimate.static_exceeds_budget:
        verified = PlanSpace(model, batch, settings, info, estimate, baseline).plan(budget)
    if budget is not None and dominant_logits(estimate) is not None:
        # The largest batch without lightmem: as written and priced as chunked (no model-state offload).
        plain = replace(settings, optimizer_offload=None)
        with contextlib.suppress(ValueError):  # a batch without a batch dimension to scale
            scaled = scalable_batch(batch, flag="max_batch_size(batch=...)")
            estimate.chunked_loss = ChunkedLossReach(
                budget,
                largest_batches(model, batch, plain.priced_as_chunked(), scaled).baseline,
                largest_batches(model, batch, plain, scaled).baseline,
            )
    estimate.advice = advise(estimate, info, baseline, verified)
    estimate.seconds = time.perf_counter() - started
    return estimate
