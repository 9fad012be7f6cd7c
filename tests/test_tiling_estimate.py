"""``estimate_memory(tile=...)``: the dry run runs the tiled step, and its peak is the real step's.

The real steps are measured by MemTracker (``lightmem.testing.measure``) in a child process, as in
test_estimate_accuracy.py: its module hooks keep the measured model alive after it exits. The model
is a Llama shape (transformers' ``LlamaConfig``, random weights) at 256 positions with a wide MLP, so
that the MLP's intermediates dominate the step; eager attention, whose memory the estimate follows
exactly on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tile_models import blocks

from lightmem import estimate_memory

transformers = pytest.importorskip("transformers")

_MEASURE = """
import copy, json, sys
import torch, transformers
sys.path.insert(0, {tests!r})
from test_tiling_estimate import llama, llama_batch, llama_loss
from lightmem import apply_checkpointing, apply_tiling, estimate_memory
from lightmem.testing.measure import measure_cpu_step
torch.set_num_threads(1)
model = llama()
est = estimate_memory(model, llama_batch(), llama_loss, device="cpu", tile=["LlamaMLP"], checkpoint=["LlamaDecoderLayer"])
results = {{name: [scenario.peak_bytes, scenario.tiled] for name, scenario in est.scenarios.items()}}
for name, tiled, checkpointed in (("baseline", False, False), ("tile", True, False), ("checkpoint+tile", True, True)):
    real = copy.deepcopy(model)
    if checkpointed:
        apply_checkpointing(real, "LlamaDecoderLayer")
    if tiled:
        apply_tiling(real, "LlamaMLP")
    results[name].append(measure_cpu_step(real, llama_batch(), llama_loss).peak_bytes)
print(json.dumps(results))
"""


def llama() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=1024, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=128, max_position_embeddings=256, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def llama_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def llama_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


@pytest.fixture(scope="module")
def measured():
    script = _MEASURE.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario", ["baseline", "tile", "checkpoint+tile"])
def test_predicted_peak_matches_the_real_cpu_step_within_one_percent(measured, scenario):
    predicted, _, real = measured[scenario]
    assert abs(predicted - real) <= 0.01 * real


def test_tiling_the_mlps_takes_40_percent_off_the_real_peak_and_the_scenario_names_them(measured):
    assert measured["tile"][2] < 0.6 * measured["baseline"][2]
    assert measured["tile"][1] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert measured["baseline"][1] == []


def test_the_dry_run_leaves_the_model_untiled():
    model = blocks(depth=1)
    estimate = estimate_memory(model, torch.randn(2, 37, 16), lambda m, x: m(x).sum(), device="cpu", tile=["SwiGLU"])
    assert estimate.scenarios["tile"].tiled == ["0.mlp"]
    assert not any("forward" in module.__dict__ for module in model.modules())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"tile": ["MLP"]}, r"^estimate_memory\(tile=\.\.\.\): 'MLP' matches no module of the model"),
        ({"tile_tokens": 64}, r"^estimate_memory\(tile_tokens=\.\.\.\): has no effect without estimate_memory\(tile=\.\.\.\)"),
    ],
)
def test_bad_tile_arguments_name_the_estimators_argument(flags, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(llama(), llama_batch(), llama_loss, device="cpu", **flags)
