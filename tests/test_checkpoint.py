"""Selective checkpointing: exact gradients, less memory, clean handles, composition with offload."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from bn_models import TinyResNet, image_batches
from conftest import assert_bitwise_equal, run_grads
from exact import assert_same, assert_state_equal
from models import Block, TinyGPT, gpt_loss
from torch import nn

from lightmem import apply_checkpointing, offload_activations
from lightmem.checkpoint import is_checkpointed


def _gpt(depth=4, seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(depth=depth)  # train mode: dropout active
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(seed))
    return model, lambda m: gpt_loss(m, tokens)


def _checkpointed(targets, every_n=1, offload=False):
    def make(model):
        apply_checkpointing(model, targets, every_n)
        if offload:
            return offload_activations(model, min_bytes=0, devices=("cpu",))
        return None

    return make


class _Maybe:
    """Adapts run_grads' context factory: apply checkpointing, then maybe enter offload."""

    def __init__(self, make):
        self.make = make

    def __call__(self, model):
        context = self.make(model)
        return context if context is not None else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("offload", [False, True], ids=["alone", "with-offload"])
@pytest.mark.parametrize("every_n", [1, 2])
def test_gradients_bitwise_equal_with_dropout(every_n, offload, autocast):
    model, loss_fn = _gpt()
    expected, _ = run_grads(model, loss_fn, autocast=autocast)
    actual, _ = run_grads(model, loss_fn, _Maybe(_checkpointed(["Block"], every_n, offload)), autocast=autocast)
    assert_bitwise_equal(expected, actual)


def _peak_bytes(model, loss_fn) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            loss_fn(model).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_peak_memory_falls_for_a_twelve_block_transformer():
    torch.manual_seed(0)
    model = TinyGPT(dim=128, depth=12, seq=128)
    tokens = torch.randint(0, 128, (8, 129))

    def loss_fn(m):
        return gpt_loss(m, tokens)

    baseline = _peak_bytes(model, loss_fn)
    model.zero_grad(set_to_none=True)
    handle = apply_checkpointing(model, "Block")
    checkpointed = _peak_bytes(model, loss_fn)
    handle.remove()
    assert checkpointed < 0.5 * baseline, (checkpointed, baseline)


def _resident_peak(depth: int, checkpoint: bool) -> int:
    model, loss_fn = _gpt(depth)
    if checkpoint:
        apply_checkpointing(model, "Block")
    # Block inputs (32 KiB) move; smaller saved tensors (LayerNorm statistics, ...) stay.
    with offload_activations(model, min_bytes="16KiB", devices=("cpu",), prefetch=0) as off:
        loss = loss_fn(model)
    loss.backward()
    return off.stats.peak_resident_bytes


def test_checkpoint_with_offload_keeps_device_resident_bytes_flat_as_depth_grows():
    assert _resident_peak(6, checkpoint=True) == _resident_peak(12, checkpoint=True)
    assert _resident_peak(12, checkpoint=False) > _resident_peak(6, checkpoint=False)


def test_block_inputs_of_checkpointed_blocks_pass_through_offload():
    model, loss_fn = _gpt(depth=4)
    apply_checkpointing(model, "Block")
    with offload_activations(model, min_bytes=0, devices=("cpu",)) as off:
        loss = loss_fn(model)
    loss.backward()
    block_input_bytes = 4 * 32 * 64 * 4  # (batch, seq, dim) float32 entering each block
    assert off.stats.offloaded_bytes >= 4 * block_input_bytes


def test_handle_lists_outermost_blocks_in_order_and_every_nth():
    model, _ = _gpt(depth=5)
    handle = apply_checkpointing(model, ["Block", "blocks.*.attn"], every_n=2)
    assert handle.modules == ["blocks.0", "blocks.2", "blocks.4"]
    assert [is_checkpointed(b) for b in model.blocks] == [True, False, True, False, True]
    assert not any(is_checkpointed(m) for m in model.modules() if not isinstance(m, Block))


def test_classes_and_patterns_mix():
    model, _ = _gpt(depth=3)
    handle = apply_checkpointing(model, [Block, "ln_f"])
    assert handle.modules == ["blocks.0", "blocks.1", "blocks.2", "ln_f"]


def test_names_state_dict_and_parameters_are_unchanged():
    model, _ = _gpt()
    names = [n for n, _ in model.named_modules()]
    keys = list(model.state_dict())
    params = list(model.parameters())
    handle = apply_checkpointing(model, "Block")
    assert [n for n, _ in model.named_modules()] == names
    assert list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), params))
    handle.remove()


