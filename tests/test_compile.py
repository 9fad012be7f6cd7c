"""lightmem under ``torch.compile``: hooks Dynamo never traces, checkpointing exact whatever Dynamo
captures, the same training as the compiled model without lightmem."""

from __future__ import annotations


import pytest
import torch
from exact import assert_same, assert_state_equal
from lit_models import cpu_trainer, lit_gpt_class, token_loader
from models import Block, TinyGPT, gpt_loss
from torch import nn
from torch._dynamo.utils import counters

from lightmem import LightMem, apply_checkpointing, estimate_memory, offload_activations
from lightmem.config import warn_once

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    # A finalizer that fails (a hook object Dynamo half-built) must fail the test, not print.
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]


class GraphBreakBlock(Block):
    """A transformer block whose forward breaks Dynamo's graph between attention and MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        torch._dynamo.graph_break()
        return x + self.mlp(self.ln2(x))


def _breaking_gpt(depth: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(dim=32, depth=depth, heads=2, seq=16)
    for block in model.blocks:
        block.__class__ = GraphBreakBlock
    return model


_TOKENS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))


def _compiled_steps(model: nn.Module, context=None, steps: int = 2):
    """``steps`` AdamW steps of ``model`` compiled whole (aot_eager), each forward inside
    ``context`` when given; returns the optimizer and the frames and graphs Dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(steps):
        if context is None:
            loss = gpt_loss(compiled, _TOKENS)
        else:
            with context:
                loss = gpt_loss(compiled, _TOKENS)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer, (dict(counters["frames"]), counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def breaking_gpt_without_lightmem():
    model = _breaking_gpt()
    optimizer, compiled = _compiled_steps(model)
    return model, optimizer, compiled


# -- Dynamo never traces the hooks ------------------------------------------------------------------


@pytest.mark.parametrize("min_bytes", [0, "1MiB"], ids=["every-tensor", "default-threshold"])
def test_a_graph_break_inside_a_submodule_leaves_the_hooks_untraced_and_training_exact(
    min_bytes, breaking_gpt_without_lightmem
):
    expected_model, expected_optimizer, expected_compiled = breaking_gpt_without_lightmem
    model = _breaking_gpt()
    offload = offload_activations(model, min_bytes=min_bytes, devices=("cpu",))
    optimizer, compiled = _compiled_steps(model, offload)
    # Dynamo compiled exactly the model's frames: none of lightmem's, no recompilation.
    assert compiled == expected_compiled
    assert_state_equal(expected_model, model, expected_optimizer, optimizer)
    assert offload.live_entries == 0
    if min_bytes == 0:
        assert offload.stats.offloaded_tensors > 0


def test_offload_entered_inside_a_compiled_function_runs_and_training_is_exact(breaking_gpt_without_lightmem):
    expected_model, expected_optimizer, _ = breaking_gpt_without_lightmem
    model = _breaking_gpt()
    offload = offload_activations(model, min_bytes=0, devices=("cpu",))

    def loss_of(tokens):
        with offload:  # Dynamo runs this frame eagerly and compiles what it calls
            return gpt_loss(model, tokens)

    torch._dynamo.reset()
    compiled_loss = torch.compile(loss_of, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(2):
        compiled_loss(_TOKENS).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert offload.stats.offloaded_tensors > 0 and not offload.active
    assert_state_equal(expected_model, model, expected_optimizer, optimizer)


@pytest.fixture(scope="module")
def lightning_fit_without_lightmem():
    return _fit_compiled(pytest.importorskip("pytorch_lightning"), callbacks=())


def _fit_compiled(package, callbacks):
    torch._dynamo.reset()
    torch.manual_seed(0)
    lit = lit_gpt_class(package)(depth=2)
    lit.model = _breaking_gpt()
    lit.model = torch.compile(lit.model, backend="aot_eager")
    torch.manual_seed(1)
    cpu_trainer(callbacks, package=package, max_steps=2).fit(lit, token_loader(batches=2, batch_size=2, seq=17))
    return lit


@pytest.mark.parametrize("checkpoint", [None, ["Block"]], ids=["offload", "offload+checkpoint"])
def test_lightning_fit_of_a_compiled_module_with_graph_breaks_is_exact(
    lightning_package, checkpoint, lightning_fit_without_lightmem
):
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=checkpoint, metrics=["lightmem"])
    lit = _fit_compiled(lightning_package, [callback])
    assert_same(lightning_fit_without_lightmem.state_dict(), lit.state_dict(), "state_dict")
    assert callback.last_metrics["lightmem/memory/offload/offloaded_GiB"] > 0
    assert callback.last_metrics.get("lightmem/memory/checkpoint/blocks", 0) == (2 if checkpoint else 0)


# -- checkpointing exact whatever Dynamo captures --------------------------------------------------


class BatchNormItemBlock(nn.Module):
    """BatchNorm, then a ``.item()`` (Dynamo cannot capture it) or a Python-side counter."""

    def __init__(self, graph_break: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.graph_break = graph_break
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.linear(x))
        if self.graph_break == "item":
            scale = 1.0 + 0.0 * h.abs().mean().item()
        elif self.graph_break == "counter":  # a side effect Dynamo cannot replay inside a checkpoint
            self.calls += 1
            scale = 1.0
        else:
            scale = 1.0
        return torch.relu(h) * scale


def _keep_relu(ctx, op, *args, **kwargs):
    return op.overloadpacket is torch.ops.aten.relu


def _block_model(graph_break: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), BatchNormItemBlock(graph_break), nn.Linear(8, 1))


