"""Every example runs as documented (with fewer steps)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(args, tmp_path, steps="2"):
    env = {**os.environ, "LIGHTMEM_EXAMPLE_STEPS": steps, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_main_example_trains_and_writes_tensorboard_panels(tmp_path):
    out = _run([str(EXAMPLES / "gpt_lightmem.py")], tmp_path)
    assert "lightmem: memory summary of this fit" in out
    assert "blocks checkpointed" in out
    assert list((tmp_path / "runs" / "gpt_lightmem").glob("version_0/events.out.tfevents.*"))


def test_plain_pytorch_offload_example(tmp_path):
    out = _run([str(EXAMPLES / "offload_plain.py")], tmp_path)
    assert "offloaded_tensors" in out and "step 2:" in out


def test_lightning_cli_example_accepts_every_flag_from_yaml(tmp_path):
    out = _run(
        [str(EXAMPLES / "lightning_cli.py"), "fit", "--config", str(EXAMPLES / "lightmem_cli.yaml"),
         "--trainer.max_steps=2"],
        tmp_path,
    )  # fmt: skip
    assert "blocks checkpointed" in out


def test_deep_convnet_example_explains_why_it_did_not_fit(tmp_path):
    out = _run([str(EXAMPLES / "deep_convnet.py")], tmp_path, steps="1")
    assert "parameters: 206,538,153" in out
    assert "static-exceeds-budget" in out
    assert "With LightMem(offload_optimizer=True): 1.85 GiB on the device (fits 2 GiB), 1.54 GiB on the host" in out
