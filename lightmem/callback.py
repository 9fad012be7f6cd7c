"""``LightMem``: one callback that offloads, checkpoints and shows where memory goes."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import psutil
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightmem import oom
from lightmem.checkpoint import (
    CheckpointHandle,
    CheckpointPolicyArg,
    apply_checkpointing,
    existing_checkpointing,
    parse_checkpoint_policy,
    select_blocks,
)
from lightmem.config import (
    format_bytes,
    host_ram_share_bytes,
    parse_devices,
    parse_fraction,
    parse_patterns,
    parse_size,
    total_ram_bytes,
    warn_once,
)
from lightmem.host_guard import HostGuard, batches_loaded_ahead
from lightmem.metrics.names import BY_KEY, GROUPS, GiB, key
from lightmem.metrics.probes import (
    HostProbe,
    LightmemProbe,
    NvmlProbe,
    ProbeUnavailable,
    TorchAllocatorProbe,
)
from lightmem.metrics.ranks import RankMax
from lightmem.metrics.tensorboard import custom_scalars_layout
from lightmem.offload.context import (
    DEFAULT_HOST_BUDGET,
    DEFAULT_HOST_MIN_AVAILABLE,
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH,
    ActivationOffloader,
)

log = logging.getLogger(__name__)


def _flag(name: str) -> str:
    return f"LightMem({name}=...)"


class LightMem(Callback):
    r"""Train models that do not fit in GPU memory, and log where every byte goes.

    Activation offload wraps every training forward; selective checkpointing is applied to the chosen
    blocks before the strategy wraps the model; memory metrics go to every logger of the Trainer.
    Validation, testing and prediction run untouched.

    Args:
        offload: move saved activations to host memory during each training forward.
        offload_min_bytes: only offload saved tensors whose storage is at least this big.
        offload_include: module-name globs (or class names); when given, only tensors saved inside
            them are offloaded.
        offload_exclude: module-name globs (or class names) whose saved tensors stay on the device.
        offload_devices: device types whose saved tensors move (default ``["cuda"]``).
        host_budget: hard cap on host bytes for offload: bytes, a size string, or a fraction of
            available RAM (default 0.5), shared by the ranks of a node (each takes fraction / ranks).
        host_min_available: when the machine's available RAM falls under this (bytes, a size string
            or a fraction of total RAM, default 0.10), stop offloading, give cached host buffers back,
            and warn once, instead of letting the host OOM killer end the job.
        prefetch_bytes: bytes of reloads kept in flight ahead of backward (0: no prefetch).
        checkpoint: blocks to recompute in backward: class names (subclasses match too, e.g. FSDP2's
            ``FSDP<Name>``) or module-name globs.
        checkpoint_every: checkpoint every n-th matched block.
        checkpoint_policy: what a checkpointed block keeps: ``"full"`` (its inputs only),
            ``"save_matmuls"`` (also matmul, convolution and attention outputs) or a callable
            per-op policy; see :func:`~lightmem.apply_checkpointing`.
        log_every_n_steps: log metrics every n optimizer steps, starting with the first (default:
            the Trainer's ``log_every_n_steps``).
        metrics: probe groups to log: any of ``"gpu"`` (PyTorch allocator), ``"device"`` (NVML),
            ``"host"`` (psutil), ``"lightmem"`` (offload traffic, checkpointed blocks).
        tensorboard_panels: write ready-made panels to the Custom Scalars tab of TensorBoard loggers.
        oom_snapshot: path for a ``torch.cuda.memory`` snapshot (for https://pytorch.org/memory_viz)
            dumped when training runs out of GPU memory; records allocation history (Python stacks)
            from the start. With several ranks each writes its own file (``oom.rank3.pickle``).
        plan: ``"auto"``: at the first training batch, ``lightmem.plan`` picks the blocks to
            checkpoint and to offload so the step fits ``device_budget`` (a fake-tensor dry run of
            the LightningModule, seconds), and LightMem applies that choice.
        device_budget: device memory the step must fit in with ``plan="auto"``.
        host_limit: the host memory limit the guard watches: ``"auto"`` (the tightest of the
            process's cgroup limit and total RAM), bytes, a size string, or a fraction of total RAM.
        host_warn_at: fraction of ``host_limit`` at which one warning says what holds host memory,
            how fast it grows and how many batches are left.
        host_stop_at: fraction of ``host_limit`` at which training stops cleanly (cached host
            buffers released first, then a checkpoint saved and ``trainer.should_stop`` set);
            None: never stop, only warn. The rest of the limit is the margin for saving.
        host_stop_checkpoint: where that checkpoint goes (default
            ``<trainer.default_root_dir>/lightmem-host-stop.ckpt``).

    Raises:
        ValueError: at construction, for a flag with a bad value; the message names the flag and
            what it accepts. Module patterns that match nothing fail when training starts.

    Example::

        from pytorch_lightning import Trainer
        from lightmem import LightMem

        trainer = Trainer(callbacks=[LightMem(offload_min_bytes="1MiB", checkpoint=["Block"],
                                              host_budget="64GiB")])
    """

    def __init__(
        self,
        offload: bool = True,
        offload_min_bytes: int | str = DEFAULT_MIN_BYTES,
        offload_include: list[str] | None = None,
        offload_exclude: list[str] | None = None,
        offload_devices: Sequence[str] = ("cuda",),
        host_budget: int | float | str = DEFAULT_HOST_BUDGET,
        host_min_available: int | float | str = DEFAULT_HOST_MIN_AVAILABLE,
        prefetch_bytes: int | str = DEFAULT_PREFETCH,
        checkpoint: list[str] | str | None = None,
        checkpoint_every: int = 1,
        checkpoint_policy: CheckpointPolicyArg = "full",
        log_every_n_steps: int | None = None,
        metrics: Sequence[str] = GROUPS,
        tensorboard_panels: bool = True,
        oom_snapshot: str | None = None,
        plan: str | None = None,
        device_budget: int | str | None = None,
        host_limit: int | float | str = "auto",
        host_warn_at: float = 0.85,
        host_stop_at: float | None = 0.95,
        host_stop_checkpoint: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("offload", offload), ("tensorboard_panels", tensorboard_panels)):
            if not isinstance(value, bool):
                raise ValueError(f"{_flag(name)}: expected True or False; got {value!r}")
        self.offload = offload
        self.offload_min_bytes = parse_size(offload_min_bytes, flag=_flag("offload_min_bytes"))
        self.offload_include = parse_patterns(offload_include, flag=_flag("offload_include"))
        self.offload_exclude = parse_patterns(offload_exclude, flag=_flag("offload_exclude"))
        self.offload_devices = parse_devices(offload_devices, flag=_flag("offload_devices"))
        self.host_budget = host_budget
        self.host_budget_bytes = parse_size(host_budget, flag=_flag("host_budget"), fraction_of=host_ram_share_bytes)
        self.host_min_available_bytes = parse_size(
            host_min_available, flag=_flag("host_min_available"), fraction_of=total_ram_bytes,
            fraction_name="total RAM",
        )  # fmt: skip
        self.prefetch_bytes = parse_size(prefetch_bytes, flag=_flag("prefetch_bytes"))
        self.checkpoint = list(parse_patterns(checkpoint, flag=_flag("checkpoint")) or ())
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"{_flag('checkpoint_every')}: expected an integer >= 1; got {checkpoint_every!r}")
        self.checkpoint_every = checkpoint_every
        self.checkpoint_policy = parse_checkpoint_policy(checkpoint_policy, flag=_flag("checkpoint_policy"))
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                f"{_flag('log_every_n_steps')}: expected an integer >= 1 or None; got {log_every_n_steps!r}"
            )
        self.log_every_n_steps = log_every_n_steps
        try:
            groups = (metrics,) if isinstance(metrics, str) else tuple(metrics)
        except TypeError:
            raise ValueError(
                f"{_flag('metrics')}: expected a list of probe groups from {', '.join(GROUPS)}; got {metrics!r}"
            ) from None
        unknown = [group for group in groups if group not in GROUPS]
        if unknown:
            raise ValueError(
                f"{_flag('metrics')}: unknown probe group {unknown[0]!r}; accepted: {', '.join(GROUPS)}"
            )
        self.metrics = groups
        self.tensorboard_panels = tensorboard_panels
        if oom_snapshot is not None and not isinstance(oom_snapshot, str):
            raise ValueError(f"{_flag('oom_snapshot')}: expected a file path or None; got {oom_snapshot!r}")
        self.oom_snapshot = oom_snapshot
        if plan not in (None, "auto"):
            raise ValueError(f"{_flag('plan')}: expected None or 'auto'; got {plan!r}")
        self.plan = plan
        self.device_budget_bytes = (
            parse_size(device_budget, flag=_flag("device_budget")) if device_budget is not None else None
        )
        if plan == "auto":
            if self.device_budget_bytes is None:
                raise ValueError(f"{_flag('plan')}: 'auto' needs device_budget, e.g. LightMem(plan='auto', device_budget='20GiB')")
            if self.checkpoint or self.offload_include is not None:
                raise ValueError(
                    f"{_flag('plan')}: 'auto' chooses checkpoint and offload_include itself; leave them unset"
                )
        try:
            self.host_limit_bytes = (
                None
                if host_limit == "auto"
                else parse_size(host_limit, flag=_flag("host_limit"), fraction_of=total_ram_bytes, fraction_name="total RAM")
            )
        except ValueError as error:
            raise ValueError(str(error).replace("expected ", "expected 'auto' (cgroup limit or total RAM), ", 1)) from None
        self.host_warn_at = parse_fraction(host_warn_at, flag=_flag("host_warn_at"))
        self.host_stop_at = parse_fraction(host_stop_at, flag=_flag("host_stop_at"), allow_none=True)
        if self.host_stop_at is not None and self.host_stop_at < self.host_warn_at:  # type: ignore[operator]
            raise ValueError(f"{_flag('host_stop_at')}: must be >= host_warn_at ({host_warn_at}); got {host_stop_at!r}")
        if host_stop_checkpoint is not None and not isinstance(host_stop_checkpoint, str):
            raise ValueError(f"{_flag('host_stop_checkpoint')}: expected a file path or None; got {host_stop_checkpoint!r}")
        self.host_stop_checkpoint = host_stop_checkpoint
        self._host_guard: HostGuard | None = None
        self.chosen_plan: Any = None
        """With plan='auto': the ``lightmem.estimate.Plan`` chosen from the first training batch."""

        self._offloader: ActivationOffloader | None = None
        self._checkpoint_handle: CheckpointHandle | None = None
        self._patched_module: pl.LightningModule | None = None
        self._probes: list[Any] = []
        self._rank_max = RankMax()
        self._traffic: LightmemProbe | None = None
        self._last_step = -1
        self.last_metrics: dict[str, float] = {}
        """The metrics of the last logged step, as logged (with DDP: the max over ranks)."""
        self.last_local_metrics: dict[str, float] = {}
        """The same figures for this process alone."""
        self._peaks: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        self._steps_seen = 0
        self._below_floor = False

    # -- checkpointing, before the strategy wraps the model --------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # A fractional host_budget is shared by this node's ranks (Lightning sets no LOCAL_WORLD_SIZE).
        self.host_budget_bytes = parse_size(
            self.host_budget, flag=_flag("host_budget"),
            fraction_of=lambda: host_ram_share_bytes(trainer.num_devices),
        )  # fmt: skip
        if not self.checkpoint:
            return
        # Lightning calls configure_model after this hook and before strategy.setup wraps the model;
        # applying right after it also finds blocks that configure_model creates.
        original = pl_module.configure_model

        def configure_model_then_checkpoint() -> None:
            original()
            self._apply_checkpointing(trainer, pl_module, self.checkpoint, self.checkpoint_every)

        pl_module.configure_model = configure_model_then_checkpoint  # type: ignore[method-assign]
        self._patched_module = pl_module

    def _apply_checkpointing(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, targets: list[str], every_n: int
    ) -> None:
        if self._checkpoint_handle is not None:
            return
        reason = existing_checkpointing(trainer.strategy, pl_module)
        if reason is not None:
            rank_zero_warn(
                f"lightmem: not applying LightMem(checkpoint={targets!r}) because {reason}; "
                "checkpointing twice would recompute twice."
            )
            return
        select_blocks(  # fails with this callback's flag names before anything is wrapped
            pl_module, targets, every_n, targets_flag=_flag("checkpoint"), every_n_flag=_flag("checkpoint_every")
        )
        self._checkpoint_handle = apply_checkpointing(
            pl_module, targets, every_n, self.checkpoint_policy, policy_flag=_flag("checkpoint_policy")
        )
        rank_zero_info(
            f"lightmem: checkpointing {len(self._checkpoint_handle)} blocks: "
            f"{', '.join(self._checkpoint_handle.modules[:6])}{' ...' if len(self._checkpoint_handle) > 6 else ''}"
        )

    # -- offload and probes ----------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plan == "auto":  # every fit plans for its own first batch
            self.chosen_plan = None
        self._offloader = None if self.plan == "auto" else self._build_offloader(pl_module)
        self._probes = self._build_probes(pl_module)
        self._host_guard = HostGuard(self.host_limit_bytes, self.host_warn_at, self.host_stop_at, self._host_bytes_held)  # type: ignore[arg-type]
        if "host" in self.metrics:
            self._probes.append(self._host_guard)
        self._last_step = trainer.global_step
        self._peaks, self._totals, self._steps_seen = {}, {}, 0
        if self.tensorboard_panels and trainer.is_global_zero:
            layout = custom_scalars_layout(self._enabled_groups())
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(layout)
        if self.oom_snapshot:
            oom.record_memory_history()

    def _build_offloader(
        self, pl_module: pl.LightningModule, min_bytes: int | None = None, include: tuple[str, ...] | None = None
    ) -> ActivationOffloader | None:
        planned = min_bytes is not None
        if not self.offload and not planned:
            return None
        if self.offload_devices == ("cuda",) and not torch.cuda.is_available():
            rank_zero_info(
                "lightmem: no CUDA device, so activation offload is off (moving CPU tensors to host "
                "memory gains nothing); checkpointing and host metrics are on."
            )
            return None
        return ActivationOffloader(
            pl_module,
            min_bytes=min_bytes if planned else self.offload_min_bytes,
            devices=self.offload_devices,
            include=include if planned else self.offload_include,
            exclude=self.offload_exclude,
            host_budget=self.host_budget_bytes,
            prefetch=self.prefetch_bytes,
            host_min_available=self.host_min_available_bytes,
            flag_names={
                "min_bytes": _flag("offload_min_bytes"),
                "devices": _flag("offload_devices"),
                "include": _flag("offload_include"),
                "exclude": _flag("offload_exclude"),
                "host_budget": _flag("host_budget"),
                "prefetch": _flag("prefetch_bytes"),
                "host_min_available": _flag("host_min_available"),
            },
        )

    def _build_probes(self, pl_module: pl.LightningModule) -> list[Any]:
        probes: list[Any] = []
        device = pl_module.device
        self._traffic = None
        for group in self.metrics:
            try:
                if group == "gpu":
                    probes.append(TorchAllocatorProbe(device))
                elif group == "device":
                    probes.append(NvmlProbe(device))
                elif group == "host":
                    probes.append(HostProbe(self._host_bytes_held, self._host_bytes_peak_in_use))
                elif group == "lightmem":
                    self._traffic = LightmemProbe(self._checkpointed_blocks)
                    probes.append(self._traffic)
            except ProbeUnavailable as error:
                rank_zero_info(f"lightmem: {group!r} memory metrics are off: {error}.")
        return probes

    def _enabled_groups(self) -> list[str]:
        return [probe.group for probe in self._probes]

    def _host_bytes_held(self) -> int:
        return self._offloader.host_bytes_held if self._offloader is not None else 0

    def _host_bytes_peak_in_use(self) -> int:
        return self._offloader.host_bytes_peak_in_use if self._offloader is not None else 0

    def _checkpointed_blocks(self) -> int:
        return len(self._checkpoint_handle) if self._checkpoint_handle is not None else 0

    # -- one training step -----------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._host_guard is not None:
            self._host_guard.batches_ahead = batches_loaded_ahead(trainer.train_dataloader)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.plan == "auto" and self.chosen_plan is None:
            self._plan_from(trainer, pl_module, batch)
        offloader = self._offloader
        if offloader is None:
            return
        if psutil.virtual_memory().available < self.host_min_available_bytes:
            if not self._below_floor:
                warn_once(
                    f"lightmem: available host memory fell under host_min_available "
                    f"({format_bytes(self.host_min_available_bytes)}); offload is paused and cached host "
                    "buffers were released so the host OOM killer does not end the job."
                )
            self._below_floor = True
            offloader.release_host_memory()
            return
        self._below_floor = False
        self._exit_offload()
        offloader.__enter__()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # Automatic optimization calls backward after training_step returns; manual optimization
        # from inside it. Either way the forward is over: leave the hooks before backward runs.
        self._exit_offload()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._exit_offload()  # training_step returned None: no backward ran
        self._guard_host(trainer)
        if self._offloader is not None and self._traffic is not None and not self._below_floor:
            self._traffic.add(self._offloader.stats)
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: the optimizer has not stepped yet
        self._last_step = trainer.global_step
        self._end_of_step(trainer, pl_module)

    def _guard_host(self, trainer: pl.Trainer) -> None:
        # Every batch, not only logged steps: memory that grows per batch outruns any logging interval.
        guard = self._host_guard
        if guard is None:
            return
        verdict = guard.check()
        if verdict == "stop" and self._offloader is not None:
            self._offloader.release_host_memory()
            verdict = guard.recheck()
        if trainer.world_size > 1:  # every rank saves and stops, or none (save_checkpoint is collective)
            stop = trainer.strategy.reduce_boolean_decision(verdict == "stop", all=False)
            verdict = "stop" if stop else verdict
        if verdict == "warn":  # from every rank: each watches its own host
            warnings.warn(guard.warning_message(), UserWarning, stacklevel=2)
        elif verdict == "stop":
            guard.stopped = True
            path = self.host_stop_checkpoint or os.path.join(trainer.default_root_dir, "lightmem-host-stop.ckpt")
            error: BaseException | None = None
            try:
                trainer.save_checkpoint(path)
            except Exception as save_error:  # the job still stops rather than be killed
                error = save_error
            trainer.should_stop = True
            print(guard.stop_message(path, error), file=sys.stderr, flush=True)

    def _plan_from(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        from lightmem.estimate import plan

        # The dry run calls training_step on fake tensors; its self.log calls must not reach the
        # Trainer's results.
        pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
        try:
            chosen = plan(
                pl_module, batch, self.device_budget_bytes, device=pl_module.device.type,
                precision=str(trainer.precision), offload_min_bytes=self.offload_min_bytes,
                checkpoint_policy=self.checkpoint_policy,
            )  # fmt: skip
        finally:
            del pl_module.log, pl_module.log_dict
        self.chosen_plan = chosen
        summary = (
            f"lightmem: plan for a {format_bytes(chosen.budget_bytes)} device budget: checkpoint "
            f"{chosen.checkpoint or 'nothing'}, offload {chosen.offload['include'] if chosen.offload else 'nothing'}; "
            f"predicted peak {format_bytes(chosen.predicted_total_bytes)}"
        )
        if chosen.fits:
            rank_zero_info(summary)
        else:
            rank_zero_warn(f"{summary}. It does not fit: {chosen.reason}")
        if chosen.checkpoint:
            self._apply_checkpointing(trainer, pl_module, list(chosen.checkpoint), every_n=1)
        self._offloader = None
        if chosen.offload is not None:
            self._offloader = self._build_offloader(
                pl_module,
                min_bytes=parse_size(chosen.offload["min_bytes"], flag=_flag("offload_min_bytes")),
                include=tuple(chosen.offload["include"]),
            )

    def _exit_offload(self) -> None:
        if self._offloader is not None and self._offloader.active:
            self._offloader.__exit__(None, None, None)

    def _end_of_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Probes run on logged steps only (the host probe costs ~0.1-0.4 ms); the per-step traffic
        # totals of the summary are plain attribute reads.
        self._steps_seen += 1
        traffic = self._traffic
        if traffic is not None:
            self._totals["offloaded_bytes"] = self._totals.get("offloaded_bytes", 0) + traffic.offloaded_bytes
            self._totals["wait_s"] = self._totals.get("wait_s", 0.0) + traffic.wait_s
        every = self.log_every_n_steps or trainer.log_every_n_steps
        logged = (trainer.global_step - 1) % every == 0
        values: dict[str, float] = {}
        for probe in self._probes:
            if logged:
                values.update(probe.collect())
            probe.end_step()
        if not logged:
            return
        for name in _SUMMARY_PEAKS.values():
            if name in values:
                self._peaks[name] = max(self._peaks.get(name, 0.0), values[name])
        self.last_local_metrics = values
        values = self._max_over_ranks(trainer, pl_module, values)
        self.last_metrics = values
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)

    def _max_over_ranks(self, trainer: pl.Trainer, pl_module: pl.LightningModule, values: dict[str, float]) -> dict[str, float]:
        if trainer.world_size <= 1:
            return values
        names = [name for name in values if BY_KEY[name].reduce_max]
        reduced = self._rank_max([values[name] for name in names])  # CPU tensors over gloo: no GPU sync
        return {**values, **dict(zip(names, reduced))}

    # -- leaving -----------------------------------------------------------------------------------

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_offload()  # never leave hooks active into validation

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A LightningModule.on_train_batch_start returning -1 ends the epoch without
        # on_train_batch_end: the hooks entered for that batch must not outlive it.
        self._exit_offload()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_offload()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._offloader is not None and self._offloader.active:  # it words torch.func's error itself
            self._offloader.__exit__(type(exception), exception, exception.__traceback__)
        if isinstance(exception, torch.cuda.OutOfMemoryError) or "out of memory" in str(exception).lower():
            print(self.oom_report(trainer, pl_module))
            written = None
            if self.oom_snapshot:
                written = oom.dump_snapshot(self.oom_snapshot, trainer.global_rank, trainer.world_size)
            if written is not None:
                print(f"lightmem: memory snapshot written to {written} (open it at https://pytorch.org/memory_viz)")
        # Lightning does not call teardown after an exception: undo everything here.
        self._undo()

    def oom_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """What was on the device, the last metrics, and the flags that would help."""
        offloader = self._offloader
        breakdown = oom.device_breakdown(
            pl_module, trainer.optimizers, pl_module.device, offloader.resident_bytes if offloader else 0
        )
        if offloader is not None:
            breakdown["host_buffers_held_by_lightmem"] = offloader.host_bytes_held
        lines = oom.advice(
            offload=offloader is not None,
            offload_min_bytes=self.offload_min_bytes,
            checkpointed_blocks=self._checkpointed_blocks(),
            repeated_block=oom.repeated_block_class(pl_module),
            breakdown=breakdown,
        )
        return oom.render(breakdown, self.last_metrics, lines)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = self.summary()
        if not summary or not trainer.is_global_zero:
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title="lightmem: memory summary of this fit")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for name, value in summary.items():
            table.add_row(name, value)
        Console().print(table)
        for logger in trainer.loggers:
            logger.log_hyperparams({f"lightmem/summary/{name}": value for name, value in summary.items()})

    def summary(self) -> dict[str, str]:
        """Readable end-of-fit figures: peaks over the logged steps, traffic and waits per step
        (over every step), checkpointed blocks."""
        figures: dict[str, str] = {}
        for label, name in _SUMMARY_PEAKS.items():
            if name in self._peaks and (self._offloader is not None or name != key("host/pinned_GiB")):
                figures[label] = format_bytes(self._peaks[name] * GiB)
        steps = max(self._steps_seen, 1)
        if self._offloader is not None and "offloaded_bytes" in self._totals:
            figures["offloaded per step"] = format_bytes(self._totals["offloaded_bytes"] / steps)
            figures["compute waited per step"] = f"{self._totals['wait_s'] / steps * 1e3:.2f} ms"
        if self._checkpoint_handle is not None:
            figures["blocks checkpointed"] = str(len(self._checkpoint_handle))
        return figures

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._undo()

    def _undo(self) -> None:
        """Leave the model and the process as they were before fit: no wrapper, patch or hooks."""
        try:
            self._exit_offload()
        finally:
            self._undo_model()

    def _undo_model(self) -> None:
        if self._checkpoint_handle is not None:
            self._checkpoint_handle.remove()
            self._checkpoint_handle = None
        if self._patched_module is not None:
            self._patched_module.__dict__.pop("configure_model", None)
            self._patched_module = None
        if self._offloader is not None:
            self._offloader.release_host_memory()
            self._offloader = None
        # Probes hold psutil processes (with locks): after fit the callback pickles and deep-copies.
        if self._host_guard is not None:
            self._host_guard.close()
        self._probes, self._traffic, self._host_guard = [], None, None
        if self.oom_snapshot:
            oom.stop_memory_history()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}


_SUMMARY_PEAKS = {
    "peak GPU allocated": key("gpu/step_peak_allocated_GiB"),
    "peak GPU reserved": key("gpu/reserved_GiB"),
    "peak device used (NVML)": key("device/used_GiB"),
    "peak host RSS": key("host/rss_GiB"),
    "peak host buffers held": key("host/pinned_GiB"),
}
