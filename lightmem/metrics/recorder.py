"""Memory metrics of a Lightning fit: probes read on logged steps, sent to every logger, and an
end-of-fit summary (console, TensorBoard's Text tab, every logger's metrics).

``MetricsRecorder`` is handed its probes and reads the Trainer; it knows nothing of the callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from pytorch_lightning.utilities import rank_zero_info

from lightmem.config import format_bytes
from lightmem.lightning_packages import is_tensorboard_logger, lightning_logs_this_step, logged_step
from lightmem.metrics.names import BY_KEY, GiB, key
from lightmem.metrics.probes import (
    HostProbe,
    LightmemProbe,
    NvmlProbe,
    OptimizerOffloadProbe,
    PlanPeaks,
    PlanProbe,
    ProbeUnavailable,
    TorchAllocatorProbe,
)
from lightmem.metrics.ranks import RankMax
from lightmem.metrics.tensorboard import custom_scalars_layout
from lightmem.tables import format_table, markdown_table

if TYPE_CHECKING:  # a Trainer of either Lightning package
    import pytorch_lightning as pl

SUMMARY_PREFIX = "lightmem/summary"
SUMMARY_TITLE = "lightmem: memory summary of this fit"

# Readable label and logged metric of each peak the summary reports.
_SUMMARY_PEAKS = (
    ("peak GPU allocated", "gpu/step_peak_allocated_GiB"),
    ("peak GPU reserved", "gpu/reserved_GiB"),
    ("peak device used (NVML)", "device/used_GiB"),
    ("peak host RSS", "host/rss_GiB"),
    ("peak host buffers held", "host/pinned_GiB"),
)


class Probe(Protocol):
    group: str

    def collect(self) -> dict[str, float]: ...

    def end_step(self) -> None: ...


@dataclass(frozen=True)
class SummaryFigure:
    """One line of the end-of-fit summary."""

    label: str
    """As a person reads it: ``peak host RSS``."""
    name: str
    """As logged, under ``lightmem/summary/``: ``peak/host/rss_GiB``."""
    value: float
    unit: str
    """``GiB``, ``ms``, ``ratio`` or ``count``."""

    def readable(self) -> str:
        if self.unit == "GiB":
            return format_bytes(self.value * GiB)
        if self.unit == "ms":
            return f"{self.value:.2f} ms"
        if self.unit == "ratio":
            return f"{self.value:.2f}"
        return f"{self.value:.0f}"


def build_probes(
    groups: Sequence[str],
    device: torch.device,
    *,
    host_bytes_held: Callable[[], int] | None,
    host_bytes_peak_in_use: Callable[[], int] = lambda: 0,
    checkpointed_blocks: int,
    optimizer_offload_stats: Callable[[], list[Any]] | None = None,
    plan_peaks: PlanPeaks | None = None,
) -> tuple[list[Any], dict[str, str]]:
    """The probes of ``groups`` that can run here, and for the others why not.

    ``host_bytes_held`` is None when offload is off (no host buffers to report); the ``lightmem``
    group reports offload traffic only with offload on and the block count only with blocks,
    model-state offload figures only when ``optimizer_offload_stats`` is given, and the predicted
    and measured peak of ``plan="auto"`` only when ``plan_peaks`` is given.
    """
    probes: list[Any] = []
    off: dict[str, str] = {}
    for group in groups:
        try:
            if group == "gpu":
                probes.append(TorchAllocatorProbe(device))
            elif group == "device":
                probes.append(NvmlProbe(device))
            elif group == "host":
                probes.append(HostProbe(host_bytes_held, host_bytes_peak_in_use))
            elif group == "lightmem" and (host_bytes_held is not None or checkpointed_blocks):
                blocks = (lambda: checkpointed_blocks) if checkpointed_blocks else None
                probes.append(LightmemProbe(blocks, offload=host_bytes_held is not None))
            if group == "lightmem" and optimizer_offload_stats is not None:
                probes.append(OptimizerOffloadProbe(optimizer_offload_stats))
            if group == "lightmem" and plan_peaks is not None:
                probes.append(PlanProbe(plan_peaks))
        except ProbeUnavailable as error:
            off[group] = str(error)
    return probes, off


def max_over_ranks(
    values: dict[str, float], rank_max: Callable[[list[float]], list[float]]
) -> dict[str, float]:
    """Memory figures (``reduce_max``) as their maximum over ranks; the rest as this rank's."""
    names = [name for name in values if BY_KEY[name].reduce_max]
    reduced = rank_max([values[name] for name in names])  # CPU tensors over gloo: no GPU sync
    return {**values, **dict(zip(names, reduced))}


