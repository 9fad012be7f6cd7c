"""The estimator's and planner's flags (``estimate_memory``, ``plan``, ``max_batch_size``, ``frontier``,
``lightmem estimate``): precision, device, optimizer, overhead allowance, zero_grad order, offload
as a dict, checkpoint targets and the prices a plan is made at.

Each ``parse_*`` turns what the user wrote into a plain value and fails with a ``ValueError`` that
names the argument (``estimate_memory(precision=...)``) and lists what is accepted. The settings
object an entry point passes down is built from them once
(``lightmem.estimate.settings.EstimateSettings.parse``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightmem.config.checkpointing import parse_checkpoint_targets
from lightmem.config.offload import OffloadSettings
from lightmem.config.spelling import Spelling
from lightmem.config.units import parse_size


@dataclass(frozen=True)
class PlanPrices:
    """Prices given instead of the device's own: a matrix throughput for every dtype and the host
    link speed per second, each way (``plan(flops_per_s=..., link_bytes_per_s=...)``,
    ``--link-bytes-per-s``); None: the device's (``lightmem.devices``)."""

    flops_per_s: float | None
    link_bytes_per_s: int | None

    @classmethod
    def parse(
        cls, *, flops_per_s: float | None, link_bytes_per_s: int | str | None, spelling: Spelling
    ) -> PlanPrices:
        """Validate both; ``ValueError`` names the flag as ``spelling`` spells it."""
        flag = spelling.flag
        link = None
        if link_bytes_per_s is not None:
            link = parse_size(link_bytes_per_s, flag=flag("link_bytes_per_s"))
            if link <= 0:
                raise ValueError(f"{flag('link_bytes_per_s')}: must be positive; got {link_bytes_per_s!r}")
        if flops_per_s is not None and (isinstance(flops_per_s, bool) or not float(flops_per_s) > 0):
            raise ValueError(f"{flag('flops_per_s')}: must be positive; got {flops_per_s!r}")
        return cls(flops_per_s=None if flops_per_s is None else float(flops_per_s), link_bytes_per_s=link)


DEFAULT_CUDA_OVERHEAD = "1GiB"


@dataclass(frozen=True)
class Precision:
    """Lightning precision flag, as the estimator runs it."""

    name: str
    autocast_dtype: torch.dtype | None
    """Mixed precision: forward under ``torch.autocast`` with this dtype."""
    param_dtype: torch.dtype | None
    """True half/double precision: parameters, buffers and float inputs in this dtype."""


_PRECISIONS = {
    "32-true": Precision("32-true", None, None),
    "64-true": Precision("64-true", None, torch.float64),
    "16-mixed": Precision("16-mixed", torch.float16, None),
    "bf16-mixed": Precision("bf16-mixed", torch.bfloat16, None),
    "16-true": Precision("16-true", None, torch.float16),
    "bf16-true": Precision("bf16-true", None, torch.bfloat16),
}


# Lightning's short spellings.
_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def parse_precision(value: str | int, *, flag: str) -> Precision:
    """Lightning's precision strings ("32-true", "bf16-mixed", ...) and their short forms."""
    key = str(value).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _PRECISIONS:
        accepted = ", ".join(list(_PRECISIONS) + list(_ALIASES))
        raise ValueError(f"{flag}: unknown precision {value!r}; accepted: {accepted}")
    return _PRECISIONS[key]


def parse_device(value: str | torch.device, *, flag: str) -> str:
    """'cuda' or 'cpu' (an index such as 'cuda:1' is accepted and dropped)."""
    try:
        kind = torch.device(value).type if isinstance(value, (str, torch.device)) else None
    except RuntimeError:  # not a device string torch knows
        kind = None
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"{flag}: expected 'cuda' or 'cpu'; got {value!r}")
    return kind


OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def _optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    classes = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        # LBFGS needs a closure and SparseAdam sparse gradients: neither runs a plain step.
        if (
            isinstance(cls, type)
            and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer
            and name not in ("LBFGS", "SparseAdam")
        ):
            classes[name.lower()] = cls
    return classes


@dataclass(frozen=True)
class OptimizerChoice:
    name: str
    factory: OptimizerFactory | None
    """None: the LightningModule's ``configure_optimizers``."""


