"""rich is optional: without it every report is a plain table, and lightmem never requires it
(with rich importable, Lightning switches every Trainer to RichProgressBar and RichModelSummary)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from lit_models import LitGPT, token_loader
from pytorch_lightning.callbacks import TQDMProgressBar

from lightmem import LightMem
from lightmem.cli import main
from lightmem.estimate.report import NOT_MODELLED

ROOT = Path(__file__).resolve().parent.parent
# Lightning imports rich itself when its metadata says it is installed: import Lightning first,
# then make rich (and what Lightning loaded of it) unimportable.
BLOCK_RICH = """
import sys
import pytorch_lightning
for name in [name for name in sys.modules if name == "rich" or name.startswith("rich.")] + ["rich"]:
    sys.modules[name] = None  # import: ModuleNotFoundError; importlib.util.find_spec: None
"""


@pytest.fixture
def without_rich(monkeypatch):
    """``import rich`` (and every ``rich.x``) raises ImportError, as when rich is not installed."""
    for name in ["rich", *(name for name in list(sys.modules) if name.startswith("rich."))]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError):
        import rich.console  # noqa: F401


def test_rich_is_an_extra_not_a_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [dep for dep in project["dependencies"] if dep.startswith("rich")]
    assert project["optional-dependencies"]["rich"] == ["rich>=13"]


def test_every_lightmem_module_imports_without_rich():
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in sorted((ROOT / "lightmem").rglob("*.py"))
        if path.name != "__init__.py"
    ]
    code = BLOCK_RICH + "".join(f"import {module}\n" for module in modules) + "print('ok')"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_cli_estimate_prints_plain_tables_without_rich(without_rich, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["estimate", "examples.estimate_factories:tiny_gpt", "--batch-size", "2", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("Estimated step memory on cpu (32-true, adamw, batch 2, ")
    assert out.splitlines()[1].split() == ["baseline"]
    assert "blocks.0 (Block)" in out
    assert out.rstrip().endswith(f"Not modelled: {len(NOT_MODELLED)} sources (CUDA context, fragmentation, ...); --verbose lists them.")
    assert not set(out) & set("┃━│┏")  # no box drawing: rich did not render it


def test_cli_estimate_verbose_lists_everything_not_modelled(without_rich, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["estimate", "examples.estimate_factories:tiny_gpt", "--batch-size", "2", "--device", "cpu", "--verbose"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    for item in NOT_MODELLED:
        assert " ".join(item.split()) in out


def test_fit_summary_and_oom_report_render_without_rich(without_rich, capsys, caplog):
    class OutOfMemory(LitGPT):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().training_step(batch, batch_idx)

    callback = LightMem(offload_devices=["cpu"], checkpoint=["Block"], log_every_n_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[callback, TQDMProgressBar()],  # the summary is reported where a progress bar shows
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(LitGPT(), token_loader())
    assert "lightmem: memory summary of this fit\nfigure" in caplog.text
    failing = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[LightMem(offload_devices=["cpu"], log_every_n_steps=1)],
    )  # fmt: skip
    with pytest.raises(torch.cuda.OutOfMemoryError):
        failing.fit(OutOfMemory(), token_loader())
    assert "lightmem: out of memory during training. What was on the device:\n  parameters" in capsys.readouterr().out
