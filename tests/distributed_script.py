"""Run by tests/test_distributed.py: 2 CPU processes (gloo), FSDP2 (ModelParallelStrategy,
``fully_shard`` in ``configure_model``) and DDP, with and without LightMem.

One launch checks several things to keep the test short; every rank writes what it saw and rank 0
writes ``report.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from exact import assert_same
from lit_models import LitGPT, token_loader
from process_group import leave
from pytorch_lightning.loggers import Logger
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightmem import LightMem
from lightmem.blocks import find_blocks
from lightmem.checkpoint import apply_checkpointing, is_checkpointed
from lightmem.metrics.names import key

OFFLOADED = key("offload/offloaded_GiB")
RSS = key("host/rss_GiB")
STEPS = 3


class MemoryLogger(Logger):
    name = "memory"
    version = 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


class ShardedGPT(LitGPT):
    """TinyGPT with every Block and the root sharded by FSDP2 in configure_model (Lightning's recipe)."""

    def __init__(self) -> None:
        super().__init__(depth=3, build_in_configure_model=True)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class ShardedHFGPT2(LitGPT):
    """A 2-layer GPT-2 from transformers (built from a config, nothing downloaded), each GPT2Block
    and the root sharded by FSDP2: the case of issue 9."""

    def __init__(self) -> None:
        super().__init__(build_in_configure_model=True)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4)
        self.model = GPT2LMHeadModel(config)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss


class RecordingDDP(DDPStrategy):
    """DDP that records whether LightMem's checkpointing was in place when the strategy wrapped the model."""

    def _setup_model(self, model):
        self.checkpointed_at_wrap = [is_checkpointed(b) for b in self.lightning_module.model.blocks]
        return super()._setup_model(model)


def _local(value):
    """DTensor -> this rank's shard, recursively, so states compare bitwise without collectives."""
    if isinstance(value, torch.distributed.tensor.DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_local(v) for v in value]
    return value


def _state(module, trainer):
    return _local({"model": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()})


def _lightmem():
    return LightMem(checkpoint=["Block"], offload_devices=["cpu"], offload_min_bytes=0, log_every_n_steps=1)


def fit(module, strategy, callbacks=(), logger=False, max_steps=STEPS, root=None, ckpt_path=None):
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=logger,
        callbacks=list(callbacks), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module, token_loader(batches=8), ckpt_path=ckpt_path)
    return trainer


def _same(expected, actual, where):
    """True where ``actual`` is bitwise ``expected``, else what differs."""
    try:
        assert_same(expected, actual, where)
    except AssertionError as error:
        return str(error)
    return True


def _plan_auto():
    return LightMem(plan="auto", device_budget="4MiB", offload_devices=["cpu"])


def _said(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("lightmem: plan='auto'")]