def _train_compiled(model: nn.Module, backend: str, steps: int = 3):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        compiled(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


@pytest.mark.parametrize(
    ("graph_break", "policy"),
    [("item", "full"), ("item", "save_matmuls"), ("item", _keep_relu), ("counter", "full")],
    ids=["item-full", "item-save_matmuls", "item-callable", "counter-full"],
)
def test_a_checkpointed_block_that_breaks_the_graph_updates_buffers_once(graph_break, policy):
    expected = _block_model(graph_break)
    expected_optimizer = _train_compiled(expected, "aot_eager")
    model = _block_model(graph_break)
    apply_checkpointing(model, ["1"], policy=policy)
    optimizer = _train_compiled(model, "aot_eager")
    assert int(model[1].norm.num_batches_tracked) == 3
    assert_state_equal(expected, model, expected_optimizer, optimizer)


@pytest.mark.parametrize("graph_break", ["none", "item"])
def test_checkpointing_under_inductor_is_exact(graph_break):
    """Captured whole, the block is part of the compiled graph; breaking the graph, it runs eagerly
    inside torch's checkpoint (which compile never traces into), as the same block under
    ``torch.compiler.disable`` does without lightmem."""
    expected = _block_model("item")
    if graph_break == "none":
        expected[1].graph_break = "none"
    else:
        expected[1].forward = torch.compiler.disable(expected[1].forward)
    expected_optimizer = _train_compiled(expected, "inductor")
    model = _block_model("item")
    model[1].graph_break = graph_break
    apply_checkpointing(model, ["1"], policy="save_matmuls")
    optimizer = _train_compiled(model, "inductor")
    assert int(model[1].norm.num_batches_tracked) == 3
    assert_state_equal(expected, model, expected_optimizer, optimizer)


# -- names, scope and figures as the user sees them ----------------------------------------------


def _gpt(depth: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(dim=32, depth=depth, heads=2, seq=16)


_LM_HEAD_INPUT_BYTES = 2 * 16 * 32 * 4  # what lm_head saves: its (batch 2, 16 tokens, 32 features) fp32 input


def _offloaded_forward(compiled: nn.Module, model_for_names: nn.Module, **scope):
    offload = offload_activations(model_for_names, min_bytes=0, devices=("cpu",), **scope)
    with offload:
        loss = gpt_loss(compiled, _TOKENS)
    loss.backward()
    return offload.stats


@pytest.mark.parametrize("names_from", ["compiled", "original"])
def test_include_and_exclude_apply_under_whole_model_compile_with_the_users_names(names_from):
    torch._dynamo.reset()
    model = _gpt()
    compiled = torch.compile(model, backend="aot_eager")
    named = compiled if names_from == "compiled" else model
    excluded = _offloaded_forward(compiled, named, exclude=["lm_head"])
    assert excluded.kept_bytes == _LM_HEAD_INPUT_BYTES
    included = _offloaded_forward(compiled, named, include=["lm_head"])
    assert (included.offloaded_tensors, included.offloaded_bytes) == (1, _LM_HEAD_INPUT_BYTES)
    everything = _offloaded_forward(compiled, named)
    assert excluded.offloaded_bytes == everything.offloaded_bytes - _LM_HEAD_INPUT_BYTES


def test_a_scope_attached_after_the_graph_was_compiled_warns_that_it_does_not_apply(monkeypatch):
    monkeypatch.setitem(warn_once.__globals__, "_warned", set())
    torch._dynamo.reset()
    model = _gpt()
    compiled = torch.compile(model, backend="aot_eager")
    gpt_loss(compiled, _TOKENS).backward()  # compiled without the scope's hooks
    with pytest.warns(UserWarning, match=r"no selected module ran in this forward. If the model is compiled"):
        _offloaded_forward(compiled, model, include=["blocks.0"])


def test_module_patterns_match_the_users_names_on_compiled_models():
    model = _gpt()
    compiled = torch.compile(model, backend="aot_eager")
    handle = apply_checkpointing(compiled, ["blocks.*"])
    assert handle.modules == ["blocks.0", "blocks.1"]
    handle.remove()
    for index, block in enumerate(model.blocks):  # compiled per block, as torchtitan does
        model.blocks[index] = torch.compile(block, backend="aot_eager")
    assert apply_checkpointing(model, "Block").modules == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match=r"'block\.\*' matches no module of the model; closest names: blocks\.") as error:
        offload_activations(compiled, exclude=["block.*"])
    assert "_orig_mod" not in str(error.value)


def test_offload_of_a_model_compiled_whole_compiles_it_one_block_at_a_time_and_says_so(monkeypatch):
    monkeypatch.setitem(warn_once.__globals__, "_warned", set())  # an earlier test may have said it once
    torch._dynamo.reset()
    model = _gpt(depth=8)
    (tokens,) = next(iter(token_loader(batches=1, batch_size=2, seq=17)))
    eager_peak, block_bytes = _plain_peak_and_block_bytes(model, lambda m: gpt_loss(m, tokens), "blocks.0")
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(UserWarning, match=r"the model is compiled whole; with activation offload on, it is compiled one block"):
        offload = offload_activations(compiled, min_bytes=0, devices=("cpu",), prefetch=0)
    with offload:
        loss = gpt_loss(compiled, tokens)
    loss.backward()
    assert offload.stats.peak_resident_bytes <= eager_peak + block_bytes
    assert not model.blocks[0]._forward_pre_hooks  # only while the context is active


def test_a_model_compiled_whole_with_fullgraph_is_left_whole_with_a_warning(monkeypatch):
    monkeypatch.setitem(warn_once.__globals__, "_warned", set())
    with pytest.warns(UserWarning, match=r"compiled whole with fullgraph=True.*compile each block instead"):
        offload = offload_activations(torch.compile(_gpt(), backend="aot_eager", fullgraph=True), devices=("cpu",))
    assert offload.compile_note is None


def test_peak_resident_bytes_counts_every_save_of_a_compiled_graph_until_it_has_run():
    torch._dynamo.reset()
    model = _gpt()
    compiled_loss = torch.compile(lambda tokens: gpt_loss(model, tokens), backend="aot_eager")
    offload = offload_activations(model, min_bytes=0, devices=("cpu",))
    with offload:  # one graph: its saves all reach the hooks when it has run
        loss = compiled_loss(_TOKENS)
    loss.backward()
    assert offload.stats.offloaded_bytes > 0
    assert offload.stats.peak_resident_bytes == offload.stats.offloaded_bytes


def test_lightning_offload_exclude_applies_to_a_compiled_module(lightning_package):
    torch._dynamo.reset()
    lit = lit_gpt_class(lightning_package)(depth=2)
    lit.model = torch.compile(_gpt(), backend="aot_eager")
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, offload_exclude=["model.lm_head"], metrics=["lightmem"])
    cpu_trainer([callback], package=lightning_package, max_steps=2).fit(lit, token_loader(batches=2, batch_size=2, seq=17))
    assert callback.last_metrics["lightmem/memory/offload/kept_GiB"] == _LM_HEAD_INPUT_BYTES / 2**30


