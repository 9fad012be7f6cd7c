"""LitGPT as a tested client: its own models (tests/litgpt_models.py: Pythia, Llama-3 with grouped-query
attention, Gemma-2 with soft-capping, Phi-2 with a head bias; two layers of width 64 from each
family's config, nothing downloaded) trained with lightmem in a Trainer and in a Fabric loop,
estimated, planned and advised.

CI installs ``litgpt==0.5.13`` with ``--no-deps`` (.ci/run): its own pins would take transformers
back to 5.3; what its model code imports (torch, Lightning) is installed already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("litgpt")

import pytorch_lightning as pl  # noqa: E402
from exact import assert_state_equal  # noqa: E402
from lit_models import cpu_trainer  # noqa: E402
from litgpt_models import (  # noqa: E402
    FAMILIES, finetune_loss, lit_litgpt_class, litgpt_model, pretrain_loss, token_loader, tokens,
)  # fmt: skip

import lightmem  # noqa: E402
from lightmem import LightMem, PlanDoesNotFit, apply_checkpointing, estimate_memory, offload_activations  # noqa: E402
from lightmem.checkpoint import is_checkpointed  # noqa: E402

MODES = {
    "offload": {"offload_devices": ["cpu"], "offload_min_bytes": 0},
    "checkpoint": {"offload": False, "checkpoint": ["Block"]},
    "both": {"offload_devices": ["cpu"], "offload_min_bytes": 0, "checkpoint": ["Block"]},
}
WIDE = {"padded_vocab_size": 4096}
"""A vocabulary whose logits are most of the step (the loss-logits advice), at 64 positions."""

_REFERENCES: dict = {}


def _fit(callbacks, family, package, **module_kwargs):
    pl.seed_everything(0, verbose=False)
    module = lit_litgpt_class(package)(family, **module_kwargs)
    trainer = cpu_trainer(callbacks, package)
    trainer.fit(module, token_loader())
    return module, trainer


def _reference(family, package):
    key = (family, package.__name__)
    if key not in _REFERENCES:
        _REFERENCES[key] = _fit([], family, package)
    return _REFERENCES[key]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_bitwise_equal_with_offload_checkpointing_and_both(family, mode, lightning_package):
    expected = _reference(family, lightning_package)
    callback = LightMem(**MODES[mode])
    actual = _fit([callback], family, lightning_package)
    assert_state_equal(expected[0], actual[0], expected[1].optimizers[0], actual[1].optimizers[0])
    summary = callback.summary()
    assert summary.get("blocks checkpointed") == ("2" if "checkpoint" in MODES[mode] else None)
    assert ("offloaded per step" in summary) == (mode != "checkpoint")
    if mode != "checkpoint":
        assert not summary["offloaded per step"].startswith("0 ")


def test_a_fabric_loop_trains_bitwise_equal_with_offload_and_checkpointing():
    from lightning.fabric import Fabric

    def train(with_lightmem: bool):
        fabric = Fabric(accelerator="cpu", devices=1)
        model = litgpt_model("llama3")
        handle = apply_checkpointing(model, ["Block"]) if with_lightmem else None
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        offload = offload_activations(model, devices=("cpu",), min_bytes=0) if with_lightmem else None
        for (batch,) in token_loader():
            if offload is None:
                loss = pretrain_loss(model, batch)
            else:
                with offload:
                    loss = pretrain_loss(model, batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer, handle, offload

    expected_model, expected_optimizer, _, _ = train(False)
    model, optimizer, handle, offload = train(True)
    assert_state_equal(expected_model, model, expected_optimizer, optimizer)
    assert handle.modules == ["transformer.h.0", "transformer.h.1"]
    assert offload.stats.offloaded_bytes > 0 and offload.stats.reloaded_bytes == offload.stats.offloaded_bytes


@pytest.fixture(scope="module")
def measured_steps() -> dict[str, dict]:
    done = subprocess.run(
        [sys.executable, __file__, "--measure"], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {item["family"]: item for item in json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_estimated_to_the_byte_of_a_real_cpu_step(measured_steps, family):
    # MemTracker in a child process (test_estimate_accuracy.py's way); the CPU trace is exact.
    result = measured_steps[family]
    assert result["predicted_peak"] == result["measured_peak"], result


def test_plan_auto_fits_a_llama3_budget_and_trains_bitwise_equal(lightning_package):
    module_class = lit_litgpt_class(lightning_package)
    (batch,) = next(iter(token_loader()))
    baseline = estimate_memory(module_class("llama3"), (batch,), device="cpu")
    budget = baseline.static_bytes + (baseline.peak_bytes - baseline.static_bytes) * 6 // 10
    expected = _reference("llama3", lightning_package)
    checkpointed: list[list[str]] = []

    class Spy(lightning_package.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            checkpointed.append(sorted(name for name, m in pl_module.named_modules() if is_checkpointed(m)))

    callback = LightMem(plan="auto", device_budget=budget, offload_devices=["cpu"])
    actual = _fit([callback, Spy()], "llama3", lightning_package)
    chosen = callback.chosen_plan
    assert chosen.fits and chosen.predicted_total_bytes <= budget and chosen.checkpoint
    assert set(chosen.checkpoint) <= {"model.transformer.h.0", "model.transformer.h.1"}
    assert checkpointed == [sorted(chosen.checkpoint)] * 4
    assert_state_equal(expected[0], actual[0], expected[1].optimizers[0], actual[1].optimizers[0])


ADVISED = (
    "in litgpt_models.py:43, `return chunked_cross_entropy(logits, targets)`, compute the loss as "
    "`lightmem.linear_cross_entropy(hidden, model.lm_head.weight, targets{options})`, where hidden is the output of "
    "model.transformer.ln_f, which model.lm_head reads (have the model return it in place of the logits)"
)


@pytest.mark.parametrize(
    ("family", "options"),
    [("pythia", ""), ("llama3", ""), ("gemma2", ", softcap=30.0"), ("phi2", ", bias=model.lm_head.bias")],
)
def test_the_logits_advice_names_lm_head_and_carries_what_the_model_does_to_its_logits(family, options):
    # LitGPT's lm_head is not tied to transformer.wte and is registered before it.
    est = estimate_memory(litgpt_model(family, **WIDE), tokens(4, 64, 4096), pretrain_loss, device="cpu")
    advice = next(item.message for item in est.advice if item.rule == "loss-logits")
    assert "(256 x 4,096, from lm_head.weight)" in advice
    assert advice.split("The change: ")[1] == ADVISED.format(options=options) + "."


def test_following_the_advice_on_gemma2_gives_the_models_own_loss():
    model, data = litgpt_model("gemma2"), tokens()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits past the cap of 30
    hidden = []
    model.transformer.ln_f.register_forward_hook(lambda module, args, output: hidden.append(output))
    own = pretrain_loss(model, data)
    advised = lightmem.linear_cross_entropy(hidden[0], model.lm_head.weight, data[:, 1:], softcap=30.0)
    without_cap = lightmem.linear_cross_entropy(hidden[0], model.lm_head.weight, data[:, 1:])
    assert (advised - own).abs() <= 1e-6 * own.abs() and (without_cap - own).abs() > 1.0


def test_plan_auto_refusal_names_lm_head_and_what_it_reads(lightning_package):
    # Batches of one, and a budget under what the chunked loss needs for them (the searches for the
    # largest batch stop at once): the message names the change all the same.
    module_class = lit_litgpt_class(lightning_package)
    (batch,) = next(iter(token_loader(batch=1, seq=128)))
    one = estimate_memory(module_class("pythia", **WIDE), (batch,), device="cpu")
    budget = int(one.loss_logits.peak_bytes_chunked * 0.95)
    with pytest.raises(PlanDoesNotFit) as raised:
        pl.seed_everything(0, verbose=False)
        trainer = cpu_trainer([LightMem(plan="auto", device_budget=budget, offload_devices=["cpu"])], lightning_package)
        trainer.fit(module_class("pythia", **WIDE), token_loader(batch=1, seq=128))
    message = str(raised.value)
    assert "the loss's logits (128 x 4,096, from model.lm_head.weight)" in message
    assert f"To chunk the loss: {ADVISED.format(options='')}. " in message


def test_quadratic_attention_advice_only_where_a_product_of_query_and_key_feeds_a_softmax():
    # Llama-3 runs scaled_dot_product_attention; its MLP is as wide as the sequence is long (128).
    llama = estimate_memory(litgpt_model("llama3"), tokens(4, 128), pretrain_loss, device="cpu")
    assert "quadratic-attention" not in [item.rule for item in llama.advice]
    # Gemma-2 computes attention itself (its scores are soft-capped): q @ k.mT, tanh, softmax.
    gemma = estimate_memory(litgpt_model("gemma2"), tokens(4, 128), pretrain_loss, device="cpu")
    advice = [item.message for item in gemma.advice if item.rule == "quadratic-attention"]
    assert len(advice) == 1 and advice[0].startswith("4 saved tensors of shape like [4, 4, 128, 128] take 4.00 MiB")
    assert "in transformer.h.0-1 (Block)" in advice[0]


def test_litgpts_own_chunked_head_is_recognised_as_chunked():
    est = estimate_memory(litgpt_model("pythia", **WIDE), tokens(4, 64, 4096)[:, :-1], finetune_loss, device="cpu")
    assert (est.loss_logits.chunks, est.loss_logits.rows) == (4, 252)
    advice = next(item.message for item in est.advice if item.rule == "loss-logits")
    assert advice.endswith(
        "The model makes its logits in 4 products of lm_head.weight, each with its own loss (a chunked head: LitGPT's "
        "lm_head_chunk_size with chunked_cross_entropy): the loss is chunked already, so no change is proposed."
    )
    assert est.chunked_loss is None


LITGPT_OPTION = (
    "LitGPT's own option is its forward's lm_head_chunk_size=... with litgpt.utils.chunked_cross_entropy; "
    "lightmem.linear_cross_entropy computes the loss from what its lm_head reads, the logits never whole"
)


def test_chunked_causal_lm_loss_refuses_a_litgpt_model_naming_litgpts_own_option():
    with pytest.raises(ValueError) as raised:
        lightmem.chunked_causal_lm_loss(litgpt_model("pythia"))
    assert str(raised.value) == (
        "chunked_causal_lm_loss(model=...): GPT is a LitGPT model, which returns logits and leaves the loss to your "
        f"code: {LITGPT_OPTION}"
    )


def test_lightmem_chunked_loss_refuses_a_litgpt_module_naming_litgpts_own_option(lightning_package):
    with pytest.raises(ValueError) as raised:
        _fit([LightMem(chunked_loss=True)], "pythia", lightning_package)
    assert str(raised.value).endswith(f"leave chunked_loss off (GPT is a LitGPT model: {LITGPT_OPTION})")


def _measure_child() -> None:
    from lightmem.testing.measure import measure_cpu_step

    torch.set_num_threads(1)
    results = []
    for family in FAMILIES:
        estimate = estimate_memory(litgpt_model(family), tokens(), pretrain_loss, device="cpu")
        measured = measure_cpu_step(litgpt_model(family), tokens(), pretrain_loss)
        results.append({"family": family, "predicted_peak": estimate.peak_bytes, "measured_peak": measured.peak_bytes})
    print(json.dumps(results))


if __name__ == "__main__" and sys.argv[1:] == ["--measure"]:
    import os
    import warnings

    sys.path.insert(0, os.path.dirname(__file__))
    warnings.simplefilter("ignore")
    _measure_child()
