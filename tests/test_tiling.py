"""Sequence tiling (``apply_tiling``): exact up to the stated tolerances, composing with checkpointing,
offload, autocast and compile, and refusing modules that mix positions.

"Within 1e-6" means: the largest difference of two tensors is at most 1e-6 of the largest entry of
the untiled one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from exact import assert_same
from tile_models import (
    ActivationObserver,
    BatchNormMLP,
    CapacityMoE,
    CountingMLP,
    IndexedPositions,
    SelfAttention,
    SequenceConv,
    ScalarNoise,
    SharedScale,
    SignRoutedMoE,
    balanced_tokens,
    SwiGLU,
    blocks,
)
from torch import nn

from lightmem import apply_checkpointing, apply_tiling, offload_activations
from lightmem.config import TileSettings
from lightmem.tiling import is_tiled, shard_lengths

SEQ, DIM = 37, 16  # 37 positions: shards of 8 leave a short last one


def _x(seed: int = 2, batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seed))


def _step(model: nn.Module, x: torch.Tensor, seed: int = 5, autocast: bool = False):
    """Loss, parameter gradients by name and the input's gradient of one forward and backward."""
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x).float().square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}, x.grad


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _tiled(model: nn.Module, **kwargs) -> nn.Module:
    tiled = copy.deepcopy(model)
    apply_tiling(tiled, "SwiGLU", **kwargs)
    return tiled


# -- exactness ------------------------------------------------------------------------------------


def test_fp32_loss_and_gradients_are_within_1e_6_of_the_untiled_model():
    model = blocks()
    loss, grads, x_grad = _step(model, _x())
    tiled_loss, tiled_grads, tiled_x_grad = _step(_tiled(model, tile_tokens=8), _x())
    assert _relative(tiled_loss, loss) <= 1e-6
    assert max(_relative(tiled_grads[name], grads[name]) for name in grads) <= 1e-6
    assert _relative(tiled_x_grad, x_grad) <= 1e-6


def test_one_shard_is_bitwise_the_untiled_model_dropout_and_rng_included():
    # Dropout draws the same masks (the first call's position-wise check leaves the RNG as it was),
    # and the step leaves the RNG where the untiled step leaves it.
    model = blocks(dropout=0.1)
    expected = _step(model, _x())
    expected_rng = torch.get_rng_state()
    actual = _step(_tiled(model, shards=1), _x())
    assert_same(expected, actual, "loss, gradients, input gradient")
    assert_same(expected_rng, torch.get_rng_state(), "RNG state after the step")


def test_the_first_calls_check_leaves_the_rng_as_it_was():
    torch.manual_seed(0)
    net = ScalarNoise(DIM)
    expected = _step(net, _x())
    expected_rng = torch.get_rng_state()
    tiled = copy.deepcopy(net)
    apply_tiling(tiled, "ScalarNoise", shards=1)
    assert_same(expected, _step(tiled, _x()), "loss, gradients, input gradient")
    assert_same(expected_rng, torch.get_rng_state(), "RNG state after the step")


def test_bf16_autocast_one_shard_is_bitwise_and_four_shards_are_close():
    # Backward runs outside autocast: the re-run must enter the forward's autocast itself.
    model = blocks()
    expected = _step(model, _x(), autocast=True)
    assert_same(expected, _step(_tiled(model, shards=1), _x(), autocast=True), "bf16, one shard")
    loss, grads, x_grad = _step(_tiled(model, shards=4), _x(), autocast=True)
    assert _relative(loss, expected[0]) <= 1e-2
    assert max(_relative(grads[name], expected[1][name]) for name in grads) <= 2e-2


def test_gradients_accumulate_over_shards_and_over_two_backward_passes():
    model, tiled = blocks(), _tiled(blocks(), tile_tokens=8)
    for net in (model, tiled):
        for seed in (2, 3):  # two micro-batches, no zero_grad between them
            x = _x(seed)
            net(x).square().mean().backward()
    for (name, expected), actual in zip(model.named_parameters(), tiled.parameters()):
        assert _relative(actual.grad, expected.grad) <= 1e-6, name


