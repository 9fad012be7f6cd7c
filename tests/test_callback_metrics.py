"""Memory metrics every step: names, steps, loggers, TensorBoard panels, DDP, end-of-fit summary."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from csv import DictReader
from pathlib import Path

import pytest
import pytorch_lightning as pl
from lit_models import LitGPT, lit_gpt_class, token_loader
from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar
from pytorch_lightning.loggers import Logger, TensorBoardLogger

from lightmem import LightMem
from lightmem.metrics.names import METRICS
from lightmem.metrics.recorder import SUMMARY_TITLE
from lightmem.metrics.tensorboard import CATEGORY
from lightmem.tables import format_table, markdown_table

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []
        self.hparams: dict = {}

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        self.hparams.update(params)


def _fit(callback, logger, max_steps=5, package=pl, **kwargs):
    pl.seed_everything(0, verbose=False)
    kwargs = {"enable_progress_bar": False, **kwargs}
    trainer = package.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=logger, callbacks=[callback], enable_checkpointing=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip
    trainer.fit(lit_gpt_class(package)(), token_loader())
    return trainer


def _lightmem_rows(logger):
    return [(step, m) for step, m in logger.metrics if any(k.startswith("lightmem/memory/") for k in m)]


def test_metrics_are_logged_every_n_steps_starting_with_the_first():
    logger = MemoryLogger()
    _fit(LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"], log_every_n_steps=2), logger)
    rows = _lightmem_rows(logger)
    assert [step for step, _ in rows] == [0, 2, 4]  # optimizer steps 1, 3, 5 at Lightning's step values
    expected_keys = {m.key for m in METRICS if m.group in ("host", "lightmem") and "/optimizer/" not in m.key and "/plan/" not in m.key}
    for _, metrics in rows:
        assert set(metrics) == expected_keys
        assert metrics["lightmem/memory/host/rss_GiB"] > 0.01
        assert metrics["lightmem/memory/host/available_GiB"] > 0
        assert metrics["lightmem/memory/offload/offloaded_GiB"] > 0
        assert metrics["lightmem/memory/offload/offloaded_GiB"] == metrics["lightmem/memory/offload/reloaded_GiB"]
        assert metrics["lightmem/memory/host/pinned_GiB"] >= metrics["lightmem/memory/host/pinned_in_use_GiB"]
        assert metrics["lightmem/memory/host/pinned_in_use_GiB"] >= metrics["lightmem/memory/offload/offloaded_GiB"]
        assert metrics["lightmem/memory/checkpoint/blocks"] == 3


def test_traffic_is_summed_over_the_micro_batches_of_a_step():
    single, double = MemoryLogger(), MemoryLogger()
    _fit(LightMem(offload_devices=["cpu"], offload_min_bytes=0, log_every_n_steps=1), single, max_steps=2)
    _fit(LightMem(offload_devices=["cpu"], offload_min_bytes=0, log_every_n_steps=1), double, max_steps=2,
         accumulate_grad_batches=2)  # fmt: skip
    key = "lightmem/memory/offload/offloaded_GiB"
    one = _lightmem_rows(single)[0][1][key]
    two = _lightmem_rows(double)[0][1][key]
    assert two == 2 * one


def test_metric_groups_can_be_chosen():
    logger = MemoryLogger()
    _fit(LightMem(offload=False, metrics=["host"], log_every_n_steps=1), logger, max_steps=1)
    (_, metrics), = _lightmem_rows(logger)
    # offload is off: no host buffers of lightmem's to report, nor time page-locking them
    pool = {f"lightmem/memory/host/{name}" for name in ("pinned_GiB", "pinned_in_use_GiB", "page_lock_ms", "page_lock_wait_ms")}
    assert set(metrics) == {m.key for m in METRICS if m.group == "host"} - pool


def _summary_table(callback):
    return format_table(list(callback.summary().items()), ("figure", "value"), title=SUMMARY_TITLE, align="lr")


def _lightmem_reports(caplog):
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith(SUMMARY_TITLE)]


def test_end_of_fit_summary_is_reported_through_lightning_and_reaches_every_loggers_metrics(caplog):
    logger = MemoryLogger()
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"])
    with caplog.at_level(logging.INFO):
        _fit(callback, logger, max_steps=2, enable_progress_bar=True)
    assert _lightmem_reports(caplog) == [_summary_table(callback)]
    step, final = logger.metrics[-1]
    assert step == 2  # Lightning's step after two optimizer steps, where its own epoch-end metrics go
    assert final["lightmem/summary/checkpointed_blocks"] == 3.0
    assert final["lightmem/summary/peak/host/rss_GiB"] > 0.01
    assert final["lightmem/summary/offloaded_per_step_GiB"] > 0
    assert set(callback.summary()) == {
        "peak host RSS", "peak host buffers held", "offloaded per step", "compute waited per step", "blocks checkpointed"
    }  # fmt: skip


def test_end_of_fit_summary_is_reported_without_a_progress_bar_too(caplog):
    logger = MemoryLogger()
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"])
    with caplog.at_level(logging.INFO):
        _fit(callback, logger, max_steps=2)  # enable_progress_bar=False
    assert _lightmem_reports(caplog) == [_summary_table(callback)]
    assert logger.metrics[-1][1]["lightmem/summary/checkpointed_blocks"] == 3.0


def test_end_of_fit_summary_reaches_tensorboards_text_tab_and_the_csv(tmp_path, lightning_package):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = lightning_package.loggers
    tensorboard, csv = loggers.TensorBoardLogger(tmp_path, name="tb"), loggers.CSVLogger(tmp_path, name="csv")
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"], log_every_n_steps=1)
    _fit(callback, [tensorboard, csv], max_steps=2, package=lightning_package)
    accumulator = EventAccumulator(tensorboard.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    (text,) = accumulator.Tensors("lightmem/summary/text_summary")
    assert text.step == 2
    assert text.tensor_proto.string_val[0].decode() == markdown_table(list(callback.summary().items()), ("figure", "value"))
    assert [e.value for e in accumulator.Scalars("lightmem/summary/checkpointed_blocks")] == [3.0]
    with open(Path(csv.log_dir) / "metrics.csv") as file:
        rows = list(DictReader(file))
    assert rows[-1]["step"] == "2"
    assert float(rows[-1]["lightmem/summary/checkpointed_blocks"]) == 3.0
    assert float(rows[-1]["lightmem/summary/peak/host/rss_GiB"]) > 0.01


@pytest.mark.parametrize("bar", [RichProgressBar, TQDMProgressBar])
def test_end_of_fit_summary_is_reported_after_the_progress_bar_has_stopped(bar, capsys):
    drawn_before = []

    class AtSummary(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith(SUMMARY_TITLE):
                drawn_before.append(capsys.readouterr().out)

    handler = AtSummary()
    logging.getLogger().addHandler(handler)
    try:
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
            callbacks=[LightMem(offload_devices=["cpu"], checkpoint=["Block"]), bar()],
        )  # fmt: skip
        trainer.fit(LitGPT(), token_loader())
    finally:
        logging.getLogger().removeHandler(handler)
    (before,) = drawn_before
    assert "Epoch 0" in before
    assert "Epoch 0" not in capsys.readouterr().out  # nothing redrawn after the summary


def test_no_summary_and_no_panels_for_features_that_are_off(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    logger = TensorBoardLogger(tmp_path, name="run")
    callback = LightMem(log_every_n_steps=1)  # CPU-only defaults: offload off, nothing checkpointed
    _fit(callback, logger, max_steps=2)
    accumulator = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    logged = {tag for tag in accumulator.Tags()["scalars"] if tag.startswith("lightmem/memory/")}
    pool = {f"lightmem/memory/host/{name}" for name in ("pinned_GiB", "pinned_in_use_GiB", "page_lock_ms", "page_lock_wait_ms")}
    assert logged == {m.key for m in METRICS if m.group == "host"} - pool
    config = accumulator.Tensors("custom_scalars__config__")[0]
    (category,) = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0]).category
    assert {chart.title for chart in category.chart} == {
        "Host memory, this process (GiB)", "Host memory, machine (GiB)", "Host memory limit (GiB)"
    }  # fmt: skip
    assert callback.summary() == {"peak host RSS": callback.summary()["peak host RSS"]}


def test_tensorboard_event_files_hold_the_panels_and_the_scalars(tmp_path, lightning_package):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    logger = lightning_package.loggers.TensorBoardLogger(tmp_path, name="run")
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"], log_every_n_steps=1)
    _fit(callback, logger, max_steps=3, package=lightning_package)
    accumulator = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert "lightmem/memory/host/rss_GiB" in scalars
    assert [e.step for e in accumulator.Scalars("lightmem/memory/offload/offloaded_GiB")] == [0, 1, 2]
    config = accumulator.Tensors("custom_scalars__config__")[0]
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    (category,) = layout.category
    assert category.title == CATEGORY
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert charts["Host memory, this process (GiB)"] == [
        "lightmem/memory/host/rss_GiB", "lightmem/memory/host/pinned_GiB", "lightmem/memory/host/pinned_in_use_GiB",
        "lightmem/memory/host/workers_rss_GiB",
    ]  # fmt: skip
    assert charts["Host memory limit (GiB)"] == ["lightmem/memory/host/limit_GiB", "lightmem/memory/host/headroom_GiB"]
    assert charts["Host memory, machine (GiB)"] == [
        "lightmem/memory/host/available_GiB", "lightmem/memory/host/swap_used_GiB"
    ]  # fmt: skip
    assert charts["Offload traffic (GiB)"] == [
        "lightmem/memory/offload/offloaded_GiB", "lightmem/memory/offload/reloaded_GiB",
        "lightmem/memory/offload/deduplicated_GiB",
    ]  # fmt: skip
    assert charts["Offload kept on device (GiB)"] == [
        "lightmem/memory/offload/kept_GiB", "lightmem/memory/offload/budget_kept_GiB"
    ]  # fmt: skip
    assert charts["Checkpointed blocks (count)"] == ["lightmem/memory/checkpoint/blocks"]
    assert not [title for title in charts if title.startswith("GPU")]  # no CUDA here: those probe groups are off
    assert all(title.endswith(("(GiB)", "(count)", "(ms)")) for title in charts)


@pytest.fixture(scope="module")
def ddp_report(tmp_path_factory):
    """What tests/ddp_script.py saw: one launch of 2 CPU processes (gloo) for the DDP tests below."""
    if sys.platform != "linux":
        pytest.skip("gloo DDP subprocess test is Linux-only here")
    out = tmp_path_factory.mktemp("ddp")
    script = Path(__file__).parent / "ddp_script.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_ddp_on_two_cpu_processes_gives_equal_weights_and_logs_max_over_ranks(ddp_report):
    report = ddp_report
    assert report["weights_equal"] is True
    assert report["logged_steps"] == [0, 1, 2]
    assert report["logged_rss_GiB"] == max(report["local_rss_GiB"])  # the max over the two ranks


def test_ddp_with_plan_auto_plans_on_every_rank_and_logs_the_same_figures_on_each(ddp_report):
    report = ddp_report
    one_block = ["model.blocks.0"]  # each rank's batches are 4 x 33 tokens, as in test_callback_auto_plan.py
    (line,) = report["planned"][0]["plan_lines"]
    assert line.startswith(
        f"lightmem: plan for a 4.29 MiB device budget: checkpoint {one_block}, offload nothing; predicted peak 4.24 MiB "
        "(reserved, overhead allowance included), step "
    )
    assert report["planned"] == [
        {"checkpoint": one_block, "plan_lines": [line]},
        {"checkpoint": one_block, "plan_lines": []},  # the plan's line: rank zero only
    ]
    assert report["planned_equal"] is True  # the same state as a fit with the plan's flags from the start
    # Each rank reduces the same figures in the max over ranks: offload's too, although no plan offloads on CPU.
    logged = report["planned_logged"]
    assert logged["offload/offloaded_GiB"] == [0.0, 0.0, 0.0]
    assert logged["plan/measured_peak_GiB"] == [0.0, 0.0, 0.0]  # the simulated allocator's peak never rises
    assert len(logged["plan/predicted_peak_GiB"]) == 3 and logged["plan/predicted_peak_GiB"][0] > 0