class CheckpointEveryBlockAtFirstBatch(pl.Callback):
    """What plan="auto" does on a CUDA device where it does not plan (as under FSDP2): every block
    checkpointed at the first batch, after the strategy wrapped the model (find_blocks, apply_checkpointing)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.blocks = list(find_blocks(pl_module).modules)
            self.handle = apply_checkpointing(pl_module, self.blocks, 1)


def _offloaded_per_step(logger):
    return [metrics[OFFLOADED] for _, metrics in logger.rows if OFFLOADED in metrics]


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    checks: dict[str, object] = {}

    pl.seed_everything(0, verbose=False)
    plain = ShardedGPT()
    plain_state = _state(plain, fit(plain, ModelParallelStrategy()))  # what each FSDP2 fit below is held to

    # FSDP2 + LightMem: exact, and the blocks were found through FSDP2's FSDPBlock subclass.
    pl.seed_everything(0, verbose=False)
    sharded = ShardedGPT()
    callback, fsdp_logger = _lightmem(), MemoryLogger()
    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            blocks = pl_module.model.blocks
            seen["classes"] = sorted({type(b).__name__ for b in blocks})
            seen["checkpointed"] = [is_checkpointed(b) for b in blocks]
            seen["sharded"] = all(isinstance(b, FSDPModule) for b in blocks)

    sharded_trainer = fit(sharded, ModelParallelStrategy(), [callback, Spy()], fsdp_logger)
    checks["fsdp2_state_equal"] = _same(plain_state, _state(sharded, sharded_trainer), "FSDP2 state")
    checks["fsdp2_spy"] = seen
    checks["fsdp2_offloaded_GiB"] = _offloaded_per_step(fsdp_logger)
    local_rss = [None, None]
    torch.distributed.all_gather_object(local_rss, callback.last_local_metrics[RSS])
    checks["fsdp2_local_rss_GiB"] = local_rss
    checks["fsdp2_logged_rss_GiB"] = [m[RSS] for _, m in fsdp_logger.rows if RSS in m][-1:]
    checks["fsdp2_checkpoint_undone"] = not any(is_checkpointed(b) for b in sharded.model.blocks)

    # plan="auto" under FSDP2 runs no dry run (what a rank holds is not modelled): trains as written,
    # saying why; and every block checkpointed after the wrap (its fallback on CUDA) stays exact.
    pl.seed_everything(0, verbose=False)
    module, planner = ShardedGPT(), _plan_auto()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(module, ModelParallelStrategy(), [planner])
    checks["fsdp2_plan_auto"] = {
        "said": _said(caught), "planned": planner.chosen_plan is not None,
        "state_equal": _same(plain_state, _state(module, trainer), "FSDP2 plan='auto' state"),
    }  # fmt: skip
    pl.seed_everything(0, verbose=False)
    module, every_block = ShardedGPT(), CheckpointEveryBlockAtFirstBatch()
    trainer = fit(module, ModelParallelStrategy(), [every_block])
    checks["fsdp2_checkpointed_after_wrap"] = {
        "blocks": every_block.blocks, "checkpointed": [is_checkpointed(b) for b in module.model.blocks],
        "state_equal": _same(plain_state, _state(module, trainer), "FSDP2 checkpointed after wrap"),
    }  # fmt: skip

    # fit twice with the same callback, then a checkpoint round trip (distributed checkpoint dir).
    fit(sharded, ModelParallelStrategy(), [callback], max_steps=2)
    checks["fit_twice"] = {
        "checkpointed_blocks_logged": callback.last_metrics.get(key("checkpoint/blocks")),
        "undone": not any(is_checkpointed(b) for b in sharded.model.blocks),
    }
    ckpt = out / "fsdp2.ckpt"
    saver = fit(sharded, ModelParallelStrategy(), [callback], max_steps=1, root=out)
    saver.save_checkpoint(ckpt)
    restored = {}
    for name, callbacks in (("plain", []), ("lightmem", [_lightmem()])):
        module = ShardedGPT()
        restored[name] = _state(module, fit(module, ModelParallelStrategy(), callbacks, max_steps=1, ckpt_path=ckpt))
    checks["round_trip_same_with_and_without_lightmem"] = _same(restored["plain"], restored["lightmem"], "restored state")
    saved = _state(sharded, saver)["model"]
    checks["round_trip_max_abs_diff"] = max(
        (saved[name] - restored["lightmem"]["model"][name]).abs().max().item() for name in saved
    )

    # transformers' GPT-2: "GPT2Block" finds the FSDPGPT2Block modules; the state stays exact.
    states, classes = [], set()
    for callbacks in ([], [LightMem(checkpoint=["GPT2Block"], offload_devices=["cpu"], offload_min_bytes=0)]):
        pl.seed_everything(0, verbose=False)
        module = ShardedHFGPT2()
        trainer = fit(module, ModelParallelStrategy(), callbacks)
        states.append(_state(module, trainer))
        classes |= {type(b).__name__ for b in module.model.transformer.h}
        if callbacks:
            checks["gpt2_checkpointed_blocks"] = callbacks[0].last_metrics.get(key("checkpoint/blocks"))
    checks["gpt2_classes"] = sorted(classes)
    checks["gpt2_state_equal"] = _same(states[0], states[1], "GPT-2 FSDP2 state")

    # DDP, same model and batches: LightMem's checkpoint is applied before the strategy wraps.
    pl.seed_everything(0, verbose=False)
    ddp_logger, ddp = MemoryLogger(), RecordingDDP()
    fit(LitGPT(depth=3), ddp, [_lightmem()], ddp_logger)
    checks["ddp_checkpointed_at_wrap"] = ddp.checkpointed_at_wrap
    checks["ddp_offloaded_GiB"] = _offloaded_per_step(ddp_logger)

    # plan="auto" under DDP: each rank plans its own batches (the same shapes: the same plan), applied
    # after DDP wrapped the model, and the state stays exact.
    states, planners = [], []
    for callbacks in ([], [_plan_auto()]):
        pl.seed_everything(0, verbose=False)
        module = LitGPT(depth=3)
        states.append(_state(module, fit(module, DDPStrategy(), callbacks)))
        planners += callbacks
    checks["ddp_plan_auto"] = {
        "checkpoint": planners[0].chosen_plan.checkpoint, "fits": planners[0].chosen_plan.fits,
        "state_equal": _same(states[0], states[1], "DDP plan='auto' state"),
    }  # fmt: skip

    per_rank = [None, None]
    torch.distributed.all_gather_object(per_rank, checks)
    if torch.distributed.get_rank() == 0:
        (out / "report.json").write_text(json.dumps(per_rank))


if __name__ == "__main__":
    main()
    leave()