def test_each_parameter_gets_its_gradient_once_per_backward_through_autograd():
    # What DDP's reducer and FSDP2's reduce-scatter rely on: one accumulation per backward, after
    # every shard; and a hook on a parameter sees the sum, not each shard's part.
    tiled = _tiled(blocks(depth=1), tile_tokens=8)
    accumulations = {name: 0 for name, _ in tiled.named_parameters()}
    for name, param in tiled.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: accumulations.__setitem__(name, accumulations[name] + 1))
        param.register_hook(lambda grad: grad * 2)
    reference = blocks(depth=1)
    for param in reference.parameters():
        param.register_hook(lambda grad: grad * 2)
    for net in (reference, tiled):
        for seed in (2, 3):
            net(_x(seed)).square().mean().backward()
    assert set(accumulations.values()) == {2}
    for (name, expected), actual in zip(reference.named_parameters(), tiled.parameters()):
        assert _relative(actual.grad, expected.grad) <= 1e-6, name


def test_dropout_is_recomputed_with_each_shards_own_masks():
    # The reference runs the same shards with plain autograd: the same RNG draws in the same order.
    torch.manual_seed(0)
    mlp = SwiGLU(DIM, dropout=0.5)
    tiled = copy.deepcopy(mlp)
    apply_tiling(tiled, "SwiGLU", tile_tokens=8)
    x = _x()
    outputs, grads = [], []
    for net, tiles in ((mlp, True), (tiled, False)):
        leaf = x.clone().requires_grad_(True)
        torch.manual_seed(7)
        out = torch.cat([net(part) for part in leaf.split(8, dim=1)], dim=1) if tiles else net(leaf)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append([leaf.grad] + [p.grad for p in net.parameters()])
    assert torch.equal(outputs[0], outputs[1])
    assert max(_relative(actual, expected) for expected, actual in zip(*grads)) <= 1e-6


def test_a_buffer_the_forward_updates_is_updated_once_per_call():
    torch.manual_seed(0)
    mlp = CountingMLP(DIM)
    apply_tiling(mlp, "CountingMLP", tile_tokens=8)
    for _ in range(2):
        mlp(_x()).sum().backward()  # 5 shards forward, 5 re-runs backward
    assert mlp.calls.item() == 2


def test_the_input_kept_for_backward_goes_through_the_offload_hooks_and_nothing_else_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), SwiGLU(DIM, hidden=64))
    apply_tiling(model, "SwiGLU", tile_tokens=8)
    x = _x()
    with offload_activations(model, devices=("cpu",), min_bytes=0, include=["1"]) as off:
        loss = model(x).square().mean()
    loss.backward()
    assert off.stats.offloaded_bytes == x.nbytes  # the tile's input: one [2, 37, 16] fp32 tensor


def test_a_tiled_mlp_inside_checkpointed_blocks_under_offload_is_bitwise_with_one_shard():
    model = blocks(dropout=0.1)
    expected = _step(model, _x())
    wrapped = copy.deepcopy(model)
    apply_checkpointing(wrapped, "Block")
    apply_tiling(wrapped, "SwiGLU", shards=1)
    x = _x().requires_grad_(True)
    torch.manual_seed(5)
    with offload_activations(wrapped, devices=("cpu",), min_bytes=0) as off:
        loss = wrapped(x).float().square().mean()
    loss.backward()
    assert off.stats.offloaded_bytes > 0
    actual = (loss.detach(), {name: p.grad for name, p in wrapped.named_parameters()}, x.grad)
    assert_same(expected, actual, "checkpoint + offload + tile")


