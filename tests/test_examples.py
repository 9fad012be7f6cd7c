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
    return result.stdout + result.stderr  # Lightning's logging (the end-of-fit summary) goes to stderr


def test_main_example_trains_and_writes_tensorboard_panels(tmp_path):
    out = _run([str(EXAMPLES / "gpt_lightmem.py")], tmp_path)
    assert "lightmem: memory summary of this fit" in out
    assert "blocks checkpointed" in out
    assert list((tmp_path / "runs" / "gpt_lightmem").glob("version_0/events.out.tfevents.*"))


def test_plain_pytorch_offload_example(tmp_path):
    out = _run([str(EXAMPLES / "offload_plain.py")], tmp_path)
    assert "offloaded_tensors" in out and "step 1:" in out and "step 2:" not in out


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
    # 1.89 GiB: the 1.85 GiB of the optim branch, the 16.25 MiB cuBLAS workspace the CUDA estimate counts
    # and what the caching allocator reserves beyond the allocated peak (its replay of the step).
    assert "With LightMem(offload_optimizer=True): 1.89 GiB on the device (fits 2 GiB), 1.54 GiB on the host" in out


def test_linear_cross_entropy_example_gives_the_hugging_face_loss_and_gradients():
    """The example's chunked loss (``lightmem.chunked_causal_lm_loss``) equals ``model(labels=...).loss``
    to float32 rounding (not bitwise: the chunks sum in another order). In process, on a tiny
    model: the script itself spends most of its time importing transformers and estimating a
    32k-vocabulary model."""
    import importlib.util

    import pytest
    import torch

    transformers = pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("hf_lce_example", EXAMPLES / "hf_linear_cross_entropy.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=4096, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    batch["labels"][:, :4] = -100
    reference = model(**batch).loss
    expected = example.gradients(model, reference)
    chunked = example.chunked_loss(model, batch)
    assert chunked.grad_fn.name() == "_LinearCrossEntropyBackward"
    actual = example.gradients(model, chunked)
    torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=0)
    assert expected.keys() == actual.keys() and len(expected) == len(list(model.parameters()))
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_newcomer_cpu_example_shows_each_mode_doing_its_job_on_a_cpu(tmp_path):
    import re

    out = _run([str(EXAMPLES / "newcomer_cpu.py")], tmp_path)
    # 1. activation offload, run on the CPU: saved activations went to host buffers.
    assert "lightmem: on: activation offload (tensors from 1.00 MiB); host, lightmem metrics." in out
    moved = re.search(r"activation offload: ([\d.]+) (KiB|MiB) of saved activations went to host buffers", out)
    assert moved and float(moved.group(1)) > 0
    # 2. plan="auto" for a budget under the step's peak: said at fit start, then a plan applied.
    assert "lightmem: on: plan='auto' (at the first training batch it chooses what to checkpoint; on a CPU it never offloads)" in out
    applied = re.search(r"plan applied: checkpoint \['model\.transformer\.h\.\d'.*; predicted peak ([\d.]+) MiB against ([\d.]+) MiB without lightmem", out)
    assert applied and float(applied.group(1)) < float(applied.group(2))
    assert "(priced at CPU figures: a generic server CPU; not measured on this machine)" in out
    # 3. optimizer offload: the optimizer stepped on the host.
    stepped = re.search(r"optimizer offload: (\d+) optimizer steps ran on the host .* moved ([\d.]+) KiB of gradients out", out)
    assert stepped and int(stepped.group(1)) == 2 and float(stepped.group(2)) > 0
    assert out.count("lightmem: memory summary of this fit") == 3  # without a progress bar too