def test_remove_restores_the_original_forward_and_bitwise_behaviour():
    model, loss_fn = _gpt()
    expected, _ = run_grads(model, loss_fn)
    handle = apply_checkpointing(model, "Block")
    handle.remove()
    assert not any("forward" in b.__dict__ for b in model.blocks)
    actual, _ = run_grads(model, loss_fn)
    assert_bitwise_equal(expected, actual)


def test_applying_twice_does_not_wrap_twice():
    model, _ = _gpt(depth=2)
    first = apply_checkpointing(model, "Block")
    wrapper = model.blocks[0].forward
    second = apply_checkpointing(model, "Block")
    assert model.blocks[0].forward is wrapper
    assert wrapper.inner.__func__ is Block.forward  # the original, not another wrapper
    assert second.modules == first.modules
    first.remove()
    assert is_checkpointed(model.blocks[0])  # still applied by the second call
    second.remove()
    assert not is_checkpointed(model.blocks[0])
    second.remove()  # removing twice is harmless


def test_an_instance_forward_set_before_is_restored():
    model, _ = _gpt(depth=1)
    custom = model.blocks[0].forward
    model.blocks[0].forward = custom
    handle = apply_checkpointing(model, "Block")
    handle.remove()
    assert model.blocks[0].__dict__["forward"] is custom


def test_deepcopy_and_pickle_rebind_to_the_copied_module():
    model, loss_fn = _gpt(depth=2)
    apply_checkpointing(model, "Block")
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.blocks[0].forward.inner.__self__ is clone.blocks[0]
        loss_fn(clone).backward()
        assert clone.blocks[0].ln1.weight.grad is not None
        assert model.blocks[0].ln1.weight.grad is None


class _Flexible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x, *, scale=1.0, as_dict=False):
        y = torch.tanh(self.linear(x)) * scale
        return {"y": y, "z": y.sum()} if as_dict else (y, y.mean())


class _UsesBlockTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Flexible()

    def forward(self, x):
        y, _ = self.block(x, scale=2.0)
        out = self.block(y, as_dict=True)
        return out["y"].sum() + out["z"]


def test_keyword_arguments_tuple_and_dict_outputs_and_repeated_calls():
    torch.manual_seed(0)
    model = _UsesBlockTwice()
    x = torch.randn(8, 16, requires_grad=True)
    expected, _ = run_grads(model, lambda m: m(x))
    actual, _ = run_grads(model, lambda m: m(x), _Maybe(_checkpointed(["_Flexible"])))
    assert_bitwise_equal(expected, actual)


def test_without_grad_the_block_runs_plainly():
    model, _ = _gpt(depth=1)
    apply_checkpointing(model, "Block")
    with torch.no_grad():
        out = model(torch.randint(0, 128, (2, 8)))
    assert out.shape == (2, 8, 128)


def test_target_matching_nothing_names_the_closest_classes_and_modules():
    model, _ = _gpt()
    with pytest.raises(ValueError) as error:
        apply_checkpointing(model, "Blok")
    assert str(error.value) == (
        "apply_checkpointing(targets=...): 'Blok' matches no module of the model; closest names: Block, blocks"
    )


@pytest.mark.parametrize("every_n", [0, -1, 1.5, True])
def test_every_n_must_be_a_positive_integer(every_n):
    model, _ = _gpt()
    with pytest.raises(ValueError) as error:
        apply_checkpointing(model, "Block", every_n=every_n)
    assert str(error.value) == f"apply_checkpointing(every_n=...): expected an integer >= 1; got {every_n!r}"


class _TakesDebug(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, debug=False):  # a keyword named like a torch.utils.checkpoint option
        return self.linear(x) * (2.0 if debug else 1.0)


def test_block_keywords_named_like_checkpoint_options_reach_the_block():
    block = _TakesDebug()
    x = torch.randn(2, 4, requires_grad=True)
    expected = block(x, debug=True)
    apply_checkpointing(block, "_TakesDebug")
    assert torch.equal(block(x, debug=True), expected)


# -- checkpoint recompute never updates buffers a second time (issue 8) ---------------------------