def test_a_tiled_mlp_inside_checkpointed_blocks_is_within_1e_6_with_five_shards():
    model = blocks(dropout=0.0)
    loss, grads, _ = _step(model, _x())
    wrapped = copy.deepcopy(model)
    apply_checkpointing(wrapped, "Block")
    apply_tiling(wrapped, "SwiGLU", tile_tokens=8)
    tiled_loss, tiled_grads, _ = _step(wrapped, _x())
    assert _relative(tiled_loss, loss) <= 1e-6
    assert max(_relative(tiled_grads[name], grads[name]) for name in grads) <= 1e-6


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_compiled_model_with_tiled_mlps_trains_as_eager(checkpointed):
    # The tiled module runs eagerly (torch.compiler.disable), the rest compiled around it; a
    # checkpointed block around it breaks the graph, so checkpoint runs that block eagerly.
    from torch._dynamo.utils import counters

    model = blocks()
    loss, grads, _ = _step(model, _x())
    wrapped = copy.deepcopy(model)
    if checkpointed:
        apply_checkpointing(wrapped, "Block")
    apply_tiling(wrapped, "SwiGLU", tile_tokens=8)
    torch._dynamo.reset()
    counters.clear()
    compiled_loss, compiled_grads, _ = _step(torch.compile(wrapped, backend="aot_eager"), _x())
    assert counters["frames"]["ok"] > 0 and (checkpointed or counters["stats"]["unique_graphs"] > 0)
    assert _relative(compiled_loss, loss) <= 1e-6
    assert max(_relative(compiled_grads[f"_orig_mod.{name}"], grads[name]) for name in grads) <= 1e-6


def test_without_grad_the_shards_run_and_nothing_is_kept():
    model = blocks().eval()
    tiled = _tiled(model, tile_tokens=8)
    with torch.no_grad():
        assert _relative(tiled(_x()), model(_x())) <= 1e-6


# -- the handle and the rule ----------------------------------------------------------------------


def test_remove_restores_the_forwards_and_a_deep_copy_stays_tiled():
    model = blocks()
    handle = apply_tiling(model, "SwiGLU")
    assert handle.modules == ["0.mlp", "1.mlp"]
    assert is_tiled(copy.deepcopy(model)[0].mlp)
    handle.remove()
    assert not any("forward" in module.__dict__ for module in model.modules())


@pytest.mark.parametrize(
    ("length", "width", "tile_tokens", "shards", "expected"),
    [
        (300, 64, 128, None, [128, 128, 44]),
        (10, 64, None, 4, [3, 3, 2, 2]),
        (3, 64, None, 4, [1, 1, 1]),
        (150, 64, None, None, [64, 64, 22]),  # default: as many positions as the input is wide
    ],
)
def test_shard_lengths(length, width, tile_tokens, shards, expected):
    settings = TileSettings.parse(["SwiGLU"], tile_tokens=tile_tokens, shards=shards)
    assert shard_lengths(length, width, settings) == expected


# -- refusals -------------------------------------------------------------------------------------

_MIXES = (
    r"^apply_tiling\(targets=\.\.\.\): the model \({cls}\) cannot be tiled: a tiled forward runs each shard of "
    r"the sequence without the others, .* Seen on 4 positions of its first input: {seen}"
)


_DIFFERS = r"run one position at a time, its output at position \d differs by [0-9.e-]+ from its output with the 4 positions together \(outputs up to [0-9.e-]+\)\.$"


@pytest.mark.parametrize(
    ("module", "batch", "seen"),
    [
        (SelfAttention, 2, _DIFFERS),
        (SequenceConv, 2, _DIFFERS),
        (CapacityMoE, 1, _DIFFERS),  # one sequence: with two, it drops alike alone and together (see the docstring)
        (IndexedPositions, 2, _DIFFERS),
        (BatchNormMLP, 2, _DIFFERS),
        (BatchNormMLP, 1, r"run one position at a time, it raised ValueError: Expected more than 1 value per channel"),
    ],
)
def test_a_module_that_mixes_positions_is_refused_at_its_first_call(module, batch, seen):
    torch.manual_seed(0)
    net = module(DIM)
    apply_tiling(net, type(net).__name__)
    with pytest.raises(ValueError, match=_MIXES.format(cls=type(net).__name__, seen=seen)):
        net(_x(batch=batch))