# -- the device peak falls under whole-model compile ------------------------------------------------


def _peak_probe(package, callback: LightMem):
    """A callback of ``package`` that records, after each batch, the offload's peak of saved bytes on
    the device and the frames Dynamo has compiled so far."""

    class PeakProbe(package.Callback):
        def __init__(self) -> None:
            self.peaks: list[int] = []
            self.frames: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.peaks.append(callback.fit_session.offloader.stats.peak_resident_bytes)
            self.frames.append(counters["frames"]["total"])

    return PeakProbe()


def _fit_offloaded(package, lit, loader):
    """Three steps of ``lit`` under LightMem offloading every saved tensor (no prefetch, so the peak is
    the forward's); returns the callback, the probe and what LightMem printed."""
    torch._dynamo.reset()
    counters.clear()
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, prefetch_bytes=0, metrics=["lightmem"])
    probe = _peak_probe(package, callback)
    cpu_trainer([callback, probe], package=package, max_steps=3).fit(lit, loader)
    return callback, probe


def _plain_peak_and_block_bytes(model: nn.Module, loss_of, block: str) -> tuple[int, int]:
    """Eager offload's peak of saved bytes on the device, and the bytes one compiled block saves."""
    offload = offload_activations(model, min_bytes=0, devices=("cpu",), prefetch=0)
    with offload:
        loss = loss_of(model)
    loss.backward()
    eager_peak = offload.stats.peak_resident_bytes
    torch._dynamo.reset()
    compiled_block = model.get_submodule(block)
    parent, _, index = block.rpartition(".")
    model.get_submodule(parent)[int(index)] = torch.compile(compiled_block, backend="aot_eager")
    offload = offload_activations(model, min_bytes=0, devices=("cpu",), prefetch=0, include=[block])
    with offload:
        loss = loss_of(model)
    loss.backward()
    model.get_submodule(parent)[int(index)] = compiled_block
    return eager_peak, offload.stats.offloaded_bytes


