"""``FitSession``: what ``LightMem`` holds for one ``fit``, from ``setup`` to ``teardown``.

The callback creates one in ``setup`` and drops it in ``teardown`` (or ``on_exception``), so no
per-fit field outlives its fit or has to be reset. The session drives the parts that do the work:
checkpointing applied after ``configure_model``, the offloader around each training forward, the
optimizer offloaders (``offload_optimizer``), the plans of ``plan="auto"`` (``AutoPlan``: at the
first batch and any larger one), the metrics recorder, the host guard and the OOM report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from lightmem import oom
from lightmem.auto_plan import AutoPlan, PlanDoesNotFit, format_shapes, no_fit_message
from lightmem.causal_lm import LITGPT_OPTION, ChunkedCausalLMLoss, causal_lms, chunked_causal_lm_loss, litgpt_models
from lightmem.estimate.chunked_loss import SEARCH_MULTIPLE, dominant_logits, largest_with_chunked_loss, no_fit_sentence
from lightmem.blocks import find_blocks
from lightmem.checkpoint import CheckpointHandle, apply_checkpointing, existing_checkpointing
from lightmem.config import (
    DECIMAL_UNITS_NOTE, LIGHTMEM, LightMemSettings, OffloadSettings, TileSettings, available_ram_bytes, decimal_reading,
    format_bytes,
)  # fmt: skip
from lightmem.device_memory import use_expandable_segments
from lightmem.estimate import Plan, max_batch_size, plan
from lightmem.estimate.report import STAND_IN_NOTE, format_seconds
from lightmem.estimate.batch import batch_shapes, with_shapes
from lightmem.host_guard import HostGuard, batches_loaded_ahead
from lightmem.lightning_packages import is_barebones, logged_step
from lightmem.metrics.names import key
from lightmem.metrics.recorder import MetricsRecorder, build_probes
from lightmem.model_state.offloader import OptimizerOffloader, OptimizerOffloadStats
from lightmem.model_state.trainer_optimizers import gradient_readers, offload_trainer_optimizers
from lightmem.offload.context import ActivationOffloader
from lightmem.offload.training import TrainingOffload
from lightmem.tiling import TilingHandle, tile_modules

# A Trainer and a LightningModule of either Lightning package: only their attributes are read.
Trainer = Any
Module = Any


def offload_off_reason(settings: OffloadSettings) -> str | None:
    """Why offload with these settings would gain nothing on this machine, or None."""
    if settings.devices == ("cuda",) and not torch.cuda.is_available():
        return "no CUDA device: moving CPU tensors to host memory gains nothing"
    return None


def offload_scope(offload: OffloadSettings | None) -> str:
    """A plan's offload scope in the log line: its modules, 'everywhere' (no include) or 'nothing'."""
    if offload is None:
        return "nothing"
    return "everywhere" if offload.include is None else str(offload.include_arg())