def test_capacity_limited_routing_is_refused_when_one_changed_token_displaces_another():
    # The probe's tokens fill both experts exactly, so each position alone gives the same output;
    # the changed position switches experts and pushes a later token past capacity.
    net = SignRoutedMoE(DIM)
    apply_tiling(net, "SignRoutedMoE")
    seen = r"changing position 1 of its input changed its output at position \d by [0-9.e-]+ \(outputs up to [0-9.e-]+\)\.$"
    with pytest.raises(ValueError, match=_MIXES.format(cls="SignRoutedMoE", seen=seen)):
        net(balanced_tokens(batch=1))


def test_a_buffer_written_from_the_inputs_values_is_refused():
    torch.manual_seed(0)
    net = ActivationObserver(DIM)
    apply_tiling(net, "ActivationObserver")
    with pytest.raises(
        ValueError,
        match=r"^apply_tiling\(targets=\.\.\.\): the model \(ActivationObserver\) cannot be tiled: its forward writes "
        r"buffer 'largest' from its input's values \(changing position 1 of 4 changed what it wrote\); a tiled "
        r"forward would write it from the first shard alone\.$",
    ):
        net(_x())
    assert net.largest.item() == 0.0  # the check wrote only copies


def test_a_module_reading_a_tensor_that_requires_grad_besides_its_own_parameters_is_refused():
    torch.manual_seed(0)
    owner = nn.Linear(DIM, DIM)
    net = nn.Sequential(owner, SharedScale(owner, DIM))
    apply_tiling(net, "SharedScale")
    with pytest.raises(
        ValueError,
        match=r"^apply_tiling\(targets=\.\.\.\): module '1' \(SharedScale\) cannot be tiled: its output depends on 1 "
        r"tensor\(s\) that require grad besides its input and its own parameters \(\[16, 16\] \(float32\)\); a tiled "
        r"backward computes the gradients of those two only, so theirs would be lost\.",
    ):
        net(_x())


def test_a_first_call_in_inference_mode_leaves_the_check_to_the_next_call():
    torch.manual_seed(0)
    owner = nn.Linear(DIM, DIM)
    net = nn.Sequential(owner, SharedScale(owner, DIM))
    apply_tiling(net, "SharedScale")
    with torch.inference_mode():
        net(_x())  # validation: no graph, so the foreign parameter cannot be seen here
    with pytest.raises(ValueError, match=r"module '1' \(SharedScale\) cannot be tiled: its output depends on 1 tensor"):
        net(_x())


def test_a_checkpointed_module_is_not_tiled_too():
    model = blocks()
    apply_checkpointing(model, "SwiGLU")
    with pytest.raises(ValueError, match=r"^apply_tiling\(targets=\.\.\.\): module '0.mlp' \(SwiGLU\) is checkpointed itself"):
        apply_tiling(model, "SwiGLU")


def test_an_input_without_positions_is_refused_naming_the_module():
    net = SwiGLU(DIM)
    apply_tiling(net, "SwiGLU")
    with pytest.raises(ValueError, match=r"^apply_tiling\(targets=\.\.\.\): the model \(SwiGLU\) got a tensor of shape \[16\]"):
        net(torch.randn(DIM))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"targets": []}, r"^apply_tiling\(targets=\.\.\.\): expected at least one class name, class or module-name pattern; an empty list tiles nothing$"),
        ({"targets": "Nope"}, r"^apply_tiling\(targets=\.\.\.\): 'Nope' matches no module of the model"),
        ({"targets": "SwiGLU", "tile_tokens": 0}, r"^apply_tiling\(tile_tokens=\.\.\.\): expected an integer >= 1 or None; got 0$"),
        ({"targets": "SwiGLU", "shards": 2.0}, r"^apply_tiling\(shards=\.\.\.\): expected an integer >= 1 or None; got 2\.0$"),
        ({"targets": "SwiGLU", "shards": 2, "tile_tokens": 8}, r"^apply_tiling\(shards=\.\.\.\): give either tile_tokens \(positions per shard\) or shards \(shards per sequence\), not both$"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_tiling(blocks(depth=1), **kwargs)