def test_whole_model_compile_with_offload_holds_one_blocks_activations_at_a_time(lightning_package, caplog):
    loader = token_loader(batches=3, batch_size=2, seq=17)
    (tokens,) = next(iter(loader))
    model = _gpt(depth=8)
    eager_peak, block_bytes = _plain_peak_and_block_bytes(model, lambda m: gpt_loss(m, tokens), "blocks.0")
    lit = lit_gpt_class(lightning_package)(depth=8)
    lit.model = torch.compile(model, backend="aot_eager")
    with caplog.at_level("INFO"):
        callback, probe = _fit_offloaded(lightning_package, lit, loader)
    assert max(probe.peaks) <= eager_peak + block_bytes
    assert probe.frames[0] == probe.frames[-1]  # no recompilation after the first step
    assert (
        "lightmem: module 'model' is compiled whole; with activation offload on, it is compiled one block at a "
        "time instead (8 blocks: model.blocks.0, model.blocks.1, model.blocks.2, ...), with your compile options, "
        "so each block's activations leave the device when the block has run."
    ) in [record.getMessage() for record in caplog.records]
    assert not lit.model._orig_mod.blocks[0]._forward_pre_hooks  # gone with the fit


def test_a_hugging_face_model_compiled_whole_holds_one_layers_activations_at_a_time():
    transformers = pytest.importorskip("transformers")
    import pytorch_lightning as pl

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=8, n_embd=64, n_head=2, vocab_size=128))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss_of = lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
    eager_peak, block_bytes = _plain_peak_and_block_bytes(model, loss_of, "transformer.h.0")

    class LitHF(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.compile(model, backend="aot_eager")

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0], use_cache=False).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids.repeat(3, 1)), batch_size=2)
    callback, probe = _fit_offloaded(pl, LitHF(), loader)
    assert max(probe.peaks) <= eager_peak + block_bytes
    assert probe.frames[0] == probe.frames[-1]


def test_the_estimate_of_a_compiled_model_uses_the_users_names_and_says_how_far_its_figures_hold():
    model = _gpt()
    eager = estimate_memory(model, _TOKENS, gpt_loss, device="cpu", offload={"min_bytes": 0})
    compiled = estimate_memory(torch.compile(model, backend="aot_eager"), _TOKENS, gpt_loss, device="cpu", offload={"min_bytes": 0})
    assert list(compiled.blocks) == list(eager.blocks) == ["embed", "blocks.0", "blocks.1", "ln_f", "lm_head", "(outside blocks)"]
    assert compiled.peak_bytes == eager.peak_bytes
    assert (compiled.compiled, eager.compiled) == (True, False)
    assert "torch.compile: these figures are eager execution's" in compiled.to_text()
    assert "torch.compile" not in eager.to_text()