@functools.cache
def _named_factory(name: str) -> OptimizerFactory:
    """One factory per torch.optim name, the same object at every parse: the planner's memory of
    verified steps keys on it (a factory made at each call would match no step planned before)."""
    cls = _optimizer_classes()[name]
    return lambda params: cls(params, lr=1e-3)


def parse_optimizer(value: str | OptimizerFactory | None, *, flag: str) -> OptimizerChoice:
    """A torch.optim name ("adamw", "sgd", ...), a callable ``params -> Optimizer``, or None."""
    if value is None:
        return OptimizerChoice("configure_optimizers", None)
    if callable(value) and not isinstance(value, str):
        name = getattr(value, "__name__", type(value).__name__)
        return OptimizerChoice(name, value)
    classes = _optimizer_classes()
    if isinstance(value, str) and value.strip().lower() in classes:
        name = value.strip().lower()
        return OptimizerChoice(name, _named_factory(name))
    accepted = ", ".join(sorted(classes))
    raise ValueError(
        f"{flag}: unknown optimizer {value!r}; accepted: {accepted}, or a callable "
        "params -> torch.optim.Optimizer"
    )


_OFFLOAD_KEYS = ("min_bytes", "include", "exclude", "prefetch", "max_inflight_bytes", "host_budget")


def parse_offload(
    value: bool | Mapping[str, Any] | OffloadSettings | None, *, flag: str
) -> OffloadSettings | None:
    """``None``/``False`` (no offload), ``True`` (lightmem's defaults), a dict, or settings already
    parsed (``LightMem``'s, the CLI's: used as they are).

    The dict takes the keys of ``offload_activations`` and is parsed by the engine's own
    :meth:`OffloadSettings.parse`, with its defaults: ``min_bytes`` ("1MiB"), ``include`` /
    ``exclude`` (module patterns), ``prefetch`` ("256MiB"), ``max_inflight_bytes`` ("256MiB").
    ``host_budget`` (bytes) has no default: the host of the target machine is not this one.
    """
    if value is None or value is False:
        return None
    if isinstance(value, OffloadSettings):
        return value
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{flag}: expected None, True or a dict with keys {', '.join(_OFFLOAD_KEYS)}; got {value!r}"
        )
    unknown = sorted(set(value) - set(_OFFLOAD_KEYS))
    if unknown:
        raise ValueError(
            f"{flag}: unknown key(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(_OFFLOAD_KEYS)}"
        )
    return OffloadSettings.for_estimate(spelling=Spelling(flag, style="key"), **value)


def parse_planned_offload(
    value: bool | Mapping[str, Any] | OffloadSettings | None, *, flag: str
) -> OffloadSettings | None:
    """``parse_offload`` for a function that plans (``plan``, ``frontier``): the plan chooses the
    modules to offload, so an ``include`` is refused."""
    settings = parse_offload(value, flag=flag)
    if settings is not None and settings.include is not None:
        raise ValueError(f"{settings.flag('include')}: the plan chooses the modules to offload itself; leave it unset")
    return settings


def parse_checkpoint(value: Iterable[str | type] | str | None, *, flag: str) -> tuple[str | type, ...] | None:
    """Checkpoint targets as ``apply_checkpointing`` takes them (names, classes, globs); None: none."""
    return None if value is None else parse_checkpoint_targets(value, flag=flag)


def parse_overhead(value: int | str | None, device: str, *, flag: str) -> int:
    """Bytes set aside for what the caching allocator does not count (the CUDA context, NCCL
    buffers): default 1 GiB on CUDA, 0 on CPU."""
    if value is None:
        value = DEFAULT_CUDA_OVERHEAD if device == "cuda" else 0
    return parse_size(value, flag=flag)


ZERO_GRAD_ORDERS = ("after_forward", "before_forward")


def parse_zero_grad(value: str, *, flag: str) -> str:
    """Where the step sets gradients to None: "after_forward" (Lightning's automatic
    optimization) or "before_forward" (a plain loop: zero_grad, forward, backward, step)."""
    if value not in ZERO_GRAD_ORDERS:
        raise ValueError(f"{flag}: expected one of {', '.join(map(repr, ZERO_GRAD_ORDERS))}; got {value!r}")
    return value