def _train_resnet(targets=None, every_n=1, offload=None, steps=4):
    """4 AdamW steps of TinyResNet; returns (model, optimizer, RNG state after training)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = TinyResNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = apply_checkpointing(model, targets, every_n) if targets else None
    images, labels = image_batches(steps)
    torch.manual_seed(1)
    for step in range(steps):
        batch = slice(8 * step, 8 * step + 8)
        context = offload_activations(model, min_bytes=offload, devices=("cpu",)) if offload is not None else _Null()
        with context:
            loss = F.cross_entropy(model(images[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if handle is not None:
        handle.remove()
    return model, optimizer, torch.get_rng_state()


@pytest.mark.parametrize("offload", [None, 0, "1MiB"], ids=["alone", "offload-min-0", "offload-default"])
@pytest.mark.parametrize("every_n", [1, 2])
def test_training_state_with_buffers_updated_in_forward_is_bitwise_equal(every_n, offload):
    expected = _train_resnet()
    actual = _train_resnet(["ResBlock", "Head"], every_n, offload)
    assert_state_equal(expected[0], actual[0], expected[1], actual[1])
    assert_same(expected[2], actual[2], "CPU RNG state")
    assert int(actual[0].blocks[0].bn1.num_batches_tracked) == 4
    assert int(actual[0].blocks[0].counter.steps) == 4


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum-0.1", "momentum-None"])
def test_batchnorm1d_statistics_take_one_update_per_forward(momentum):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=momentum))
    model = copy.deepcopy(plain)
    apply_checkpointing(model, ["1"])
    x = torch.randn(4, 8)
    for m in (plain, model):
        m(x).sum().backward()
        m(x * 2).sum().backward()
    assert int(model[1].num_batches_tracked) == 2
    assert_state_equal(plain, model)
    assert_same({n: p.grad for n, p in plain.named_parameters()}, {n: p.grad for n, p in model.named_parameters()})


def test_recompute_sees_buffer_values_of_its_forward_also_on_a_second_backward():
    from bn_models import StepCounter

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), StepCounter(), nn.Linear(8, 1))
    model = copy.deepcopy(plain)
    apply_checkpointing(model, ["1"])
    x = torch.randn(4, 8)
    grads = []
    for m in (plain, model):
        m(x).sum().backward()  # counter 0 -> 1
        loss = m(x).sum()  # counter 1 -> 2: the recompute must see 1, as the forward did
        loss.backward(retain_graph=True)
        loss.backward()  # a second recompute of the same forward
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    assert int(model[1].steps) == 2
    assert_state_equal(plain, model)
    assert_same(grads[0], grads[1], "gradients")


# -- class-name targets match through wrapper subclasses (issue 9) ---------------------------------


def test_class_name_targets_match_subclasses_such_as_fsdp2_dynamic_classes():
    from torch.distributed.fsdp import FSDPModule

    model, loss_fn = _gpt(depth=3)
    expected, _ = run_grads(model, loss_fn)
    # fully_shard swaps each sharded module's class for a dynamic FSDP<Name>(FSDPModule, <Name>).
    sharded = type("FSDPBlock", (FSDPModule, Block), {})
    for block in model.blocks:
        block.__class__ = sharded
    handle = apply_checkpointing(model, "Block")
    assert handle.modules == ["blocks.0", "blocks.1", "blocks.2"]
    handle.remove()
    assert apply_checkpointing(model, "FSDPBlock").modules == handle.modules
    for block in model.blocks:
        block.__class__ = Block
    actual, _ = run_grads(model, loss_fn)
    assert_bitwise_equal(expected, actual)


def test_class_name_target_module_does_not_select_every_module():
    model, _ = _gpt(depth=1)
    with pytest.raises(ValueError, match="'Module' matches no module of the model"):
        apply_checkpointing(model, "Module")


def test_under_torch_compile_buffers_take_one_update_per_forward():
    # torch.compile accepts no plain context managers in checkpoint; its own recomputation is part
    # of the compiled backward and does not re-apply buffer updates.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), nn.Linear(8, 1))
    model = copy.deepcopy(plain)
    apply_checkpointing(model, ["1"])
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)
    for m in (plain, compiled):
        for _ in range(2):
            m(x).sum().backward()
    assert int(model[1][1].num_batches_tracked) == 2
    assert_state_equal(plain, model)
    assert_same({n: p.grad for n, p in plain.named_parameters()}, {n: p.grad for n, p in model.named_parameters()})


@pytest.mark.parametrize("targets", [["features"], ["Conv2d", "BatchNorm2d"]], ids=["whole-stack", "each-layer"])
def test_convnet_batchnorm_state_is_exact_over_three_sgd_steps(targets):
    from models import make_case

    states = []
    for checkpointed in (False, True):
        model, loss_fn = make_case("cnn")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if checkpointed:
            apply_checkpointing(model, targets)
        for _ in range(3):
            loss_fn(model).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        states.append((model, optimizer))
    assert_state_equal(states[0][0], states[1][0], states[0][1], states[1][1])
    assert int(states[1][0].features[1].num_batches_tracked) == 3