def _reason(error: BaseException) -> str:
    """An error of the dry run in a few words: its type and first line."""
    first = (str(error).strip().splitlines() or [""])[0][:300].rstrip(".")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class FitSession:
    """The state of one fit: checkpoint handle, offloader, optimizer offloaders, plan, recorder,
    host guard.

    Args:
        settings: the callback's parsed flags.
        trainer: the Trainer whose ``fit`` this is (its devices per node share a fractional
            ``host_budget``).
    """

    def __init__(self, settings: LightMemSettings, trainer: Trainer) -> None:
        # A fractional host_budget is shared by this node's ranks (Lightning sets no LOCAL_WORLD_SIZE).
        self.offload_settings = settings.offload.for_ranks_per_node(trainer.num_devices)
        self.settings = settings
        self.auto_plan: AutoPlan | None = None
        self._said_unplanned = False
        self._said_stood_in = False
        self.host_guard: HostGuard | None = None
        self.recorder: MetricsRecorder | None = None
        self._offload: TrainingOffload | None = None
        self._checkpoint: CheckpointHandle | None = None
        self._tiling: TilingHandle | None = None
        self._plan_tiling: TilingHandle | None = None  # what plan="auto" tiles (the user's own: _tiling)
        self._patched_module: Module | None = None
        self._chunked_losses: list[ChunkedCausalLMLoss] = []
        self._optimizer_offloaders: list[OptimizerOffloader] = []
        self._optimizer_offload_off: str | None = None  # why offload_optimizer is off on this machine
        # Plans fit what the allocator reserves; with expandable segments it strands least. Set
        # here, at setup, before the strategy moves the model: every segment from now on can grow.
        self._allocator_note = ""
        if settings.plan.auto and trainer.strategy.root_device.type == "cuda":
            self._allocator_note = use_expandable_segments()

    @property
    def chosen_plan(self) -> Plan | None:
        return self.auto_plan.plan if self.auto_plan is not None else None

    @property
    def offloader(self) -> ActivationOffloader | None:
        return self._offload.offloader if self._offload is not None else None

    @property
    def checkpointed_blocks(self) -> int:
        return len(self._checkpoint) if self._checkpoint is not None else 0

    def optimizer_offload_stats(self) -> list[OptimizerOffloadStats]:
        """Per offloaded optimizer: host bytes held and the last step's traffic."""
        return [offloader.stats for offloader in self._optimizer_offloaders]

    # -- checkpointing, before the strategy wraps the model --------------------------------------

    def checkpoint_after_configure_model(self, trainer: Trainer, pl_module: Module) -> None:
        """Checkpoint the chosen blocks, then tile the chosen modules, right after ``configure_model``:
        Lightning calls it after ``setup`` and before the strategy wraps the model, and it may create
        the modules."""
        targets, tile = self.settings.checkpoint.targets, self.settings.tile
        if targets is None and tile is None:
            return
        original = pl_module.configure_model

        def configure_model_then_checkpoint() -> None:
            original()
            if targets is not None:
                self.apply_checkpointing(trainer, pl_module, targets, self.settings.checkpoint.every_n)
            if tile is not None and self._tiling is None:
                self._tiling = tile_modules(pl_module, tile)  # a bad target fails under the user's flag name

        pl_module.configure_model = configure_model_then_checkpoint
        self._patched_module = pl_module

    def apply_checkpointing(self, trainer: Trainer, pl_module: Module, targets: tuple[Any, ...], every_n: int) -> None:
        """Checkpoint ``targets`` unless the strategy or the model already checkpoints (then warn)."""
        if self._checkpoint is not None:
            return
        checkpoint = self.settings.checkpoint
        reason = existing_checkpointing(trainer.strategy, pl_module)
        if reason is not None:
            rank_zero_warn(
                f"lightmem: not applying {checkpoint.spelling.entry}(checkpoint={list(targets)!r}) because "
                f"{reason}; checkpointing twice would recompute twice."
            )
            return
        self._checkpoint = apply_checkpointing(  # a bad target fails under the user's flag name, before any wrap
            pl_module, targets, every_n, checkpoint.policy, policy_flag=checkpoint.flag("policy"),
            targets_flag=checkpoint.flag("targets"), every_n_flag=checkpoint.flag("every_n"),
        )  # fmt: skip

    # -- start --------------------------------------------------------------------------------------

    def start(self, trainer: Trainer, pl_module: Module) -> None:
        """At ``on_fit_start``: the host guard, the OOM history, optimizer offload (the strategy has
        set the optimizers up), activation offload (without a plan), metrics and the line of what is
        on; then, with ``plan="auto"``, its budget (measured here without ``device_budget``) and prices.
        """
        if self.settings.chunked_loss:  # before any plan: the planner's dry run sees the chunked loss
            models = causal_lms(pl_module)
            if not models:
                litgpt = litgpt_models(pl_module)
                raise ValueError(
                    "LightMem(chunked_loss=...): the LightningModule holds no Hugging Face causal LM whose loss_function "
                    "is transformers' ForCausalLMLoss; for a loss you compute yourself, call "
                    "lightmem.linear_cross_entropy in training_step and leave chunked_loss off"
                    + (f" ({type(litgpt[0]).__name__} is a LitGPT model: {LITGPT_OPTION})" if litgpt else "")
                )
            self._chunked_losses = [chunked_causal_lm_loss(model) for model in models]
        if self.settings.plan.auto:  # first: a budget it cannot measure fails before anything is set up
            self.auto_plan = AutoPlan.at_fit_start(self.settings.plan, pl_module.device, trainer.world_size)
        guard = self.settings.host_guard
        self.host_guard = HostGuard(guard.limit_bytes, guard.warn_at, guard.stop_at, self._all_host_bytes_held)
        if self.settings.metrics.oom_snapshot:
            oom.record_memory_history()
        if self.settings.optimizer_offload is not None:
            self._optimizer_offloaders, self._optimizer_offload_off = offload_trainer_optimizers(
                trainer, self.settings.optimizer_offload,
                grad_norm_wanted=lambda: self._reads_the_step_running(trainer),
            )  # fmt: skip
            readers = gradient_readers(trainer) if self._optimizer_offloaders else []
            if readers:
                rank_zero_warn(self._gradients_elsewhere(readers))
        if self.settings.offload_on and self.auto_plan is None:  # with a plan: what the plan chooses
            self._start_offload(pl_module, self.offload_settings)
        self._start_recording(trainer, pl_module)
        self._say_decimal_host_budget()
        if self.auto_plan is not None:
            self._say_how_plans_are_made()

    def _say_decimal_host_budget(self) -> None:
        """A ``host_budget`` given in decimal units, as read (as ``plan="auto"`` reads back its
        ``device_budget``): "64 GB" is 59.60 GiB, not 64."""
        offload = self.settings.offload
        reading = decimal_reading(offload.host_budget)
        if reading is not None:
            rank_zero_info(f"lightmem: {offload.flag('host_budget')}: {reading}, {DECIMAL_UNITS_NOTE}")

    def _say_how_plans_are_made(self) -> None:
        """``plan="auto"``'s lines at fit start: its budget, the allocator, the prices."""
        assert self.auto_plan is not None
        measured = self.auto_plan.budget_source
        if measured is not None:
            rank_zero_info(f"lightmem: plan='auto' device budget, measured at fit start: {measured}")
        reading = self.settings.plan.device_budget_reading
        if reading is not None:
            rank_zero_info(
                f"lightmem: plan='auto' device budget: {reading}, {DECIMAL_UNITS_NOTE}"
            )
        if self._allocator_note:
            rank_zero_info(self._allocator_note)
        if self.auto_plan.speeds is not None:
            rank_zero_info(f"lightmem: plan='auto' prices steps at {self.auto_plan.speeds.describe()}")
        if self.auto_plan.peaks_reset:
            rank_zero_info(
                "lightmem: measuring the device raised the allocator's peak statistics above anything before "
                "the fit: reset them (torch.cuda.reset_peak_memory_stats), so that the training batches' "
                "peaks can be measured against the plan"
            )

    def _gradients_elsewhere(self, readers: list[str]) -> str:
        """The warning for user code that reads gradients where optimizer offload leaves ``param.grad``
        None: ``readers`` name it (``gradient_readers``)."""
        flag = self.settings.optimizer_offload.flag("enabled")  # type: ignore[union-attr]
        logged = "lightmem" in self.settings.metrics.groups
        norm = f"; their global norm is logged as {key('optimizer/grad_norm')}" if logged else ""
        runs = "runs" if len(readers) == 1 else "run"
        return (
            f"lightmem: {flag}: param.grad of the model's parameters is None between backward and the optimizer "
            f"step (the gradients are on the host), where {', '.join(readers)} {runs}: read them with "
            f"lightmem.named_grads(module), by the names grad_norm gives{norm}"
        )

    def _reads_the_step_running(self, trainer: Trainer) -> bool:
        """Whether the optimizer step now running logs the gradient norm (its figures are read)."""
        recorder = self.recorder
        if recorder is None or recorder.optimizer_offload is None:
            return False
        return recorder.reads_the_step_running(trainer)

    def train_start(self, trainer: Trainer) -> None:
        if self.host_guard is not None:
            self.host_guard.batches_ahead = batches_loaded_ahead(trainer.train_dataloader)

    def _start_offload(self, pl_module: Module, settings: OffloadSettings) -> None:
        offloader = self.build_offloader(pl_module, settings)
        self._offload = TrainingOffload(offloader) if offloader is not None else None
        if offloader is not None and offloader.compile_note is not None:
            rank_zero_info(offloader.compile_note)  # a model compiled whole, compiled per block instead
        elif offloader is not None and offloader.compile_warning is not None:
            rank_zero_warn(offloader.compile_warning)

    def build_offloader(self, pl_module: Module, settings: OffloadSettings) -> ActivationOffloader | None:
        if offload_off_reason(settings) is not None:
            return None
        return ActivationOffloader(pl_module, settings=settings)

    def _start_recording(self, trainer: Trainer, pl_module: Module) -> None:
        metrics = self.settings.metrics
        if is_barebones(trainer):  # Lightning's "no logging, no progress, no summaries" covers ours
            off = dict.fromkeys(metrics.groups, "Trainer(barebones=True)")
            rank_zero_info(self._what_is_on([], off, pl_module.device))
            return
        probes, metrics_off = self._probes(trainer, pl_module)
        self.recorder = MetricsRecorder(
            probes, log_every_n_steps=metrics.log_every_n_steps, tensorboard_panels=metrics.tensorboard_panels,
            checkpointed_blocks=self.checkpointed_blocks,
        )  # fmt: skip
        self.recorder.start(trainer)
        rank_zero_info(self._what_is_on([probe.group for probe in probes], metrics_off, pl_module.device))

    def _probes(self, trainer: Trainer, pl_module: Module) -> tuple[list[Any], dict[str, str]]:
        """The probes of what is on now, and why each group asked for is off."""
        groups = self.settings.metrics.groups
        auto_plan = self.auto_plan if self.auto_plan is not None and self.auto_plan.memory is not None else None
        # Each rank plans for its own batches, so with several ranks one may offload while another
        # does not: their offload figures are then all logged (zeros where nothing moves), for the
        # max over ranks reduces the same figures on every rank.
        offload_figures = self.offloader is not None or (
            self.auto_plan is not None and trainer.world_size > 1 and self.settings.offload_on
            and offload_off_reason(self.offload_settings) is None
        )  # fmt: skip
        probes, metrics_off = build_probes(
            groups, pl_module.device, checkpointed_blocks=self.checkpointed_blocks,
            host_bytes_held=self._host_bytes_held if offload_figures else None,
            host_bytes_peak_in_use=self._host_bytes_peak_in_use,
            optimizer_offload_stats=self.optimizer_offload_stats if self._optimizer_offloaders else None,
            plan_peaks=auto_plan,
        )  # fmt: skip
        if "host" in groups:
            probes.append(self.host_guard)
        return probes, metrics_off

    def _what_is_on(self, metrics_on: list[str], metrics_off: dict[str, str], device: torch.device) -> str:
        """One line: every feature that is on, why each one asked for is off, and, on a CPU, how to
        run the offloads there anyway."""
        on, off = [], []
        on_the_cpu = []  # what offload_devices=["cpu"] would run here
        if self.auto_plan is not None:  # the plan's own line, at the first batch, says what it chose
            what = "what to checkpoint and tile" if self.settings.plan.tile else "what to checkpoint"
            if device.type == "cpu":
                what += "; on a CPU it never offloads"
            elif self.settings.offload_on:
                what += " and offload"
            on.append(f"plan='auto' (at the first training batch it chooses {what})")
        if self.offloader is not None:
            on.append(f"activation offload (tensors from {format_bytes(self.offloader.min_bytes)})")
        elif self.settings.offload_on and (reason := offload_off_reason(self.offload_settings)) is not None:
            off.append(f"activation offload ({reason})")
            if self.auto_plan is None and device.type == "cpu":
                on_the_cpu.append("activation offload")
        if self._optimizer_offloaders:
            notes = [
                (str(offloader.host_kernel), offloader.overlap_note, offloader.device_dtype_note)
                for offloader in self._optimizer_offloaders
            ]
            kernels = "; ".join("; ".join(note for note in each if note) for each in notes)
            on.append(f"optimizer offload (gradients, optimizer state and step on the host; {kernels})")
        elif self._optimizer_offload_off:
            off.append(f"optimizer offload ({self._optimizer_offload_off})")
            optimizer_offload = self.settings.optimizer_offload
            if device.type == "cpu" and optimizer_offload is not None and "cpu" not in optimizer_offload.devices:
                on_the_cpu.append("optimizer offload")
        blocks = self.checkpointed_blocks
        if blocks:
            names = self._checkpoint.modules  # type: ignore[union-attr]
            on.append(f"checkpointing {blocks} blocks ({', '.join(names[:3])}{', ...' if blocks > 3 else ''})")
        elif self.settings.checkpoint.targets is not None:
            off.append("checkpointing (see the warning above)")
        if self._tiling is not None:
            on.append(self._tiling.describe())
        if metrics_on:
            on.append(f"{', '.join(dict.fromkeys(metrics_on))} metrics")
        for reason in dict.fromkeys(metrics_off.values()):
            groups = [group for group, why in metrics_off.items() if why == reason]
            named = " and ".join(filter(None, [", ".join(groups[:-1]), groups[-1]]))
            off.append(f"{named} metrics ({reason})")
        line = f"lightmem: on: {'; '.join(on) or 'nothing'}." + (f" Off: {'; '.join(off)}." if off else "")
        if on_the_cpu:
            spelling = self.settings.offload.spelling
            them = "them" if len(on_the_cpu) > 1 else "it"
            line += (
                f" On this CPU, {spelling.entry}({spelling.name('devices')}=['cpu']) runs {' and '.join(on_the_cpu)} "
                f"anyway, with host-to-host copies that save no memory: to see {them} work."
            )
        return line

    def _host_bytes_peak_in_use(self) -> int:
        return self.offloader.host_bytes_peak_in_use if self.offloader is not None else 0

    def _host_bytes_held(self) -> int:
        return self.offloader.host_bytes_held if self.offloader is not None else 0

    def _all_host_bytes_held(self) -> int:
        """What the host guard counts: activation offload's buffers and model-state offload's."""
        return self._host_bytes_held() + sum(offloader.host_bytes_held for offloader in self._optimizer_offloaders)

    # -- one training batch -------------------------------------------------------------------------

    def batch_start(self, trainer: Trainer, pl_module: Module, batch: Any) -> None:
        if self.auto_plan is not None and self.auto_plan.needs_plan(batch):
            self._plan_from(trainer, pl_module, batch)
        if self.auto_plan is not None:
            self.auto_plan.batch_start()
        if self._offload is not None:
            self._offload.enter()

    def forward_done(self, exception: BaseException | None = None) -> None:
        """Leave the offload hooks (before backward, or wherever a batch may end)."""
        if self.auto_plan is not None:
            self.auto_plan.forward_done()
        if self._offload is not None:
            self._offload.exit(exception)

    def batch_end(self, trainer: Trainer, batch: Any) -> None:
        self.forward_done()  # training_step returned None: no backward ran
        if self.auto_plan is not None:
            rank = trainer.global_rank if trainer.world_size > 1 else None
            self.auto_plan.check(logged_step(trainer), batch, rank)
        if self.host_guard is not None:
            release = self.offloader.release_host_memory if self.offloader is not None else None
            self.host_guard.on_training_batch(trainer, release, self.settings.host_guard.stop_checkpoint)
        if self.recorder is None:
            return
        if self._offload is not None and self._offload.stats is not None:
            self.recorder.add_traffic(self._offload.stats)
        self.recorder.batch_end(trainer)

    def _plan_from(self, trainer: Trainer, pl_module: Module, batch: Any) -> None:
        """Plan for ``batch`` and every batch planned for before (the first, or one the current
        plan does not cover) and apply the choice before its forward; one line when it is new.

        Planning never ends a fit that trains without it: where the dry run cannot trace the step
        (or sees no batch: a ``dataloader_iter`` step fetches its own), the batch trains without a
        plan (``_without_plan``); an error of the user's code is then raised by the real step, as
        without lightmem. Only a plan that does not fit ends the fit (``PlanDoesNotFit``)."""
        assert self.auto_plan is not None
        if not batch_shapes(batch):
            self._without_plan(trainer, pl_module, None, "it sees no batch before the step (a training_step(dataloader_iter) "
                               "fetches its own): it plans from the batch this step fetches, before the next")  # fmt: skip
            return
        shapes = self.auto_plan.shapes_to_plan_for(batch)
        replanned_because = self.auto_plan.replan_reason
        if self.chosen_plan is None:  # the fit waits for it: say so
            rank_zero_info(
                f"lightmem: plan='auto' is planning for batches of {format_shapes(shapes)} within a "
                f"{format_bytes(self.auto_plan.planning_budget_bytes)} device budget (each configuration's step "
                "traced on fake tensors)"
            )
        try:
            chosen = self._run_planner(trainer, pl_module, batch, shapes)
        except Exception as error:  # noqa: BLE001 - the dry run failing is never why a fit ends
            self._without_plan(trainer, pl_module, shapes, f"its dry run could not trace the training step ({_reason(error)})")
            return
        rank_zero_info(
            f"lightmem: planned batches of {format_shapes(shapes)} in {chosen.seconds:.1f} s "
            f"({chosen.evaluations} configuration(s) traced on fake tensors)"
        )
        stood_in = chosen.estimate.stand_ins if chosen.estimate is not None else []
        if stood_in and not self._said_stood_in:
            self._said_stood_in = True
            rank_zero_info(f"lightmem: {STAND_IN_NOTE} {'; '.join(stood_in)}.")
        if not chosen.fits:
            raise PlanDoesNotFit(self._no_fit(trainer, pl_module, batch, shapes, chosen))
        if chosen.offload_optimizer and not self._optimizer_offloaders:
            # The planner counted gradients and optimizer state on the host; this fit keeps them on
            # the device, so the plan's peak is not what this run would reach.
            raise PlanDoesNotFit(
                f"lightmem: plan='auto' fits the {format_bytes(chosen.budget_bytes)} device budget for batches of "
                f"{format_shapes(shapes)} only with gradients and optimizer state on the host, which this fit keeps "
                "on the device: set LightMem(offload_optimizer=True). Training stopped before this batch's forward."
            )
        previous = self.chosen_plan
        self.auto_plan.take(chosen, shapes, pl_module)
        if previous is not None and previous.lightmem_kwargs() == chosen.lightmem_kwargs():
            if replanned_because is not None:
                rank_zero_info(
                    f"lightmem: planned again for the same batches ({replanned_because}) at step {logged_step(trainer)}: "
                    f"the choice stands, step {format_seconds(chosen.step_seconds)}{self._priced_at(chosen)}: "
                    f"{chosen.slowdown:.2f}x the step without lightmem"
                )
            return  # nothing to re-apply: checkpointed blocks and offloader stay as they are
        tiled = f", tile {chosen.tile}" if chosen.tile else ""
        choice = (
            f"checkpoint {chosen.checkpoint or 'nothing'}, offload {offload_scope(chosen.offload)}{tiled}; predicted peak "
            f"{format_bytes(chosen.predicted_total_bytes)} (reserved, overhead allowance included), step "
            f"{format_seconds(chosen.step_seconds)}{self._priced_at(chosen)}: {chosen.slowdown:.2f}x the step without "
            "lightmem"
        )
        if previous is None:
            summary = f"lightmem: plan for a {format_bytes(chosen.budget_bytes)} device budget: {choice}"
        else:
            this_one = batch_shapes(batch)
            if replanned_because is not None:
                planned_for = f"the same batches ({replanned_because})"
            elif shapes == this_one:
                planned_for = f"a larger batch ({format_shapes(shapes)})"
            else:
                planned_for = f"batches up to {format_shapes(shapes)} (this one: {format_shapes(this_one)})"
            summary = (
                f"lightmem: re-planned for {planned_for} at step {logged_step(trainer)}: {choice} (was: checkpoint "
                f"{previous.checkpoint or 'nothing'}, offload {offload_scope(previous.offload)})"
            )
        rank_zero_info(summary)
        self._apply_plan(trainer, pl_module, previous, chosen)
        if self.offloader is not None and chosen.host_bytes:
            # Page-lock the host memory the plan's offload holds, in the background, before it is needed.
            self.offloader.prepare_host(chosen.host_bytes)
        if self.recorder is not None:  # recording started at fit start: the plan's figures from now on
            self.recorder.use_probes(self._probes(trainer, pl_module)[0], self.checkpointed_blocks)

    def _without_plan(self, trainer: Trainer, pl_module: Module, shapes: Any, why: str) -> None:
        """This batch (and any ``shapes`` cover) trains without a plan: as written on a CPU, every
        block checkpointed on a CUDA device (the configuration that keeps least). Said once."""
        assert self.auto_plan is not None
        blocks: tuple[str, ...] = ()
        if pl_module.device.type == "cuda" and self.chosen_plan is None and self._checkpoint is None:
            blocks = tuple(find_blocks(pl_module).modules)
        what = (
            f"checkpointing every block ({len(blocks)}) until it can plan" if blocks
            else "the current plan" if self.chosen_plan is not None else "nothing changed (as written)"
        )  # fmt: skip
        if not self._said_unplanned:
            self._said_unplanned = True
            rank_zero_warn(f"lightmem: plan='auto' does not plan this batch: {why}. It trains with {what}.")
        if blocks:
            self.apply_checkpointing(trainer, pl_module, blocks, every_n=1)
        self.auto_plan.unplanned(shapes)

    def _priced_at(self, chosen: Plan) -> str:
        """Where the plan's step time comes from, when no measure of this machine's device priced it
        (the training device is not CUDA): the table figures it was priced at."""
        speeds = chosen.speeds
        if self.auto_plan is None or self.auto_plan.speeds is not None or speeds is None:
            return ""
        return f" (priced at {speeds.name} figures: {speeds.source}; not measured on this machine)"

    def _run_planner(
        self, trainer: Trainer, pl_module: Module, batch: Any, shapes: Any, *, search_up_to: int | None = None
    ) -> Any:
        """``plan`` (or, with ``search_up_to``, ``max_batch_size(plan=True)`` up to that batch size)
        for batches of ``shapes``, with this fit's flags, budget and device speeds."""
        assert self.auto_plan is not None
        common = {
            "device": pl_module.device.type, "precision": str(trainer.precision),
            "offload": self.offload_settings if self.settings.offload_on else False,
            "checkpoint_policy": self.settings.checkpoint.policy if self.settings.checkpoint.policy_given else "auto",
            "offload_optimizer": self.settings.optimizer_offload if self._optimizer_offloaders else False,
            "overhead_bytes": self.auto_plan.plan_overhead_bytes,
            "gpu": self.auto_plan.speeds if self.auto_plan.speeds is not None else "auto",
            "tile": self.settings.plan.tile,
            # This machine's RAM is the host's limit, what lightmem's own pools hold now included.
            "host_budget": available_ram_bytes() + self._all_host_bytes_held(),
        }  # fmt: skip
        with self._without_checkpointing(pl_module):  # the planner sees the model as the user wrote it
            shaped = with_shapes(batch, shapes)
            if search_up_to is not None:  # under the policy "auto" starts from
                common["checkpoint_policy"] = self.settings.checkpoint.policy
                return max_batch_size(
                    pl_module, shaped, self.auto_plan.planning_budget_bytes, plan=True, limit=search_up_to, **common
                )
            return plan(pl_module, shaped, self.auto_plan.planning_budget_bytes, **common)

    def _no_fit(self, trainer: Trainer, pl_module: Module, batch: Any, shapes: Any, chosen: Plan) -> str:
        """The message of ``PlanDoesNotFit``, with the largest batch a plan fits (searched now) and,
        where the loss's logits dominate, the change that chunks the loss and the largest batch a
        plan then fits (searched now, the loss priced as chunked)."""
        size = shapes[0][0] if shapes and shapes[0] else None
        largest = chunked_largest = None
        if size is not None and size > 1:
            try:
                largest = self._run_planner(trainer, pl_module, batch, shapes, search_up_to=size - 1).planned
            except ValueError:  # no batch dimension to scale
                largest = None
        limit = SEARCH_MULTIPLE * size if size is not None else None
        if limit is not None and dominant_logits(chosen.estimate) is not None:
            with contextlib.suppress(ValueError):
                chunked_largest = largest_with_chunked_loss(
                    lambda: self._run_planner(trainer, pl_module, batch, shapes, search_up_to=limit)
                ).planned
        sentence = no_fit_sentence(chosen, chunked_largest, limit)
        return no_fit_message(chosen, shapes, largest, size, chunked_loss=sentence)

    @contextlib.contextmanager
    def _without_checkpointing(self, pl_module: Module) -> Iterator[None]:
        """The blocks lightmem checkpoints and the modules a plan tiles run their own forward inside;
        the very same wrappers are put back after, so a plan that keeps the choice changes nothing (a
        compiled model is not recompiled). The user's own tiling (``tile=``) stays: it is the model
        as written."""
        names = [*(self._checkpoint.modules if self._checkpoint is not None else ()),
                 *(self._plan_tiling.modules if self._plan_tiling is not None else ())]  # fmt: skip
        modules = [pl_module.get_submodule(name) for name in names]
        wrappers = [module.__dict__["forward"] for module in modules]
        for module, wrapper in zip(modules, wrappers):  # as CheckpointHandle.remove unwraps
            if wrapper.had_instance_forward:
                module.forward = wrapper.inner
            else:
                del module.forward
        try:
            yield
        finally:
            for module, wrapper in zip(modules, wrappers):
                module.forward = wrapper

    def _apply_plan(self, trainer: Trainer, pl_module: Module, previous: Plan | None, chosen: Plan) -> None:
        """Checkpoint, tile and offload as ``chosen`` says, replacing what ``previous`` applied where
        the two differ (tiling after checkpointing, as at fit start)."""
        if previous is None or previous.checkpoint != chosen.checkpoint:
            if self._checkpoint is not None:
                self._checkpoint.remove()
                self._checkpoint = None
            if chosen.checkpoint:
                self.apply_checkpointing(trainer, pl_module, tuple(chosen.checkpoint), every_n=1)
        if previous is None or previous.tile != chosen.tile:
            if self._plan_tiling is not None:
                self._plan_tiling.remove()
                self._plan_tiling = None
            if chosen.tile:
                self._plan_tiling = tile_modules(pl_module, TileSettings(modules=tuple(chosen.tile), spelling=LIGHTMEM))
        if previous is None or previous.offload != chosen.offload:
            if self._offload is not None:
                self._offload.close()
                self._offload = None
            if chosen.offload is not None:
                self._start_offload(pl_module, chosen.offload)

    # -- the end ------------------------------------------------------------------------------------

    def oom_report(self, trainer: Trainer, pl_module: Module) -> str:
        """What was on the device, the last metrics, and the flags that would help."""
        return oom.report(
            pl_module, trainer.optimizers, pl_module.device, offloader=self.offloader,
            offload_min_bytes=self.offload_settings.min_bytes, checkpointed_blocks=self.checkpointed_blocks,
            last_metrics=self.recorder.last_metrics if self.recorder is not None else {},
        )  # fmt: skip

    def on_exception(self, trainer: Trainer, pl_module: Module, exception: BaseException) -> None:
        """Leave the hooks (the offloader words torch.func's error itself); on an OOM, print the
        report and dump the snapshot. ``close`` follows."""
        self.forward_done(exception)
        if isinstance(exception, torch.cuda.OutOfMemoryError) or "out of memory" in str(exception).lower():
            print(self.oom_report(trainer, pl_module))
            path = self.settings.metrics.oom_snapshot
            written = oom.dump_snapshot(path, trainer.global_rank, trainer.world_size) if path else None
            if written is not None:
                print(f"lightmem: memory snapshot written to {written} (open it at https://pytorch.org/memory_viz)")

    def close(self) -> None:
        """Leave the model and the process as they were before fit: no wrapper, patch or hooks.
        Probes hold psutil processes (with locks): the recorder keeps only its figures."""
        try:
            self.forward_done()
        finally:
            if self.auto_plan is not None:
                self.auto_plan.remove_block_timer()
            for tiling in (self._plan_tiling, self._tiling):  # applied after checkpointing: undone first
                if tiling is not None:
                    tiling.remove()
            self._tiling = self._plan_tiling = None
            if self._checkpoint is not None:
                self._checkpoint.remove()
                self._checkpoint = None
            if self._patched_module is not None:
                self._patched_module.__dict__.pop("configure_model", None)
                self._patched_module = None
            for chunked in self._chunked_losses:
                chunked.remove()
            self._chunked_losses = []
            if self._offload is not None:
                self._offload.close()
                self._offload = None
            for offloader in self._optimizer_offloaders:
                offloader.close()
            self._optimizer_offloaders = []
            if self.host_guard is not None:
                self.host_guard.close()
                self.host_guard = None
            if self.recorder is not None:
                self.recorder.close()
            if self.settings.metrics.oom_snapshot:
                oom.stop_memory_history()
