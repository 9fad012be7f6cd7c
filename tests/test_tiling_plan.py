"""The planner tiles (issue 59): which modules it may tile is read from the trace (each refusal saying
why), a tile is priced as its module's second forward, plans tile where that fits for less, inside
checkpointed layers too, and ``plan="auto"`` applies the tiling it chose."""

from __future__ import annotations

import copy

import pytest
import torch
import tile_models
from lit_models import LitGPT, cpu_trainer
from test_tiling_estimate import llama, llama_batch, llama_loss
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.data import DataLoader

from lightmem import LightMem, apply_tiling, estimate_memory, plan
from lightmem.config import TileSettings
from lightmem.estimate.settings import parse_settings
from lightmem.estimate.steps import run_configuration
from lightmem.tiling import is_tiled

MLPS = ["model.layers.0.mlp", "model.layers.1.mlp"]


def _sum_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def _x() -> torch.Tensor:
    return torch.randn(2, 37, 16, generator=torch.Generator().manual_seed(0))


class RecordsInput(nn.Module):
    """Position-wise output, but its input's values are copied into a buffer (a tiled forward would
    write one shard's)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("seen", torch.zeros(2, 37, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.copy_(x.detach())
        return self.proj(x)


def test_the_trace_offers_the_mlps_of_a_transformer_and_never_its_attention():
    estimate = estimate_memory(tile_models.blocks(), _x(), _sum_loss, device="cpu")
    assert estimate.tile_candidates == ["0.mlp", "1.mlp"]
    assert estimate.modules["0.attn"].why_not == "moves its positions among its features (transpose.int)"
    # A LayerNorm is position-wise but keeps no more than its input: tiling it would save nothing.
    assert estimate.modules["0.ln1"].position_wise and "0.ln1" not in estimate.tile_candidates


@pytest.mark.parametrize(
    ("model", "name", "why"),
    [
        (lambda: tile_models.SelfAttention(), "0", "moves its positions among its features (transpose.int)"),
        (lambda: tile_models.SequenceConv(), "0.conv", "runs an op on its input that the rule does not read as position-wise (convolution.default)"),
        (lambda: tile_models.BatchNormMLP(), "0.norm", "runs an op on its input that the rule does not read as position-wise (native_batch_norm.default)"),
        (lambda: tile_models.CapacityMoE(), "0", "runs an op on its input that the rule does not read as position-wise (nonzero.default)"),
        (lambda: tile_models.IndexedPositions(), "0", "combines its input with a tensor that varies along its positions (add.Tensor)"),
        (lambda: tile_models.ActivationObserver(), "0", "reduces over its positions (max.default)"),
        (lambda: RecordsInput(), "0", "writes its input's values into a tensor made elsewhere (copy_.default: a buffer, an output given)"),
        (lambda: tile_models.ScalarNoise(), "0", "draws random numbers not per position (rand.default): each shard would draw its own"),
    ],
    ids=["attention", "convolution", "batch norm", "routing with capacity", "position index", "observer", "buffer", "random scale"],
)  # fmt: skip
def test_a_module_that_mixes_positions_is_never_a_candidate_and_the_trace_says_why(model, name, why):
    estimate = estimate_memory(nn.Sequential(model()), _x(), _sum_loss, device="cpu")
    assert estimate.tile_candidates == []
    assert estimate.modules[name].why_not == why


def test_a_module_reading_another_modules_parameter_is_never_a_candidate():
    owner = nn.Linear(16, 16)
    estimate = estimate_memory(nn.Sequential(owner, tile_models.SharedScale(owner)), _x(), _sum_loss, device="cpu")
    assert estimate.tile_candidates == []
    assert estimate.modules["1"].why_not == (
        "reads a tensor that requires grad and is neither its input nor its own parameter (sum.default)"
    )


@pytest.fixture(scope="module")
def llama_estimate():
    model = llama()
    return model, estimate_memory(model, llama_batch(), llama_loss, device="cpu", tile=["LlamaMLP"])


def test_a_tile_is_priced_as_its_modules_second_forward_as_tracing_the_tiled_step_prices_it(llama_estimate):
    model, estimate = llama_estimate
    baseline, tiled = estimate.scenarios["baseline"], estimate.scenarios["tile"]
    forwards = sum(estimate.modules[name].forward_s for name in MLPS)
    assert forwards > 0 and tiled.step_seconds - baseline.step_seconds == pytest.approx(forwards, rel=1e-9)
    # Traced tiled (one shard, the same ops), the re-run in backward is the block's backward, not a
    # checkpoint re-run dropped from the step.
    traced = copy.deepcopy(model)
    apply_tiling(traced, "LlamaMLP", tile_tokens=256)
    again = estimate_memory(traced, llama_batch(), llama_loss, device="cpu")
    for name in MLPS:
        block = name.removesuffix(".mlp")
        added = again.blocks[block].backward_s - estimate.blocks[block].backward_s
        assert added == pytest.approx(estimate.modules[name].forward_s, rel=1e-9)
    assert again.step_seconds == pytest.approx(tiled.step_seconds, rel=1e-9)


def test_a_sampled_dry_run_of_a_tiled_step_allocates_as_one_running_every_shard():
    model = llama()
    settings = parse_settings(
        "test", model, llama_loss, optimizer="adamw", precision="32-true", device="cpu", overhead_bytes=None, budget=None
    )  # fmt: skip
    tile = TileSettings(modules=("LlamaMLP",), tile_tokens=32)  # 8 shards of the 256 positions
    calls: list[int] = []

    def gate_called(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if getattr(module, "out_features", 0) == 1024 and module.in_features == 64:  # a layer's gate or up projection
            calls.append(args[0].shape[-2])

    with register_module_forward_pre_hook(gate_called):  # the dry run calls the stand-in's modules
        every = run_configuration(model, llama_batch(), settings, tile=tile, priced=True)  # priced: every shard runs
        assert calls == [32] * 64  # 2 layers, 2 projections, 8 shards forward and again in backward
        calls.clear()
        sampled = run_configuration(model, llama_batch(), settings, tile=tile)
        assert calls == [32] * 16  # the first and the last shard only
    assert (sampled.peak.bytes, sampled.peak.breakdown) == (every.peak.bytes, every.peak.breakdown)
    assert sampled.reserved_bytes == every.reserved_bytes


def test_a_plan_tiles_the_mlps_where_that_fits_for_less_than_checkpointing(llama_estimate):
    model, estimate = llama_estimate
    budget = int(estimate.scenarios["baseline"].peak_bytes * 0.9)
    chosen = plan(model, llama_batch(), budget, llama_loss, device="cpu", tile=True)
    assert (chosen.fits, chosen.tile, chosen.checkpoint) == (True, ["model.layers.0.mlp"], [])
    assert chosen.lightmem_kwargs() == {"offload": False, "tile": ["model.layers.0.mlp"]}
    assert chosen.parts() == ["tile model.layers.0.mlp (LlamaMLP)"]
    assert chosen.step_seconds == pytest.approx(chosen.baseline_step_seconds + estimate.modules[MLPS[0]].forward_s)
    without = plan(model, llama_batch(), budget, llama_loss, device="cpu")  # by default a plan never tiles
    assert without.fits and without.checkpoint and not without.tile
    assert without.step_seconds > chosen.step_seconds


def test_within_checkpointed_layers_tiling_keeps_the_mlps_intermediates_out_of_the_recompute():
    # 4 Llama layers at 512 positions: every layer checkpointed reserves 28.8 MiB (a layer's re-run makes its
    # MLP intermediates whole), every module tiled 27.3 MiB (attention's scores stay); every module tiled
    # and two layers checkpointed, 21.8 MiB.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=1024, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=128, max_position_embeddings=1024, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    chosen = plan(model, batch, "24MiB", llama_loss, device="cpu", tile=True)
    assert chosen.fits and chosen.checkpoint == ["model.layers.0", "model.layers.1"]
    assert {f"model.layers.{index}.mlp" for index in range(4)} <= set(chosen.tile)
    assert not plan(model, batch, "24MiB", llama_loss, device="cpu").fits


def test_plan_auto_applies_the_tiling_it_chose_for_the_training_batches_and_takes_it_off_after():
    # TinyGPT's blocks (3) at 4 x 33 tokens under 4.29 MiB: tiling the first block's MLP fits.
    seen: list[list[str]] = []

    class Tiled(LitGPT):
        def training_step(self, batch, batch_idx):
            if not is_fake(batch[0]):  # the planner's dry run runs it too, on its stand-in
                seen.append([name for name, module in self.named_modules() if is_tiled(module)])
            return super().training_step(batch, batch_idx)

    tokens = (torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(433)),)
    callback = LightMem(plan="auto", device_budget=4_496_356, offload_devices=["cpu"], tile=True)
    module = Tiled()
    cpu_trainer([callback], max_steps=2).fit(module, DataLoader([tokens] * 2, batch_size=None))
    assert callback.chosen_plan.tile and not callback.chosen_plan.checkpoint
    assert seen == [callback.chosen_plan.tile] * 2
    assert not any(is_tiled(submodule) for submodule in module.modules())


def test_plans_tile_only_when_asked_tiling_being_exact_within_1e_6_not_bitwise():
    assert LightMem(plan="auto").settings.plan.tile is False  # plan="auto" alone keeps training bitwise
    assert LightMem(plan="auto", tile=False).settings.plan.tile is False
    assert (LightMem(plan="auto", tile=True).settings.plan.tile, LightMem(plan="auto", tile=True).settings.tile) == (True, None)
    assert LightMem(plan="auto", tile=["LlamaMLP"]).settings.plan.tile is True  # the user's tiling, and the plans may add
    with pytest.raises(ValueError, match=r"LightMem\(tile=...\): has no effect without LightMem\(plan='auto'\)"):
        LightMem(tile=True)
    with pytest.raises(ValueError, match=r"LightMem\(tile_tokens=...\): has no effect without LightMem\(tile=...\)"):
        LightMem(tile=False, tile_tokens=8)
