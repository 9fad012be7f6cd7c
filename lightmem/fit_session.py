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
from dataclasses import dataclass, field
from typing import Any

import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from lightmem import oom
from lightmem.auto_plan import AutoPlan, PlanDoesNotFit, format_shapes, no_fit_message
from lightmem.blocks import find_blocks
from lightmem.causal_lm import (
    LITGPT_OPTION,
    ChunkedCausalLMLoss,
    causal_lms,
    chunked_causal_lm_loss,
    litgpt_models,
)
from lightmem.checkpoint import CheckpointHandle, apply_checkpointing, existing_checkpointing, restore_forward
from lightmem.config import LIGHTMEM, LightMemSettings, OffloadSettings, TileSettings, available_ram_bytes, format_bytes
from lightmem.device_memory import use_expandable_segments
from lightmem.estimate import Plan, max_batch_size, plan
from lightmem.estimate.chunked_loss import SEARCH_MULTIPLE, dominant_logits, no_fit_sentence
from lightmem.estimate.report import STAND_IN_NOTE
from lightmem.estimate.search import largest_batches, search_arguments
from lightmem.estimate.settings import sharded_by_fsdp2
from lightmem.estimate.trace.batch import batch_shapes, with_shapes
from lightmem.estimate.words import format_seconds
from lightmem.fit_lines import (
    decimal_host_budget,
    dry_run_failure,
    gradients_elsewhere,
    how_plans_are_made,
    offload_off_reason,
    offload_scope,
    what_is_on,
)  # fmt: skip
from lightmem.host_guard import HostGuard, batches_loaded_ahead
from lightmem.lightning_packages import is_barebones, logged_step
from lightmem.metrics.recorder import MetricsRecorder, build_probes
from lightmem.model_state.offloader import OptimizerOffloader, OptimizerOffloadStats
from lightmem.model_state.trainer_optimizers import gradient_readers, offload_trainer_optimizers
from lightmem.offload.context import ActivationOffloader
from lightmem.offload.training import TrainingOffload
from lightmem.tiling import TilingHandle, tile_modules

# A Trainer and a LightningModule of either Lightning package: only their attributes are read.
Trainer = Any
Module = Any