class MetricsRecorder:
    """Reads ``probes`` on every logged optimizer step and sends the figures to the Trainer's loggers.

    Args:
        probes: objects with ``group``, ``collect()`` and ``end_step()`` (``lightmem.metrics.probes``).
        log_every_n_steps: log every n optimizer steps, starting with the first (None: on the
            steps Lightning logs its own metrics, which ``Trainer(log_every_n_steps=0)`` makes none,
            less the step a stopping Trainer adds: ``lightning_logs_this_step``).
            Either way at Lightning's step values (``logged_step``).
        tensorboard_panels: with the first logged step, write a Custom Scalars layout of the
            metrics really logged to every TensorBoard logger.
        checkpointed_blocks: blocks recomputed in backward, for the summary (0: none).
    """

    def __init__(
        self,
        probes: Sequence[Any],
        *,
        log_every_n_steps: int | None = None,
        tensorboard_panels: bool = True,
        checkpointed_blocks: int = 0,
    ) -> None:
        self._offload = False
        self._plan_worst_ratio: float | None = None  # kept from plan_peaks when the recorder closes
        self._plan_step_ratio: float | None = None  # the same
        self.traffic: LightmemProbe | None = None
        self.use_probes(probes, checkpointed_blocks)
        self._optimizer_totals: dict[str, float] = {}
        self.log_every_n_steps = log_every_n_steps
        self.tensorboard_panels = tensorboard_panels
        self.last_metrics: dict[str, float] = {}
        """The metrics of the last logged step, as logged (with DDP: the max over ranks)."""
        self.last_local_metrics: dict[str, float] = {}
        """The same figures for this process alone."""
        self._rank_max = RankMax()
        self._last_step = -1
        self._panels_drawn: set[str] = set()
        self._peaks: dict[str, float] = {}
        self._offloaded_bytes = 0
        self._wait_s = 0.0
        self._steps = 0

    def use_probes(self, probes: Sequence[Any], checkpointed_blocks: int) -> None:
        """Read ``probes`` from now on (a new plan changed what is on); totals and peaks so far stay.

        A plan may change between the micro-batches of one optimizer step: the traffic of those
        before it moves to the new probes, so the step's figures stay whole. Once offload figures
        are logged they stay (zeros while nothing moves), under a plan that offloads nothing too.
        """
        previous = self.traffic
        self.probes = list(probes)
        self.traffic = next(
            (probe for probe in self.probes if isinstance(probe, LightmemProbe) and probe.offload), None
        )
        if previous is not None:
            if self.traffic is None:
                self.traffic = LightmemProbe(None, offload=True)
                self.probes.append(self.traffic)
            self.traffic.totals.add(previous.totals)
        self._offload = self._offload or self.traffic is not None
        self.optimizer_offload = next((probe for probe in self.probes if isinstance(probe, OptimizerOffloadProbe)), None)
        self.plan_peaks = next((probe.peaks for probe in self.probes if isinstance(probe, PlanProbe)), None)
        self.checkpointed_blocks = checkpointed_blocks

    # -- every batch -------------------------------------------------------------------------------

    def add_traffic(self, stats: Any) -> None:
        """One micro-batch's ``OffloadStats``: summed into the step it belongs to."""
        if self.traffic is not None:
            self.traffic.add(stats)

    def batch_end(self, trainer: pl.Trainer) -> None:
        """Record a step when the optimizer stepped (not between accumulated micro-batches)."""
        if trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        self._end_of_step(trainer)

    def start(self, trainer: pl.Trainer) -> None:
        """A fit starts at ``trainer.global_step`` (which a resumed fit does not start at 0)."""
        self._last_step = trainer.global_step

    def _end_of_step(self, trainer: pl.Trainer) -> None:
        # Probes run on logged steps only (the host probe costs ~0.1-0.4 ms); the per-step traffic
        # totals of the summary are plain attribute reads.
        self._steps += 1
        if self.traffic is not None:
            self._offloaded_bytes += self.traffic.totals.offloaded_bytes
            self._wait_s += self.traffic.totals.wait_s
        if self.optimizer_offload is not None:
            figures = self.optimizer_offload.figures()
            for name in ("grad_bytes_out", "param_bytes_in", "waited_s"):
                self._optimizer_totals[name] = self._optimizer_totals.get(name, 0.0) + figures[name]
            peak = max(self._optimizer_totals.get("peak_host_bytes", 0.0), figures["host_bytes"])
            self._optimizer_totals["peak_host_bytes"] = peak
        logged = self._logs(trainer, trainer.global_step)
        # The fit's first step is read even when not logged: short fits and log_every_n_steps=0
        # still get its peaks in the summary and in last_metrics.
        read = logged or self._steps == 1
        values: dict[str, float] = {}
        for probe in self.probes:
            if read:
                values.update(probe.collect())
            probe.end_step()
        if not read:
            return
        for _, name in _SUMMARY_PEAKS:
            if key(name) in values:
                self._peaks[name] = max(self._peaks.get(name, 0.0), values[key(name)])
        self.last_local_metrics = values
        if trainer.world_size > 1:
            values = max_over_ranks(values, self._rank_max)
        self.last_metrics = values
        if not logged or not trainer.is_global_zero:
            return
        if self.tensorboard_panels and not set(values) <= self._panels_drawn:  # first, or a new plan's metrics
            self._panels_drawn |= set(values)
            layout = custom_scalars_layout(self._panels_drawn)
            for logger in trainer.loggers:
                if is_tensorboard_logger(logger):
                    logger.experiment.add_custom_scalars(layout)
        step = logged_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)

    def _logs(self, trainer: pl.Trainer, steps: int) -> bool:
        """Whether the optimizer step that brings ``trainer.global_step`` to ``steps`` is logged."""
        if self.log_every_n_steps is not None:
            return (steps - 1) % self.log_every_n_steps == 0
        return lightning_logs_this_step(trainer)

    def reads_the_step_running(self, trainer: pl.Trainer) -> bool:
        """During an optimizer step, before the Trainer counts it: whether the probes are read at
        its batch's end (the step is logged, or it is the fit's first), so that a figure taken
        during the step (the gradient norm) is taken only where it is read."""
        return self._steps == 0 or self._logs(trainer, trainer.global_step + 1)

    # -- end of fit ----------------------------------------------------------------------------------

    def summary(self) -> list[SummaryFigure]:
        """Peaks over the logged steps, offload traffic and waits per step (over every step),
        checkpointed blocks."""
        figures = [
            SummaryFigure(label, f"peak/{name}", self._peaks[name], BY_KEY[key(name)].unit)
            for label, name in _SUMMARY_PEAKS
            if name in self._peaks
        ]
        steps = max(self._steps, 1)
        if self._offload and self._steps:
            offloaded_GiB = self._offloaded_bytes / steps / GiB
            figures.append(
                SummaryFigure("offloaded per step", "offloaded_per_step_GiB", offloaded_GiB, "GiB")
            )
            wait_ms = self._wait_s / steps * 1e3
            figures.append(SummaryFigure("compute waited per step", "wait_per_step_ms", wait_ms, "ms"))
        if self.optimizer_offload is not None and self._steps:
            totals, count = self._optimizer_totals, self._steps
            figures += [
                SummaryFigure("optimizer offload: host bytes held (peak)", "optimizer/host_peak_GiB", totals["peak_host_bytes"] / GiB, "GiB"),
                SummaryFigure("optimizer offload: gradients to host per step", "optimizer/grads_out_per_step_GiB", totals["grad_bytes_out"] / count / GiB, "GiB"),
                SummaryFigure("optimizer offload: parameters to device per step", "optimizer/params_in_per_step_GiB", totals["param_bytes_in"] / count / GiB, "GiB"),
                SummaryFigure("optimizer offload: waited per step", "optimizer/wait_per_step_ms", totals["waited_s"] / count * 1e3, "ms"),
            ]
        ratio = self.plan_peaks.worst_ratio if self.plan_peaks is not None else self._plan_worst_ratio
        if ratio is not None:
            figures.append(SummaryFigure("plan: worst measured / predicted reserved peak", "plan/worst_peak_ratio", ratio, "ratio"))
        step = _step_ratio(self.plan_peaks) if self.plan_peaks is not None else self._plan_step_ratio
        if step is not None:
            figures.append(SummaryFigure("plan: measured / predicted step (last plan)", "plan/step_ratio", step, "ratio"))
        if self.checkpointed_blocks:
            blocks = float(self.checkpointed_blocks)
            figures.append(SummaryFigure("blocks checkpointed", "checkpointed_blocks", blocks, "count"))
        return figures

    def publish_summary(self, trainer: pl.Trainer) -> None:
        """Report the summary as Lightning's own callbacks report (``rank_zero_info``: Lightning's
        logger, with or without a progress bar), write it to TensorBoard's Text tab and to every
        logger's metrics (``lightmem/summary/...``: CSV columns, TensorBoard scalars) at Lightning's
        step. Rank zero only."""
        figures = self.summary()
        if not figures or not trainer.is_global_zero:
            return
        rows = [(figure.label, figure.readable()) for figure in figures]
        rank_zero_info(format_table(rows, ("figure", "value"), title=SUMMARY_TITLE, align="lr"))
        step = logged_step(trainer)
        for logger in trainer.loggers:
            if is_tensorboard_logger(logger):
                text = markdown_table(rows, ("figure", "value"))
                logger.experiment.add_text(SUMMARY_PREFIX, text, step)
            values = {f"{SUMMARY_PREFIX}/{figure.name}": figure.value for figure in figures}
            logger.log_metrics(values, step=step)

    def close(self) -> None:
        """Drop the probes (psutil processes hold locks) and the plan state (its device): the
        recorder pickles with its figures."""
        if self.plan_peaks is not None:
            self._plan_worst_ratio = self.plan_peaks.worst_ratio
            self._plan_step_ratio = _step_ratio(self.plan_peaks)
        self.probes, self.traffic, self.plan_peaks = [], None, None


def _step_ratio(peaks: PlanPeaks) -> float | None:
    """The median step timed since ``plan="auto"``'s last plan was applied over that plan's predicted
    step (None: no step timed, or no step priced)."""
    measured = peaks.measured_step_s()
    predicted = peaks.plan.step_seconds if peaks.plan is not None else 0.0
    return measured / predicted if measured > 0 and predicted > 0 else None
