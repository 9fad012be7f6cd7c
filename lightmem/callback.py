"""``LightMem``: one callback that offloads, checkpoints and shows where memory goes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from lightmem.checkpoint import CheckpointPolicyArg
from lightmem.config import (
    DEFAULT_HOST_BUDGET,
    DEFAULT_HOST_MIN_AVAILABLE,
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH,
    LightMemSettings,
)
from lightmem.estimate import Plan
from lightmem.fit_session import FitOutcome, FitSession, Module, Trainer
from lightmem.lightning_packages import callback_bases
from lightmem.metrics.names import GROUPS
from lightmem.model_state.offloader import OptimizerOffloadStats


class LightMem(*callback_bases()):  # type: ignore[misc]
    r"""Train models that do not fit in GPU memory, and log where every byte goes.

    Activation offload wraps every training forward; selective checkpointing is applied to the chosen
    blocks before the strategy wraps the model; memory metrics go to every logger of the Trainer.
    Validation, testing and prediction run untouched.

    Args:
        offload: move saved activations to host memory during each training forward.
        offload_min_bytes: only offload saved tensors whose storage is at least this big.
        offload_include: module-name globs (or class names); when given, only tensors saved inside
            them are offloaded. A dict ``{"blocks.3": "16MiB", ...}`` gives each its own threshold
            (what ``plan`` chooses for a partial offload: a block's largest tensors only).
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
        checkpoint_every: checkpoint every n-th matched block (default 1; needs ``checkpoint``).
        checkpoint_policy: what a checkpointed block keeps (needs ``checkpoint`` or ``plan="auto"``):
            ``"full"`` (its inputs only, the default),
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
            checkpoint and to offload so the step's reserved memory fits the device budget at the
            least step time, priced at the GPU's speeds measured at fit start (a fake-tensor dry run
            of the LightningModule, seconds), and LightMem applies that choice; a later batch larger
            than the one planned for is planned for again before its forward, together with every
            batch planned for so far (the elementwise maximum of their shapes). A batch no plan fits
            stops the fit before its forward (``lightmem.PlanDoesNotFit``). The predicted peaks and
            step are logged beside the measured ones; a reserved peak above its prediction (or under
            it, reached without an allocator retry) or a step off it by more than
            ``lightmem.auto_plan.REPLAN_MARGIN`` (15%) plans the next batch again.
            Expandable segments are turned on unless ``PYTORCH_CUDA_ALLOC_CONF`` is set.
        device_budget: device memory the step must fit in; needs ``plan="auto"``. Without it, the
            budget is what the CUDA training device can give this process, measured at fit start
            (its free memory plus what this process's allocator holds, less 5% for fragmentation:
            ``lightmem.device_memory.FRAGMENTATION_MARGIN``).
        host_limit: the host memory limit the guard watches: ``"auto"`` (the tightest of the
            process's cgroup limit and total RAM), bytes, a size string, or a fraction of total RAM.
        host_warn_at: fraction of ``host_limit`` at which one warning says what holds host memory,
            how fast it grows and how many batches are left.
        host_stop_at: fraction of ``host_limit`` at which training stops cleanly (cached host
            buffers released first, then a checkpoint saved and ``trainer.should_stop`` set);
            None: never stop, only warn. The rest of the limit is the margin for saving.
        host_stop_checkpoint: where that checkpoint goes (default
            ``<trainer.default_root_dir>/lightmem-host-stop.ckpt``); needs ``host_stop_at``.
        offload_optimizer: keep parameters on the device and move gradients, optimizer state and
            the optimizer step to host memory (see :func:`~lightmem.offload_optimizer`); uses
            ``offload_devices`` and ``offload_max_inflight_bytes`` (gradient bytes awaiting their copy).
            ``param.grad`` of the model is then None after backward: :func:`~lightmem.named_grads`
            reads the gradients by name, and the global norm is logged with the ``"lightmem"`` metrics.
        offload_overlap_step: with ``offload_optimizer``, step each parameter on the host as its
            gradient lands, while backward runs, on the backward whose optimizer step follows.
            ``"auto"``: wherever the fit shows nothing changes gradients between backward and the
            step (automatic optimization, no ``gradient_clip_val``, ``configure_gradient_clipping``,
            ``optimizer_step``, ``on_after_backward`` and ``on_before_optimizer_step`` not overridden
            by the module or another callback); the line at fit start says whether it is on and
            why not. True: the same, failing at fit start where the fit does not allow it. False: off.
        offload_optimizer_device_dtype: with ``offload_optimizer``, ``"bf16"``: fp32 master weights
            and the step on the host, bf16 parameters on the device (half the bytes per step and of
            the device's weights; not bitwise equal to training without lightmem). Needs
            ``precision="bf16-mixed"`` and fp32 parameters; not under DDP, and the host step then
            runs after backward. ``state_dict()`` holds the fp32 masters. None (default): off.
        chunked_loss: compute the training loss of every Hugging Face causal LM in the module
            (``model(..., labels=labels).loss``) with ``lightmem.linear_cross_entropy``, from the
            hidden states, without making the logits (see :func:`~lightmem.chunked_causal_lm_loss`;
            the output's ``logits`` then hold no position). For a loss you write yourself, call
            ``lightmem.linear_cross_entropy`` in ``training_step`` instead. Fails at fit start when
            the module holds no such model.
        tile: position-wise modules (an MLP taking ``[..., T, d]``) to run in sequence shards,
            keeping only their input and running each shard again in backward: class names or
            module-name globs, as ``checkpoint`` (see :func:`~lightmem.apply_tiling`). A module
            that mixes positions (attention, a convolution along the sequence) fails at its first
            call, the message saying what was seen. True, or a list, with ``plan="auto"``: its plans
            may tile position-wise modules too (read from the trace; exact within 1e-6, not bitwise).
        tile_tokens: positions per shard (needs ``tile``); default: the tiled input's width.

    Works with either Lightning package: ``pytorch_lightning`` or ``lightning.pytorch``
    (``import lightning as L``; LightMem is a ``Callback`` of both).

    Raises:
        ValueError: at construction, for a flag with a bad value (the message names the flag and
            what it accepts), an empty list that would switch a feature off (``checkpoint=[]``,
            ``offload_include=[]``), or a flag without the partner it needs (the message names
            both). Module patterns that match nothing fail when training starts, and so does
            ``plan="auto"`` without ``device_budget`` on a training device that is not CUDA.

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
        offload_include: list[str] | dict[str, int | str] | None = None,
        offload_exclude: list[str] | None = None,
        offload_devices: Sequence[str] = ("cuda",),
        host_budget: int | float | str = DEFAULT_HOST_BUDGET,
        host_min_available: int | float | str = DEFAULT_HOST_MIN_AVAILABLE,
        prefetch_bytes: int | str = DEFAULT_PREFETCH,
        offload_max_inflight_bytes: int | str = DEFAULT_MAX_INFLIGHT,
        checkpoint: list[str] | str | None = None,
        checkpoint_every: int | None = None,
        checkpoint_policy: CheckpointPolicyArg | None = None,
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
        offload_optimizer: bool = False,
        offload_overlap_step: bool | str = "auto",
        offload_optimizer_device_dtype: str | torch.dtype | None = None,
        chunked_loss: bool = False,
        tile: list[str] | str | bool | None = None,
        tile_tokens: int | None = None,
    ) -> None:
        flags = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        super().__init__()
        self.settings = LightMemSettings.parse(metric_groups=GROUPS, **flags)
        """Every flag, parsed: ``settings.offload``, ``.checkpoint``, ``.optimizer_offload``, ``.metrics``,
        ``.host_guard``, ``.plan``."""
        self.fit_session: FitSession | None = None
        """The running fit's state (offloaders, checkpoint handle, recorder, host guard); None outside ``fit``."""
        self._last = FitOutcome()  # the last fit's, kept after it

    @property
    def _fit(self) -> FitSession | FitOutcome:
        """What is reported: the running fit, or after it what it left."""
        return self.fit_session if self.fit_session is not None else self._last

    @property
    def chosen_plan(self) -> Plan | None:
        """With plan='auto': the ``lightmem.estimate.Plan`` applied now (made for the first training
        batch, or the last one that needed a new plan); after fit, the fit's last."""
        return self._fit.chosen_plan

    @property
    def optimizer_offload_stats(self) -> list[OptimizerOffloadStats]:
        """With offload_optimizer: per optimizer, host bytes and the last step's traffic (kept after fit)."""
        return self._fit.optimizer_offload_stats()

    @property
    def host_budget_bytes(self) -> int | None:
        """Host bytes offload may hold (in a fit: this rank's share of a fractional budget)."""
        session = self.fit_session
        return (session.offload_settings if session is not None else self.settings.offload).host_budget_bytes

    @property
    def last_metrics(self) -> dict[str, float]:
        """The metrics of the last logged step, as logged (with DDP: the max over ranks)."""
        return self._fit.recorder.last_metrics if self._fit.recorder is not None else {}

    @property
    def last_local_metrics(self) -> dict[str, float]:
        """The same figures for this process alone."""
        return self._fit.recorder.last_local_metrics if self._fit.recorder is not None else {}

    def summary(self) -> dict[str, str]:
        """Readable end-of-fit figures: peaks over the logged steps, traffic and waits per step
        (over every step), checkpointed blocks."""
        figures = self._fit.recorder.summary() if self._fit.recorder is not None else []
        return {figure.label: figure.readable() for figure in figures}

    def oom_report(self, trainer: Trainer, pl_module: Module) -> str:
        """What was on the device, the last metrics, and the flags that would help."""
        session = self.fit_session or FitSession(self.settings, trainer)
        return session.oom_report(trainer, pl_module)

    # -- a fit: created in setup, dropped in teardown or on_exception ------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        if stage != "fit":
            return
        self._end_session()  # a fit that ended without teardown (an interrupted setup) left nothing behind
        self.fit_session = FitSession(self.settings, trainer)
        self.fit_session.checkpoint_after_configure_model(trainer, pl_module)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: Module) -> None:
        if self.fit_session is not None:
            self.fit_session.start(trainer, pl_module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        if self.fit_session is not None:
            self.fit_session.train_start(trainer)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int) -> None:
        if self.fit_session is not None:
            self.fit_session.batch_start(trainer, pl_module, batch)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: Module, loss: torch.Tensor) -> None:
        # Automatic optimization calls backward after training_step returns; manual optimization
        # from inside it. Either way the forward is over: leave the hooks before backward runs.
        self._forward_done()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.fit_session is not None:
            self.fit_session.batch_end(trainer, batch)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._forward_done()  # never leave hooks active into validation

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        # A LightningModule.on_train_batch_start returning -1 ends the epoch without
        # on_train_batch_end: the hooks entered for that batch must not outlive it.
        self._forward_done()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None:
        self._forward_done()

    @override
    def on_exception(self, trainer: Trainer, pl_module: Module, exception: BaseException) -> None:
        # Lightning does not call teardown after an exception: the session ends here.
        if self.fit_session is not None:
            try:
                self.fit_session.on_exception(trainer, pl_module, exception)
            finally:
                self._end_session()

    @override
    def teardown(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        if stage != "fit" or self.fit_session is None:
            return
        self._end_session()
        self._last.publish(trainer, pl_module, stage)

    def _forward_done(self) -> None:
        if self.fit_session is not None:
            self.fit_session.forward_done()

    def _end_session(self) -> None:
        session, self.fit_session = self.fit_session, None
        if session is not None:
            self._last = session.outcome()
            session.close()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}
