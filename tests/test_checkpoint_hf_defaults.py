"""Hugging Face models from their default configs (``use_cache=True``) train exactly under checkpointing.

Each block's forward would append to the model's key/value cache, so backward's recompute would
see a grown cache (torch's checkpoint then fails, or the returned cache grows in backward). While
lightmem checkpoints, training forwards run without a cache, as Hugging Face's own
``gradient_checkpointing_enable()`` does. The reference run is the same training without lightmem
with ``use_cache=False`` in its training forwards: T5's decoder computes different logits with a
cache than without one (Hugging Face's code alone, no lightmem: up to 1.2e-6 apart), while the
decoder-only families give bitwise the same training either way.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pytorch_lightning as pl  # noqa: E402
from exact import assert_same, assert_state_equal  # noqa: E402
from hf_defaults import BLOCKS, FAMILIES, default_batch, default_model, self_attention_keys  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightmem import LightMem, apply_checkpointing, offload_activations  # noqa: E402

POLICIES = ("full", "save_matmuls")
STEPS = 2


def _train(kind, policy=None, offload=False, use_cache=None):
    """Two AdamW steps in a plain loop (dropout active); returns (model, optimizer, caches returned)."""
    model = default_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = apply_checkpointing(model, [BLOCKS[kind]], policy=policy) if policy else None
    torch.manual_seed(5)
    caches = []
    for step in range(STEPS):
        options = {} if use_cache is None else {"use_cache": use_cache}
        context = offload_activations(model, min_bytes=0, devices=("cpu",)) if offload else contextlib.nullcontext()
        with context:
            output = model(**default_batch(kind, seed=step), **options)
        caches.append(output.past_key_values)
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, caches, handle


@pytest.fixture(scope="module")
def references():
    cache: dict[str, tuple] = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _train(kind, use_cache=False)[:2]
        return cache[kind]

    return get


@pytest.mark.filterwarnings("ignore:lightmem.*use_cache=False")
@pytest.mark.parametrize("offload", [False, True], ids=["alone", "with-offload"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", FAMILIES)
def test_default_config_trains_bitwise_equal_in_a_plain_loop(references, kind, policy, offload):
    model, optimizer, caches, _ = _train(kind, policy, offload)
    expected_model, expected_optimizer = references(kind)
    assert_state_equal(expected_model, model, expected_optimizer, optimizer)
    assert caches == [None] * STEPS  # training forwards ran without a cache


@pytest.mark.filterwarnings("ignore:lightmem.*use_cache=False")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decoder_only_families_train_bitwise_equal_to_their_default_cached_run(kind):
    expected_model, expected_optimizer, caches, _ = _train(kind)
    assert all(cache is not None for cache in caches)  # the run without lightmem kept its cache
    model, optimizer, _, _ = _train(kind, "save_matmuls", offload=True)
    assert_state_equal(expected_model, model, expected_optimizer, optimizer)


@pytest.mark.filterwarnings("ignore:lightmem.*use_cache=False")
def test_a_model_checkpointed_as_one_block_trains_without_its_cache():
    def gradients(checkpointed):
        torch.manual_seed(0)
        model = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128))
        options = {}
        if checkpointed:
            apply_checkpointing(model, ["GPT2Model"], policy="save_matmuls")  # the block makes the cache
        else:
            options["use_cache"] = False
        torch.manual_seed(5)
        output = model(default_batch("gpt2")["input_ids"], **options)
        assert output.past_key_values is None
        output.last_hidden_state.square().mean().backward()
        return {name: parameter.grad for name, parameter in model.named_parameters()}

    assert_same(gradients(False), gradients(True), "gradients")


class _Unique(transformers.GPT2LMHeadModel):
    """Its own class name, so the once-per-process warning is this test's alone."""


