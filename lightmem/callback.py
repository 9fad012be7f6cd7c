"""``LightMem``: one callback that offloads, checkpoints and shows where memory goes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
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
    DEFAULT_HOST_BUDGET,
    DEFAULT_HOST_MIN_AVAILABLE,
    DEFAULT_MIN_BYTES,
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_PREFETCH,
    OffloadSettings,
    format_bytes,
    parse_bool,
    parse_choices,
    parse_count,
    parse_fraction,
    parse_host_limit,
    parse_path,
    parse_patterns,
    parse_size,
)
from lightmem.estimate import plan
from lightmem.host_guard import HostGuard, batches_loaded_ahead
from lightmem.metrics.names import GROUPS
from lightmem.metrics.recorder import MetricsRecorder, build_probes
from lightmem.offload.context import ActivationOffloader
from lightmem.offload.training import TrainingOffload


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
        offload_max_inflight_bytes: most bytes of saved tensors held on the device while their copy
            to host runs (default 256 MiB); past it compute waits for the oldest copy.
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
        offload_max_inflight_bytes: int | str = DEFAULT_MAX_INFLIGHT,
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
        self.offload = parse_bool(offload, flag=_flag("offload"))
        self.offload_settings = OffloadSettings.parse(
            min_bytes=offload_min_bytes, devices=offload_devices, include=offload_include, exclude=offload_exclude,
            host_budget=host_budget, prefetch=prefetch_bytes, max_inflight_bytes=offload_max_inflight_bytes,
            host_min_available=host_min_available, owner="LightMem",
        )  # fmt: skip
        self.checkpoint = list(parse_patterns(checkpoint, flag=_flag("checkpoint")) or ())
        self.checkpoint_every = parse_count(checkpoint_every, flag=_flag("checkpoint_every"))
        self.checkpoint_policy = parse_checkpoint_policy(checkpoint_policy, flag=_flag("checkpoint_policy"))
        self.log_every_n_steps = parse_count(log_every_n_steps, flag=_flag("log_every_n_steps"), allow_none=True)
        self.metrics = parse_choices(metrics, flag=_flag("metrics"), accepted=GROUPS, what="probe group")
        self.tensorboard_panels = parse_bool(tensorboard_panels, flag=_flag("tensorboard_panels"))
        self.oom_snapshot = parse_path(oom_snapshot, flag=_flag("oom_snapshot"))
        if plan not in (None, "auto"):
            raise ValueError(f"{_flag('plan')}: expected None or 'auto'; got {plan!r}")
        self.plan = plan
        self.device_budget_bytes = (
            parse_size(device_budget, flag=_flag("device_budget")) if device_budget is not None else None
        )
        if plan == "auto":
            if self.device_budget_bytes is None:
                raise ValueError(f"{_flag('plan')}: 'auto' needs device_budget, e.g. LightMem(plan='auto', device_budget='20GiB')")
            if self.checkpoint or self.offload_settings.include is not None:
                raise ValueError(
                    f"{_flag('plan')}: 'auto' chooses checkpoint and offload_include itself; leave them unset"
                )
        self.host_limit_bytes = parse_host_limit(host_limit, flag=_flag("host_limit"))
        self.host_warn_at = parse_fraction(host_warn_at, flag=_flag("host_warn_at"))
        self.host_stop_at = parse_fraction(host_stop_at, flag=_flag("host_stop_at"), allow_none=True)
        if self.host_stop_at is not None and self.host_stop_at < self.host_warn_at:  # type: ignore[operator]
            raise ValueError(f"{_flag('host_stop_at')}: must be >= host_warn_at ({host_warn_at}); got {host_stop_at!r}")
        self.host_stop_checkpoint = parse_path(host_stop_checkpoint, flag=_flag("host_stop_checkpoint"))
        self.chosen_plan: Any = None
        """With plan='auto': the ``lightmem.estimate.Plan`` chosen from the first training batch."""

        self._host_guard: HostGuard | None = None
        self._offload: TrainingOffload | None = None
        self._checkpoint_handle: CheckpointHandle | None = None
        self._patched_module: pl.LightningModule | None = None
        self._recorder: MetricsRecorder | None = None

    @property
    def _offloader(self) -> ActivationOffloader | None:
        return self._offload.offloader if self._offload is not None else None

    @property
    def offload_min_bytes(self) -> int:
        return self.offload_settings.min_bytes

    @property
    def offload_devices(self) -> tuple[str, ...]:
        return self.offload_settings.devices

    @property
    def host_budget_bytes(self) -> int:
        return self.offload_settings.host_budget_bytes

    @property
    def last_metrics(self) -> dict[str, float]:
        """The metrics of the last logged step, as logged (with DDP: the max over ranks)."""
        return self._recorder.last_metrics if self._recorder is not None else {}

    @property
    def last_local_metrics(self) -> dict[str, float]:
        """The same figures for this process alone."""
        return self._recorder.last_local_metrics if self._recorder is not None else {}

    # -- checkpointing, before the strategy wraps the model --------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # A fractional host_budget is shared by this node's ranks (Lightning sets no LOCAL_WORLD_SIZE).
        self.offload_settings = self.offload_settings.for_ranks_per_node(trainer.num_devices)
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

    # -- offload and metrics ---------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._host_guard = HostGuard(self.host_limit_bytes, self.host_warn_at, self.host_stop_at, self._host_bytes_held)  # type: ignore[arg-type]
        if self.oom_snapshot:
            oom.record_memory_history()
        if self.plan == "auto":  # every fit plans for its own first batch, then starts recording
            self.chosen_plan, self._offload, self._recorder = None, None, None
            return
        self._offload = None
        if self.offload:
            self._start_offload(pl_module)
        self._start_recording(trainer, pl_module)

    def _offload_off_reason(self, settings: OffloadSettings) -> str | None:
        if settings.devices == ("cuda",) and not torch.cuda.is_available():
            return "no CUDA device: moving CPU tensors to host memory gains nothing"
        return None

    def _build_offloader(
        self, pl_module: pl.LightningModule, settings: OffloadSettings | None = None
    ) -> ActivationOffloader | None:
        settings = settings or self.offload_settings
        if self._offload_off_reason(settings) is not None:
            return None
        return ActivationOffloader(pl_module, settings=settings)

    def _start_offload(self, pl_module: pl.LightningModule, settings: OffloadSettings | None = None) -> None:
        offloader = self._build_offloader(pl_module, settings)
        self._offload = TrainingOffload(offloader) if offloader is not None else None

    def _start_recording(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        blocks = self._checkpointed_blocks()
        probes, metrics_off = build_probes(
            self.metrics, pl_module.device, checkpointed_blocks=blocks,
            host_bytes_held=self._host_bytes_held if self._offloader is not None else None,
            host_bytes_peak_in_use=self._host_bytes_peak_in_use,
        )  # fmt: skip
        if "host" in self.metrics:
            probes.append(self._host_guard)
        self._recorder = MetricsRecorder(
            probes, log_every_n_steps=self.log_every_n_steps, tensorboard_panels=self.tensorboard_panels,
            checkpointed_blocks=blocks,
        )  # fmt: skip
        self._recorder.start(trainer)
        rank_zero_info(self._what_is_on(blocks, [probe.group for probe in probes], metrics_off))

    def _what_is_on(self, blocks: int, metrics_on: list[str], metrics_off: dict[str, str]) -> str:
        """One line: every feature that is on, and why each one asked for is off."""
        on, off = [], []
        if self._offloader is not None:
            on.append(f"activation offload (tensors from {format_bytes(self._offloader.min_bytes)})")
        elif self.offload or self.chosen_plan is not None:
            off.append(f"activation offload ({self._offload_off_reason(self.offload_settings) or 'the plan offloads nothing'})")
        if blocks:
            names = self._checkpoint_handle.modules  # type: ignore[union-attr]
            on.append(f"checkpointing {blocks} blocks ({', '.join(names[:3])}{', ...' if blocks > 3 else ''})")
        elif self.checkpoint:
            off.append("checkpointing (see the warning above)")
        if metrics_on:
            on.append(f"{', '.join(dict.fromkeys(metrics_on))} metrics")
        for reason in dict.fromkeys(metrics_off.values()):
            groups = [group for group, why in metrics_off.items() if why == reason]
            off.append(f"{' and '.join(groups)} metrics ({reason})")
        return f"lightmem: on: {'; '.join(on) or 'nothing'}." + (f" Off: {'; '.join(off)}." if off else "")

    def _host_bytes_peak_in_use(self) -> int:
        return self._offloader.host_bytes_peak_in_use if self._offloader is not None else 0

    def _checkpointed_blocks(self) -> int:
        return len(self._checkpoint_handle) if self._checkpoint_handle is not None else 0

    def _host_bytes_held(self) -> int:
        return self._offloader.host_bytes_held if self._offloader is not None else 0

    # -- one training step -----------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._host_guard is not None:
            self._host_guard.batches_ahead = batches_loaded_ahead(trainer.train_dataloader)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.plan == "auto" and self.chosen_plan is None:
            self._plan_from(trainer, pl_module, batch)
        if self._offload is not None:
            self._offload.enter()

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
        if self._recorder is None:
            return
        if self._offload is not None and self._offload.stats is not None:
            self._recorder.add_traffic(self._offload.stats)
        self._recorder.batch_end(trainer)

    def _guard_host(self, trainer: pl.Trainer) -> None:
        if self._host_guard is not None:
            release = self._offloader.release_host_memory if self._offloader is not None else None
            self._host_guard.on_training_batch(trainer, release, self.host_stop_checkpoint)

    def _plan_from(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
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
            f"{chosen.checkpoint or 'nothing'}, offload {_offload_scope(chosen.offload)}; "
            f"predicted peak {format_bytes(chosen.predicted_total_bytes)}"
        )
        if chosen.fits:
            rank_zero_info(summary)
        else:
            rank_zero_warn(f"{summary}. It does not fit: {chosen.reason}")
        if chosen.checkpoint:
            self._apply_checkpointing(trainer, pl_module, list(chosen.checkpoint), every_n=1)
        self._offload = None
        if chosen.offload is not None:
            settings = self.offload_settings.with_choice(min_bytes=chosen.offload.min_bytes, include=chosen.offload.include)
            self._start_offload(pl_module, settings)
        self._start_recording(trainer, pl_module)

    def _exit_offload(self) -> None:
        if self._offload is not None:
            self._offload.exit()

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
        if self._offload is not None:  # the offloader words torch.func's error itself
            self._offload.exit(exception)
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
        return oom.report(
            pl_module, trainer.optimizers, pl_module.device, offloader=self._offloader,
            offload_min_bytes=self.offload_min_bytes, checkpointed_blocks=self._checkpointed_blocks(),
            last_metrics=self.last_metrics,
        )  # fmt: skip

    def summary(self) -> dict[str, str]:
        """Readable end-of-fit figures: peaks over the logged steps, traffic and waits per step
        (over every step), checkpointed blocks."""
        figures = self._recorder.summary() if self._recorder is not None else []
        return {figure.label: figure.readable() for figure in figures}

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._undo()
        if self._recorder is not None:
            # A Rich progress bar stops at its own teardown, which may run after this one and
            # redraw over whatever was printed: stop it first so the summary prints below it.
            bar = trainer.progress_bar_callback
            if bar is not None:
                bar.teardown(trainer, pl_module, stage)
            self._recorder.publish_summary(trainer)

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
        if self._offload is not None:
            self._offload.close()
            self._offload = None
        # Probes hold psutil processes (with locks): after fit the callback pickles and deep-copies.
        if self._host_guard is not None:
            self._host_guard.close()
        if self._recorder is not None:
            self._recorder.close()
        self._host_guard = None
        if self.oom_snapshot:
            oom.stop_memory_history()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}


def _offload_scope(offload: Any) -> str:
    """A plan's offload scope in the log line: the blocks, 'everywhere' (no include) or 'nothing'."""
    if offload is None:
        return "nothing"
    return "everywhere" if offload.include is None else str(list(offload.include))
