"""Blocks are the repeated layers of real models, and a plan is a promise on a real CPU step.

GPT-2, Llama, BERT and T5 are built from ``transformers`` configs (small, random weights,
nothing downloaded). The promise is checked against a real CPU step measured by torch's
MemTracker in a child process (this file run as a script), as in test_estimate_accuracy.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightmem import estimate_memory, plan  # noqa: E402
from lightmem.blocks import find_blocks  # noqa: E402

BATCH, SEQ, VOCAB = 4, 64, 512
MODELS = ("gpt2", "llama", "bert", "t5")


def hf_model(kind: str) -> nn.Module:
    """A 4-layer, width-128 model of the given family with random weights."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    if kind == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=SEQ,
        )  # fmt: skip
        return transformers.BertForMaskedLM(config)
    if kind == "t5":
        config = transformers.T5Config(
            num_layers=4, num_decoder_layers=4, d_model=128, d_ff=256, num_heads=4, d_kv=32,
            vocab_size=VOCAB, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return transformers.T5ForConditionalGeneration(config)
    raise KeyError(kind)


def hf_batch(kind: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    if kind == "t5":
        return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=generator)}
    return {"input_ids": ids, "labels": ids.clone()}


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def half_activations_budget(kind: str) -> int:
    """Parameters + gradients + optimizer state + half the activations (the issue's budget)."""
    base = estimate_memory(hf_model(kind), hf_batch(kind), hf_loss, device="cpu")
    return base.static_bytes + (base.peak_bytes - base.static_bytes) // 2


LAYERS = {
    "gpt2": [f"transformer.h.{i}" for i in range(4)],
    "llama": [f"model.layers.{i}" for i in range(4)],
    "bert": [f"bert.encoder.layer.{i}" for i in range(4)],
    "t5": [f"encoder.block.{i}" for i in range(4)] + [f"decoder.block.{i}" for i in range(4)],
}


@pytest.mark.parametrize("kind", MODELS)
def test_blocks_are_the_repeated_layers_wherever_they_sit(kind):
    blocks = find_blocks(hf_model(kind))
    assert sorted(blocks.repeated) == sorted(LAYERS[kind])
    assert {blocks.kind(name) for name in blocks.repeated} == {
        "gpt2": {"GPT2Block"}, "llama": {"LlamaDecoderLayer"}, "bert": {"BertLayer"}, "t5": {"T5Block"},
    }[kind]  # fmt: skip


def test_a_sequential_conv_stack_is_opened_and_shown_with_class_names():
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 4),
    )  # fmt: skip
    model = nn.Module()
    model.net = net
    model.head = nn.Linear(4, 2)
    blocks = find_blocks(model)
    assert list(blocks.modules) == ["net.0", "net.1", "net.2", "net.3", "net.4", "net.5", "net.6", "head"]
    assert sorted(blocks.repeated) == ["net.0", "net.3"]
    est = estimate_memory(
        model, torch.randn(2, 3, 8, 8), lambda m, x: m.head(m.net(x)).sum(), device="cpu"
    )
    assert est.blocks["net.3"].label == "net.3 (Conv2d)"
    assert "net.3 (Conv2d)" in est.to_text(width=200)


def test_plan_checkpoints_gpt2_decoder_layers_and_says_which():
    budget = half_activations_budget("gpt2")
    result = plan(hf_model("gpt2"), hf_batch("gpt2"), budget, hf_loss, device="cpu")
    assert result.fits and result.predicted_total_bytes <= budget
    assert result.checkpoint and set(result.checkpoint) <= set(LAYERS["gpt2"])
    names = sorted(result.checkpoint, key=lambda name: int(name.rsplit(".", 1)[1]))
    first, last = names[0].rsplit(".", 1)[1], names[-1].rsplit(".", 1)[1]
    span = f"transformer.h.{first}" if first == last else f"transformer.h.{first}-{last}"
    assert f"checkpoint {span} (GPT2Block)" in result.describe()


@pytest.fixture(scope="module")
def promises() -> dict[str, dict]:
    done = subprocess.run(
        [sys.executable, __file__, "--promise"], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {item["kind"]: item for item in json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("kind", MODELS)
def test_the_plan_applied_keeps_a_real_cpu_step_within_the_budget(promises, kind):
    result = promises[kind]
    assert result["fits"], result
    assert result["checkpoint"] and set(result["checkpoint"]) <= set(LAYERS[kind])
    assert result["measured_peak"] <= result["budget"], result
    # Without the plan the same real step does not fit: the plan is what makes it fit.
    assert result["measured_baseline_peak"] > result["budget"], result


def test_lightmem_plan_auto_checkpoints_llama_layers_in_a_lightning_fit():
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from lightmem import LightMem
    from lightmem.checkpoint import is_checkpointed

    class LitHF(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_model("llama")

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    budget = half_activations_budget("llama")
    batches = [hf_batch("llama")] * 3
    loader = DataLoader(batches, batch_size=None)
    callback = LightMem(plan="auto", device_budget=budget, offload_devices=["cpu"], metrics=[])
    seen: list[list[str]] = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append([name for name, m in pl_module.named_modules() if is_checkpointed(m)])

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, Spy()],
    )  # fmt: skip
    trainer.fit(LitHF(), loader)
    chosen = callback.chosen_plan
    assert trainer.global_step == 3
    assert chosen.fits and chosen.predicted_total_bytes <= budget
    layers = {f"model.{name}" for name in LAYERS["llama"]}
    assert chosen.checkpoint and set(chosen.checkpoint) <= layers
    assert seen == [sorted(chosen.checkpoint, key=lambda n: int(n.rsplit(".", 1)[1]))] * 3


def _promise_child() -> None:
    from lightmem import apply_checkpointing
    from lightmem.testing.measure import measure_cpu_step

    torch.set_num_threads(1)
    results = []
    for kind in MODELS:
        budget = half_activations_budget(kind)
        chosen = plan(hf_model(kind), hf_batch(kind), budget, hf_loss, device="cpu")
        baseline = measure_cpu_step(hf_model(kind), hf_batch(kind), hf_loss)
        model = hf_model(kind)
        apply_checkpointing(model, chosen.checkpoint)
        measured = measure_cpu_step(model, hf_batch(kind), hf_loss)
        results.append({
            "kind": kind, "budget": budget, "fits": chosen.fits, "checkpoint": chosen.checkpoint,
            "predicted_peak": chosen.predicted_peak_bytes, "measured_peak": measured.peak_bytes,
            "measured_baseline_peak": baseline.peak_bytes,
        })  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__" and sys.argv[1:] == ["--promise"]:
    sys.path.insert(0, os.path.dirname(__file__))
    _promise_child()