def test_training_without_a_cache_warns_once_and_leaves_the_config_alone():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = _Unique(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128)).train()
    handle = apply_checkpointing(model, ["GPT2Block"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            output = model(**default_batch("gpt2", seed=step), use_cache=True)  # asked for, in training
            assert output.past_key_values is None
            assert model.config.use_cache is True
            output.loss.backward()
    assert [str(w.message) for w in caught if "_Unique" in str(w.message)] == [
        "lightmem: _Unique runs its training forwards with use_cache=False while lightmem checkpoints blocks "
        "inside it (backward's recompute would fill the cache a second time); config.use_cache is left as you "
        "set it, so eval forwards and generation keep their cache"
    ]
    with torch.no_grad():  # training mode without grad: nothing is recomputed, the cache stays
        assert model(**default_batch("gpt2")).past_key_values is not None
    handle.remove()
    assert model(**default_batch("gpt2")).past_key_values is not None  # the training forward has it again


@pytest.mark.filterwarnings("ignore:lightmem.*got a cache")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5"])
def test_a_cache_returned_in_eval_is_not_changed_by_backward(kind, policy):
    def eval_step(checkpointed):
        model = default_model(kind).eval()
        if checkpointed:
            apply_checkpointing(model, [BLOCKS[kind]], policy=policy)
        output = model(**default_batch(kind), use_cache=True)  # grad enabled: a loss to backpropagate
        keys = [key.clone() for key in self_attention_keys(output.past_key_values)]
        output.loss.backward()
        assert_same(keys, self_attention_keys(output.past_key_values), "cached keys after backward")
        return {name: parameter.grad for name, parameter in model.named_parameters()}

    assert_same(eval_step(False), eval_step(True), "gradients")


class _Appends(nn.Module):
    """A block that keeps state in an argument: it appends its input to a memory list."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, memory):
        memory.append(x)
        return self.linear(torch.cat(memory).mean(0, keepdim=True).expand_as(x))


class _Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Appends()

    def forward(self, x, state):
        return self.block(x, memory=state["memory"]) if isinstance(state, dict) else self.block(x, state)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("as_keyword", [False, True], ids=["positional", "keyword"])
def test_a_block_that_changes_state_in_its_arguments_is_refused_by_name(policy, as_keyword):
    model = _Counts()
    apply_checkpointing(model, ["block"], policy=policy)
    state = {"memory": [torch.zeros(1, 4)]} if as_keyword else [torch.zeros(1, 4)]
    with pytest.raises(RuntimeError) as raised:
        model(torch.randn(1, 4, requires_grad=True), state)
    argument = "'memory' (list)"
    assert str(raised.value) == (
        f"lightmem: checkpointed block 'block' (_Appends) changed its argument {argument} during forward; "
        "backward's recompute would read that changed state and change it again, so its gradients would be "
        "wrong. Keep such state out of the block's arguments in training (for a cache: use_cache=False), "
        "or leave the block out of checkpointing"
    )
    with torch.no_grad():  # not checkpointed without grad: the block may keep its state
        model(torch.randn(1, 4), state)


class _Settings:
    """State a block only reads: a scale tensor, a NaN fill value, a list of masks."""

    def __init__(self) -> None:
        self.scale = torch.full((4,), 0.5)
        self.fill = float("nan")
        self.masks = [torch.ones(4)]


class _Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, settings, extra):
        return self.linear(x * settings.scale * settings.masks[0] + extra["bias"]).relu()


def test_a_block_that_only_reads_state_in_its_arguments_is_checkpointed_as_usual():
    def gradients(checkpointed):
        torch.manual_seed(0)
        model = _Reads()
        handle = apply_checkpointing(model, ["_Reads"]) if checkpointed else None
        model(torch.randn(2, 4), _Settings(), {"bias": torch.ones(4)}).sum().backward()
        assert handle is None or handle.modules == [""]
        return {name: parameter.grad for name, parameter in model.named_parameters()}

    assert_same(gradients(False), gradients(True), "gradients")


# -- in a Lightning fit ----------------------------------------------------------------------------


class LitHF(pl.LightningModule):
    def __init__(self, kind: str, use_cache: bool | None = None) -> None:
        super().__init__()
        self.model = default_model(kind)
        self.options = {} if use_cache is None else {"use_cache": use_cache}

    def training_step(self, batch, batch_idx):
        return self.model(**batch, **self.options).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(kind, callback=None, use_cache=None):
    pl.seed_everything(0, verbose=False)
    module = LitHF(kind, use_cache)
    loader = DataLoader([default_batch(kind, seed=step) for step in range(STEPS)], batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[callback] if callback else [],
    )  # fmt: skip
    trainer.fit(module, loader)
    return module, trainer.optimizers[0]


@pytest.fixture(scope="module")
def fit_references():
    """The reference fit (``use_cache=False``, no lightmem) of each family, trained once; tests only read it."""
    cache: dict[str, tuple] = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _fit(kind, use_cache=False)
        return cache[kind]

    return get


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", FAMILIES)
def test_default_config_trains_bitwise_equal_in_a_lightning_fit(fit_references, kind, policy):
    expected_module, expected_optimizer = fit_references(kind)
    callback = LightMem(
        checkpoint=[BLOCKS[kind]], checkpoint_policy=policy, offload_devices=["cpu"], offload_min_bytes=0, metrics=[]
    )
    module, optimizer = _fit(kind, callback)
    assert_state_equal(expected_module, module, expected_optimizer, optimizer)
    assert module.model.config.use_cache is True
    assert module.model(**default_batch(kind)).past_key_values is not None  # after fit: hooks gone


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")
def test_plan_auto_checkpoints_a_default_config_llama_and_trains_bitwise_equal(fit_references):
    from lightmem import estimate_memory

    def peak(**options):
        loss = lambda m, b: m(**b).loss  # noqa: E731
        return estimate_memory(default_model("llama"), default_batch("llama"), loss, device="cpu", **options).peak_bytes

    checkpointed = peak(checkpoint=[BLOCKS["llama"]], checkpoint_policy="save_matmuls")
    budget = checkpointed + (peak() - checkpointed) // 4  # checkpointing fits, the plain step does not
    callback = LightMem(
        plan="auto", device_budget=budget, checkpoint_policy="save_matmuls", offload_devices=["cpu"], metrics=[]
    )
    expected_module, expected_optimizer = fit_references("llama")
    module, optimizer = _fit("llama", callback)
    assert callback.chosen_plan.fits and callback.chosen_plan.checkpoint
    assert_state_equal(expected_module, module, expected_optimizer, optimizer)
