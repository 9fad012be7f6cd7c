"""Both Lightning packages: ``pytorch_lightning`` and ``lightning.pytorch`` (``import lightning as L``).

The fit, metrics, plan and estimator tests that run under both are parametrized with the
``lightning_package`` fixture in their own files; here: what only concerns the packages.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from lit_models import lit_gpt_class
from models import Block

from lightmem import LightMem
from lightmem.checkpoint import existing_checkpointing
from lightmem.lightning_packages import is_lightning_module, is_tensorboard_logger


def test_lightning_cli_of_either_package_accepts_lightmem_from_a_class_path(lightning_package, tmp_path):
    cli = pytest.importorskip(f"{lightning_package.__name__}.cli")
    parsed = cli.LightningCLI(
        lit_gpt_class(lightning_package), run=False, save_config_callback=None,
        args=[
            "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
            "--trainer.callbacks+=lightmem.LightMem", "--trainer.callbacks.offload_min_bytes=64KiB",
            "--trainer.callbacks.checkpoint=[Block]",
        ],
    )  # fmt: skip
    (callback,) = [c for c in parsed.trainer.callbacks if isinstance(c, LightMem)]
    assert isinstance(callback, lightning_package.Callback)
    assert callback.settings.offload.min_bytes == 64 * 1024
    assert callback.settings.checkpoint.targets == ("Block",)


def test_either_packages_fsdp_strategy_that_checkpoints_is_detected(lightning_package):
    strategy = lightning_package.strategies.FSDPStrategy(activation_checkpointing_policy={Block})
    reason = existing_checkpointing(strategy, lit_gpt_class(lightning_package)())
    assert reason == "the FSDPStrategy already checkpoints (activation_checkpointing_policy)"


def test_module_and_logger_checks_recognise_either_package(lightning_package, tmp_path):
    assert is_lightning_module(lit_gpt_class(lightning_package)())
    assert is_tensorboard_logger(lightning_package.loggers.TensorBoardLogger(tmp_path))
    assert not is_tensorboard_logger(lightning_package.loggers.CSVLogger(tmp_path))
    assert not is_lightning_module(Block(8, 2))


def test_lightmem_imports_and_trains_where_the_lightning_package_is_not_installed():
    # sys.modules[name] = None makes every `import lightning...` raise ImportError, as if absent.
    script = """
import sys
sys.modules["lightning"] = None
import pytorch_lightning as pl, torch
from pytorch_lightning.demos.boring_classes import BoringModel
from lightmem import LightMem, estimate_memory
assert [base.__module__ for base in LightMem.__bases__] == ["pytorch_lightning.callbacks.callback"]
callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, metrics=["lightmem"])
trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[callback], enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(BoringModel())
print(callback.summary()["offloaded per step"], estimate_memory(BoringModel(), torch.randn(2, 32), device="cpu").optimizer)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "144 B SGD"