@dataclass
class FitOutcome:
    """What a fit leaves for the callback to report after it: its last plan, its metrics recorder
    (figures only) and the optimizer offloaders' figures; as a running ``FitSession`` reports them."""

    chosen_plan: Plan | None = None
    recorder: MetricsRecorder | None = None
    optimizer_offload: list[OptimizerOffloadStats] = field(default_factory=list)

    def optimizer_offload_stats(self) -> list[OptimizerOffloadStats]:
        return self.optimizer_offload

    def publish(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """The summary of the fit's metrics, printed below the progress bar."""
        if self.recorder is None:
            return
        # A Rich progress bar stops at its own teardown, which may run after the callback's and redraw
        # over whatever was printed: stop it first so the summary prints below it.
        bar = trainer.progress_bar_callback
        if bar is not None:
            bar.teardown(trainer, pl_module, stage)
        self.recorder.publish_summary(trainer)


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
                rank_zero_warn(gradients_elsewhere(self.settings, readers))
        if self.settings.offload_on and self.auto_plan is None:  # with a plan: what the plan chooses
            self._start_offload(pl_module, self.offload_settings)
        self._start_recording(trainer, pl_module)
        self._say_decimal_host_budget()
        if self.auto_plan is not None:
            self._say_how_plans_are_made()

    def _say_decimal_host_budget(self) -> None:
        line = decimal_host_budget(self.settings)
        if line is not None:
            rank_zero_info(line)

    def _say_how_plans_are_made(self) -> None:
        assert self.auto_plan is not None
        for line in how_plans_are_made(self.auto_plan, self.settings, self._allocator_note):
            rank_zero_info(line)

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
        """The fit-start line of what is on (``fit_lines.what_is_on``), from this fit's parts."""
        return what_is_on(
            self.settings, device, metrics_on, metrics_off, planning=self.auto_plan is not None, offloader=self.offloader,
            offload_settings=self.offload_settings, optimizer_offloaders=self._optimizer_offloaders,
            optimizer_offload_off=self._optimizer_offload_off, checkpointed=self._checkpoint.modules if self._checkpoint is not None else [],
            tiling=self._tiling,
        )  # fmt: skip

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

        Planning never ends a fit that trains without it: where the dry run cannot trace the step (or
        sees no batch: a ``dataloader_iter`` step fetches its own; or FSDP2 sharded the model), the batch
        trains without a plan (``_without_plan``); an error of the user's code is then raised by the real step, as
        without lightmem. Only a plan that does not fit ends the fit (``PlanDoesNotFit``)."""
        assert self.auto_plan is not None
        if not batch_shapes(batch):
            self._without_plan(trainer, pl_module, None, "it sees no batch before the step (a training_step(dataloader_iter) "
                               "fetches its own): it plans from the batch this step fetches, before the next")  # fmt: skip
            return
        shapes = self.auto_plan.shapes_to_plan_for(batch)
        sharded = sharded_by_fsdp2(pl_module)
        if sharded is not None:  # no dry run: it cannot tell what a rank holds
            self._without_plan(trainer, pl_module, shapes, sharded)
            return
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
            self._without_plan(trainer, pl_module, shapes, f"its dry run could not trace the training step ({dry_run_failure(error)})")
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
            f"{format_bytes(chosen.predicted_total_bytes)} (reserved, overhead allowance included"
            f"{', under the worst-case routing of its experts' if chosen.routing_bound_bytes else ''}), step "
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
            f"checkpointing every block ({len(blocks)}) while it does not plan" if blocks
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
        self, trainer: Trainer, pl_module: Module, batch: Any, shapes: Any, *, search_up_to: int | None = None,
        loss_as_chunked: bool = False,
    ) -> Any:  # fmt: skip
        """``plan`` (or, with ``search_up_to``, ``max_batch_size(plan=True)`` up to that batch size,
        with ``loss_as_chunked`` the loss priced as chunked) for batches of ``shapes``, with this fit's
        flags, budget and device speeds."""
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
        budget = self.auto_plan.planning_budget_bytes
        with self._without_checkpointing(pl_module):  # the planner sees the model as the user wrote it
            shaped = with_shapes(batch, shapes)
            if search_up_to is None:
                return plan(pl_module, shaped, budget, **common)
            common["checkpoint_policy"] = self.settings.checkpoint.policy  # under the policy "auto" starts from
            if not loss_as_chunked:
                return max_batch_size(pl_module, shaped, budget, plan=True, limit=search_up_to, **common)
            found = search_arguments(
                pl_module, shaped, budget, None, limit=search_up_to, checkpoint=None, optimizer=None, **common
            )
            return largest_batches(
                pl_module, shaped, found.settings.priced_as_chunked(), found.info, offload=found.offload,
                limit=search_up_to, plan=True,
            )  # fmt: skip

    def _no_fit(self, trainer: Trainer, pl_module: Module, batch: Any, shapes: Any, chosen: Plan) -> str:
        """The message of ``PlanDoesNotFit``, with the largest batch a plan fits (searched now) and,
        where the loss's logits dominate, the change that chunks the loss and the largest batch a
        plan then fits (searched now, the loss priced as chunked)."""
        size = shapes[0][0] if shapes and shapes[0] else None
        largest = chunked_largest = None
        if size is not None and size > 1:
            try:
                largest = self._run_planner(trainer, pl_module, batch, shapes, search_up_to=size - 1).planned
            except Exception:  # noqa: BLE001 - no batch dimension to scale, or a smaller batch the dry run
                largest = None  # cannot trace: the refusal stands, without the figure
        limit = SEARCH_MULTIPLE * size if size is not None else None
        if limit is not None and dominant_logits(chosen.estimate) is not None:
            with contextlib.suppress(Exception):  # as above: the refusal stands without the figure
                chunked_largest = self._run_planner(
                    trainer, pl_module, batch, shapes, search_up_to=limit, loss_as_chunked=True
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
        for module, wrapper in zip(modules, wrappers):
            restore_forward(module, wrapper)
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

    def outcome(self) -> FitOutcome:
        """What this fit leaves for the callback to report after it (``close`` keeps the recorder's figures)."""
        return FitOutcome(self.chosen_plan, self.recorder, self.optimizer_offload_stats())

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
