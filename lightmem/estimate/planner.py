"""``plan``: the fastest lightmem configuration that fits a memory budget (the search:
``lightmem.estimate.planning``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import OffloadSettings, OptimizerOffloadSettings, parse_count
from lightmem.config.estimator import parse_planned_offload
from lightmem.devices import DeviceSpeeds
from lightmem.estimate.advice import advise
from lightmem.estimate.chunked_loss import dominant_logits
from lightmem.estimate.planning.policy import planned
from lightmem.estimate.planning.result import Plan
from lightmem.estimate.settings import AUTO_POLICY, EstimateSettings, parse_settings
from lightmem.estimate.trace.batch import sequence_axis


def plan(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
    optimizer: str | Callable[..., Any] | None = None,
    precision: str | int = "32-true",
    device: str = "cuda",
    gpu: str | DeviceSpeeds = "auto",
    overhead_bytes: int | str | None = None,
    zero_grad: str = "after_forward",
    flops_per_s: float | None = None,
    link_bytes_per_s: int | str | None = None,
    offload: bool | Mapping[str, Any] | OffloadSettings | None = None,
    checkpoint_policy: CheckpointPolicyArg = "full",
    offload_optimizer: bool | OptimizerOffloadSettings = False,
    batch_size: int | None = None,
    tile: bool = False,
    host_budget: int | float | str | None = None,
    sequence_length: int | None = None,
    seq_dim: int | None = None,
) -> Plan:
    """The lightmem configuration with the least predicted step time whose verified peak fits ``budget``.

    The space: checkpoint any set of repeated layers, offload the saved tensors of any blocks, or
    offload every saved tensor of at least ``offload``'s ``min_bytes`` anywhere in the model, alone or
    with checkpointing (see the module docstring for how it is searched). Whenever every repeated
    layer checkpointed (with or without offload) or offload alone fits, the plan fits.

    Args:
        budget: device memory for the whole step, overhead allowance included ("24GiB", bytes).
        gpu: the GPU whose speeds price every op, re-run and transfer, and whose cuBLAS
            workspaces are counted: a name ("h100", "a100", ... ``lightmem.devices.GPU_NAMES``),
            "auto" (this machine's CUDA device, else a generic A100-class GPU), or speeds measured
            on the training device (``measure_device_speeds``).
        flops_per_s: a matrix throughput to price every product at instead of the GPU's own.
        link_bytes_per_s: a host link speed per second, each way, instead of the GPU's own
            ("25GB", bytes).
        offload: the offload settings the plan searches under, as for :func:`estimate_memory`
            (a dict such as ``{"min_bytes": "4MiB", "exclude": ["lm_head"]}``, or
            ``OffloadSettings``); None: lightmem's defaults; False: plan checkpointing only. The
            modules to offload are the plan's choice: ``include`` is refused. ``Plan.offload``
            is these settings with the chosen modules (``include`` None: offload everywhere), and
            ``Plan.settings`` says what the search ran under, prices included.
        checkpoint_policy: what the blocks the plan checkpoints keep: ``"full"`` (their inputs),
            ``"save_matmuls"`` or a per-op callable, as in ``apply_checkpointing``; priced and
            verified with it, and returned in ``lightmem_kwargs()``. ``"auto"``: the faster plan of
            "full" and "save_matmuls" (``LightMem(plan="auto")`` without ``checkpoint_policy``).
        offload_optimizer: plan with gradients and optimizer state on the host. Without it the
            plan turns it on by itself when parameters + gradients + optimizer state exceed the
            budget and the parameters alone do not (``lightmem_kwargs()`` then has it). Settings
            with ``device_dtype`` (``LightMem(...).settings.optimizer_offload``, as ``plan="auto"``
            passes them) plan with bf16 device weights, and ``lightmem_kwargs()`` has
            ``offload_optimizer_device_dtype`` too.
        batch_size: plan for ``batch`` with dim 0 of its batch tensors at this size (as
            ``max_batch_size`` scales it); None: the batch as given.
        sequence_length: plan for ``batch`` with its sequence at this length (as
            ``max_sequence_length`` grows it: every batch tensor whose size along the sequence's
            dimension is the batch's length); None: as given.
        seq_dim: the sequence's dimension in the batch's tensors; None: dimension 1 of its token
            ids ``[B, T]`` or vectors ``[B, T, d]`` (``lightmem.estimate.trace.batch.sequence_axis``).
        tile: True: the plan may run position-wise modules in sequence shards (``LightMem(tile=...)``):
            the modules the baseline's trace shows never mix positions (``MemoryEstimate.tile_candidates``;
            none in a compiled model). Exact within 1e-6 in fp32, not bitwise: False (default) never tiles.
        host_budget: the host memory the plan may hold in all (the offloaded activations' pool and,
            with model-state offload, the host copies of parameters, gradients and optimizer
            state): bytes, a size ("1TiB"), or a fraction of this machine's available RAM. None:
            this machine's available RAM when the plan is for this machine (``device="cpu"``, or a
            CUDA device here), else no limit. A configuration that holds more is not taken; when
            every one that fits the device does, the plan does not fit and ``limited_by`` is "host".
        Other arguments: as for :func:`estimate_memory`.

    On "cpu" only checkpointing is planned (offloading CPU memory to CPU memory saves nothing).

    Returns:
        A :class:`Plan`; ``describe()`` says what was chosen, what else fitted and why;
        ``step_seconds`` is its predicted step time. ``plan.fits`` is False with a ``reason`` when
        the parameters (and, unless they can go to the host, gradients and optimizer state)
        alone exceed the budget or no configuration in the space gets under it.

    Raises:
        ValueError: a bad argument (named in the message).
    """
    started = time.perf_counter()
    settings = parse_settings(
        "plan", model, loss_fn, optimizer=optimizer, precision=precision, device=device, gpu=gpu,
        overhead_bytes=overhead_bytes, budget=budget, zero_grad=zero_grad, checkpoint_policy=checkpoint_policy,
        offload_optimizer=offload_optimizer, flops_per_s=flops_per_s, link_bytes_per_s=link_bytes_per_s,
        auto_policy=True, tile=tile, host_budget=host_budget,
    )  # fmt: skip
    settings = settings.searching(parse_planned_offload(True if offload is None else offload, flag="plan(offload=...)"))
    sequence = None
    if sequence_length is not None:
        parse_count(sequence_length, flag="plan(sequence_length=...)")
        sequence = sequence_axis(batch, seq_dim, fn_name="plan").grown(sequence_length)
    return plan_for(model, batch, settings, batch_size=batch_size, sequence=sequence, started=started)


def plan_for(
    model: nn.Module, batch: Any, settings: EstimateSettings, *, batch_size: int | None = None,
    sequence: tuple[int, int, int] | None = None, started: float | None = None,
) -> Plan:  # fmt: skip
    """``plan`` with its arguments parsed (``settings``): the plan, its advice written into its
    estimate, and, where no configuration fits and the loss's logits dominate the step, the same
    plan with the loss priced as chunked (``Plan.chunked_loss``)."""
    started = time.perf_counter() if started is None else started
    result, space = planned(model, batch, settings, batch_size=batch_size, sequence=sequence, started=started)
    space.base.advice = advise(space.base, space.info, space.baseline, result)
    if not result.fits and dominant_logits(result.estimate, priced_as_chunked=settings.loss_as_chunked) is not None:
        # The what-if says whether the chunked loss fits and at what step, under "full" where the plan
        # chooses its policy: a fit with the loss chunked plans again, the policy with it.
        what_if = settings.priced_as_chunked()
        if what_if.checkpoint_policy == AUTO_POLICY:
            what_if = what_if.with_policy("full")
        result.chunked_loss = plan_for(model, batch, what_if, batch_size=batch_size, sequence=sequence)
    result.seconds = time.perf_counter() - started
    return result
