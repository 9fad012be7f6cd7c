"""``lightmem.chunked_causal_lm_loss`` and ``LightMem(chunked_loss=True)``: a Hugging Face causal
LM's own loss (``labels=``) computed by ``lightmem.linear_cross_entropy``, the logits never made.

Models from default configs (tests/hf_defaults.py, no downloads); dropout stays on, each forward
seeded alike, so both losses see the same network. Tolerances: the loss within 1e-6 of its value,
each gradient within 2e-6 of its largest value (float32: the chunks sum in another order).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_defaults import VOCAB, default_batch, default_model  # noqa: E402
from lit_models import cpu_trainer  # noqa: E402
from test_loss import _LargestLogits  # noqa: E402

import lightmem  # noqa: E402
from lightmem import LightMem, estimate_memory  # noqa: E402
from lightmem.causal_lm import causal_lms  # noqa: E402

CHUNK = 8  # 2 x 16 positions: four chunks


def _loss_and_grads(model, batch, seed=3, **kwargs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch, **kwargs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_training_loss(expected, actual):
    (reference, grads), (chunked, got) = expected, actual
    assert (chunked.loss - reference.loss).abs() <= 1e-6 * reference.loss.abs()
    assert got.keys() == grads.keys()
    for name in grads:
        assert (got[name] - grads[name]).abs().max() <= 2e-6 * grads[name].abs().max(), name


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "qwen2"])
def test_the_chunked_loss_and_gradients_are_the_models_own(kind):
    model, batch = default_model(kind), default_batch(kind)
    batch["labels"][:, :3] = -100  # a prompt the loss ignores
    expected = _loss_and_grads(model, batch)
    handle = lightmem.chunked_causal_lm_loss(model, chunk_rows=CHUNK)
    actual = _loss_and_grads(model, batch)
    handle.remove()
    _assert_same_training_loss(expected, actual)
    assert actual[0].logits.shape == (2, 0, VOCAB)


def test_num_items_in_batch_and_shift_labels_are_the_models_own():
    model, batch = default_model("llama"), default_batch("llama")
    shifted = torch.roll(batch["labels"], -1, dims=1)
    options = {"num_items_in_batch": torch.tensor(40), "shift_labels": shifted}
    expected = _loss_and_grads(model, batch, **options)
    handle = lightmem.chunked_causal_lm_loss(model, chunk_rows=CHUNK)
    actual = _loss_and_grads(model, batch, **options)
    handle.remove()
    _assert_same_training_loss(expected, actual)


def test_no_logits_beyond_one_chunk_are_made_in_forward_or_backward():
    model, batch = default_model("gpt2"), default_batch("gpt2")
    handle = lightmem.chunked_causal_lm_loss(model, chunk_rows=CHUNK)
    with _LargestLogits(VOCAB) as chunked:
        model(**batch).loss.backward()
    handle.remove()
    with _LargestLogits(VOCAB) as unchunked:
        model(**batch).loss.backward()
    assert (chunked.rows, unchunked.rows) == (CHUNK, 32)


def test_evaluation_and_forwards_without_labels_are_untouched():
    model, batch = default_model("gpt2"), default_batch("gpt2")
    handle = lightmem.chunked_causal_lm_loss(model, chunk_rows=CHUNK)
    model.eval()
    with torch.no_grad():
        evaluated = model(**batch)
        without_labels = model(input_ids=batch["input_ids"])
    handle.remove()
    with torch.no_grad():
        reference = model(**batch)
    assert evaluated.logits.shape == without_labels.logits.shape == (2, 16, VOCAB)
    assert torch.equal(evaluated.logits, reference.logits) and torch.equal(evaluated.loss, reference.loss)


def test_remove_gives_the_model_its_own_loss_back():
    model = default_model("gpt2")
    own = model.loss_function
    handle = lightmem.chunked_causal_lm_loss(model)
    assert model.loss_function is not own
    handle.remove()
    assert model.loss_function is own and "_loss_function" not in vars(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not model.lm_head._forward_pre_hooks and not model.lm_head._forward_hooks


def _gemma2(vocab: int = VOCAB):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=vocab,
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config).train()  # final_logit_softcapping: 30.0 by default


def test_gemma2s_soft_capped_logits_are_capped_chunk_by_chunk_as_the_model_caps_them():
    model, batch = _gemma2(), default_batch("gemma2")
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits past the cap of 30: the cap changes the loss
    expected = _loss_and_grads(model, batch)
    handle = lightmem.chunked_causal_lm_loss(model, chunk_rows=CHUNK)
    actual = _loss_and_grads(model, batch)
    handle.remove()
    _assert_same_training_loss(expected, actual)
    assert actual[0].logits.shape == (2, 0, VOCAB)
    with torch.no_grad():  # the same model without its cap has another loss
        model.config.final_logit_softcapping = None
        assert (model(**batch).loss - expected[0].loss).abs() > 1.0


def test_a_model_that_changes_its_logits_otherwise_is_refused_at_its_first_forward_naming_the_ops():
    torch.manual_seed(0)
    config = transformers.CohereConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, eos_token_id=None,
    )  # fmt: skip
    model = transformers.CohereForCausalLM(config).train()  # logit_scale: 0.0625 by default
    lightmem.chunked_causal_lm_loss(model)
    with pytest.raises(RuntimeError) as raised:
        model(**default_batch("cohere"))
    assert str(raised.value) == (
        "lightmem: chunked loss: CohereForCausalLM changes its output head's logits before its loss (mul), which a "
        "chunked loss would leave out (it carries a soft-cap only); compute the loss yourself with "
        "lightmem.linear_cross_entropy, or leave chunked_loss off"
    )


def _custom_loss_model():
    model = default_model("gpt2")

    def mean_loss(logits, labels, vocab_size, **kwargs):
        return logits.mean()

    model.loss_function = mean_loss
    return model


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (lambda: default_model("t5"), "T5ForConditionalGeneration is an encoder-decoder; only a causal LM's loss is chunked"),
        (_custom_loss_model, "GPT2LMHeadModel's loss_function is 'mean_loss', not transformers' ForCausalLMLoss"),
        (lambda: torch.nn.Linear(2, 2), "Linear is not a Hugging Face model with an output head and a loss_function"),
    ],
)  # fmt: skip
def test_models_without_a_causal_lm_loss_are_refused(model, message):
    with pytest.raises(ValueError) as raised:
        lightmem.chunked_causal_lm_loss(model())
    assert str(raised.value) == f"chunked_causal_lm_loss(model=...): {message}"


class _LitCausalLM(__import__("pytorch_lightning").LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = default_model("gpt2")
        self.positions_with_logits: list[int] = []

    def training_step(self, batch, batch_idx):
        torch.manual_seed(batch_idx)
        out = self.model(**batch)
        self.positions_with_logits.append(out.logits.shape[1])
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(chunked_loss: bool, steps: int = 2):
    module = _LitCausalLM()
    loader = torch.utils.data.DataLoader([default_batch("gpt2", seed=step) for step in range(steps)], batch_size=None)
    trainer = cpu_trainer([LightMem(offload=False, metrics=[], chunked_loss=chunked_loss)], max_steps=steps)
    trainer.fit(module, loader)
    return module


def test_lightmem_chunked_loss_trains_the_models_own_loss_and_leaves_the_model_as_it_was():
    plain, chunked = _fit(False), _fit(True)
    assert (plain.positions_with_logits, chunked.positions_with_logits) == ([16, 16], [0, 0])
    for (name, expected), (_, got) in zip(plain.named_parameters(), chunked.named_parameters()):
        assert (got - expected).abs().max() <= 1e-6 * expected.abs().max(), name
    assert causal_lms(chunked) == [chunked.model]
    assert "_loss_function" not in vars(chunked.model) and not chunked.model.lm_head._forward_pre_hooks


def test_lightmem_chunked_loss_without_a_causal_lm_fails_at_fit_start():
    from lit_models import LitGPT, token_loader

    with pytest.raises(ValueError) as raised:
        cpu_trainer([LightMem(offload=False, metrics=[], chunked_loss=True)]).fit(LitGPT(), token_loader())
    assert str(raised.value) == (
        "LightMem(chunked_loss=...): the LightningModule holds no Hugging Face causal LM whose loss_function is "
        "transformers' ForCausalLMLoss; for a loss you compute yourself, call lightmem.linear_cross_entropy in "
        "training_step and leave chunked_loss off"
    )


def test_chunked_loss_flag_is_a_bool():
    with pytest.raises(ValueError) as raised:
        LightMem(chunked_loss="yes")
    assert str(raised.value) == "LightMem(chunked_loss=...): expected True or False; got 'yes'"


def _hf_loss(model, batch):
    return model(**batch).loss


def test_the_estimate_of_a_chunked_models_step_leaves_its_logits_out():
    # A 32k vocabulary on a width-64 GPT-2: the logits are most of the step.
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=32_000, n_positions=256)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32_000, (4, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    before = estimate_memory(model, batch, _hf_loss, device="cpu")
    handle = lightmem.chunked_causal_lm_loss(model)
    after = estimate_memory(model, batch, _hf_loss, device="cpu")
    handle.remove()
    advice = next(item.message for item in before.advice if item.rule == "loss-logits")
    assert "The change: the model computes its own loss (labels=...): LightMem(chunked_loss=True) (in plain " in advice
    assert "loss-logits" not in [item.rule for item in after.advice]
    assert after.loss_logits is None
    # The estimate of the real chunked step is what the advice predicted, within 1%.
    predicted = before.loss_logits.peak_bytes_chunked
    assert after.peak_bytes <= predicted <= 1.01 * after.peak_bytes
