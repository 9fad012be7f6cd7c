"""``LightMem(tile=...)``: applied at setup like checkpointing, said at fit start, undone at teardown;
bad flags fail at construction naming the flag."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from exact import assert_state_equal
from lit_models import LitGPT, cpu_trainer, token_loader

from lightmem import LightMem
from lightmem.tiling import is_tiled

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _fit(callbacks):
    torch.manual_seed(0)
    module = LitGPT()
    trainer = cpu_trainer(callbacks)
    trainer.fit(module, token_loader())
    return module, trainer


def test_tiled_mlps_train_bitwise_as_without_with_one_shard_and_the_fit_start_line_says_so(caplog):
    # 32 positions, 64 wide: the default shard (as long as the input is wide) holds the whole sequence.
    expected, expected_trainer = _fit([])
    seen = {}

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["tiled"] = [name for name, module in pl_module.named_modules() if is_tiled(module)]

    with caplog.at_level("INFO"):
        module, trainer = _fit([LightMem(tile=["model.blocks.*.mlp"], metrics=["host"]), Spy()])
    assert_state_equal(expected, module, expected_trainer.optimizers[0], trainer.optimizers[0])
    assert seen["tiled"] == ["model.blocks.0.mlp", "model.blocks.1.mlp", "model.blocks.2.mlp"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightmem: on:")]
    assert lines[0].startswith(
        "lightmem: on: tiling 3 modules (model.blocks.0.mlp, model.blocks.1.mlp, model.blocks.2.mlp) in shards as "
        "long as the module's input is wide; host metrics."
    )
    assert not any(is_tiled(m) or "forward" in m.__dict__ for m in module.modules())  # undone at teardown


def test_tile_tokens_sets_the_shards_inside_checkpointed_blocks(caplog):
    shapes = set()

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            first_linear = pl_module.model.blocks[0].mlp[0]
            first_linear.register_forward_hook(lambda module, args, out: shapes.add(tuple(args[0].shape)))

    with caplog.at_level("INFO"):
        _fit([LightMem(tile=["model.blocks.*.mlp"], tile_tokens=8, checkpoint=["Block"], metrics=["host"]), Spy()])
    # 32 positions in shards of 8 (forward, the block's re-run, the tile's re-run); 4 positions and
    # 1 position: the first call's position-wise check.
    assert shapes == {(4, 8, 64), (4, 4, 64), (4, 1, 64)}
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("lightmem: on:"))
    assert line.startswith(
        "lightmem: on: checkpointing 3 blocks (model.blocks.0, model.blocks.1, model.blocks.2); tiling 3 modules "
        "(model.blocks.0.mlp, model.blocks.1.mlp, model.blocks.2.mlp) in shards of 8 positions; host metrics."
    )


def test_a_module_that_mixes_positions_stops_the_fit_at_its_first_forward_naming_the_flag():
    with pytest.raises(
        ValueError,
        match=r"^LightMem\(tile=\.\.\.\): module 'model\.blocks\.0\.attn' \(Attention\) cannot be tiled: a tiled forward "
        r"runs each shard of the sequence without the others",
    ):
        _fit([LightMem(tile=["Attention"], metrics=["host"])])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"tile_tokens": 8}, r"^LightMem\(tile_tokens=\.\.\.\): has no effect without LightMem\(tile=\.\.\.\); name the modules to tile or leave tile_tokens unset$"),
        ({"tile": []}, r"^LightMem\(tile=\.\.\.\): expected at least one class name, class or module-name pattern; an empty list tiles nothing$"),
        ({"tile": [3]}, r"^LightMem\(tile=\.\.\.\): expected module names, nn.Module classes or glob patterns; got 3$"),
        ({"tile": ["Block"], "tile_tokens": "8"}, r"^LightMem\(tile_tokens=\.\.\.\): expected an integer >= 1 or None; got '8'$"),
    ],
)
def test_bad_tile_flags_fail_at_construction_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        LightMem(**flags)


def test_a_tile_target_that_matches_nothing_fails_at_setup_naming_the_flag():
    with pytest.raises(ValueError, match=r"^LightMem\(tile=\.\.\.\): 'MLPs' matches no module of the model"):
        _fit([LightMem(tile=["MLPs"], metrics=["host"])])

